//! The HTTP routes of `wisp serve` (axum): bodies read under a size cap and a time limit, the
//! API key checked before anything else, requests handed to the scheduler, its events turned
//! into a JSON response or a stream of server-sent events.

use super::api::{self, Answer, ApiError, Call, Finish, Generation, Head, Kind, Usage, anthropic, responses};
use super::metrics::Metrics;
use super::scheduler::{Event, Job, Scheduler, Task};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The OpenAPI document of every route (`GET /openapi.json`).
pub const OPENAPI: &str = include_str!("openapi.json");

/// What every handler shares.
pub struct App {
    pub scheduler: Arc<Scheduler>,
    pub metrics: Arc<Metrics>,
    /// The id clients name the model by.
    pub model_id: String,
    /// When the model was loaded (seconds since the epoch), for `/v1/models`.
    pub created: u64,
    /// The SHA-256 of the API key, when one is required.
    pub api_key: Option<[u8; 32]>,
    pub max_body: usize,
    /// Longest a request body may take to arrive.
    pub read_timeout: Duration,
    /// Longest a request may take, queue included.
    pub request_timeout: Duration,
    /// The OpenAPI document, naming the served model.
    pub openapi: String,
    /// Values of an embedding.
    pub n_embd: usize,
    /// The most recent responses' conversations (`/v1/responses`), for `previous_response_id`;
    /// the oldest go first past [`KEPT_RESPONSES`].
    pub responses: std::sync::Mutex<VecDeque<(String, responses::Conversation)>>,
}

/// Responses whose conversations are kept for `previous_response_id`.
pub const KEPT_RESPONSES: usize = 256;

/// [`OPENAPI`] with what depends on the served model: its id as the one value of the requests'
/// `model`, its vocabulary as the bound of token ids.
pub fn openapi(model_id: &str, n_vocab: u32) -> String {
    let Ok(mut doc) = serde_json::from_str::<Value>(OPENAPI) else { return OPENAPI.to_string() };
    for request in ["ChatCompletionRequest", "CompletionRequest", "MessagesRequest", "ResponsesRequest", "EmbeddingsRequest"] {
        if let Some(m) = doc.pointer_mut(&format!("/components/schemas/{request}/properties/model")) {
            m["enum"] = json!([model_id]);
        }
    }
    let id = doc.pointer_mut("/components/schemas/TokenId");
    if let Some(id) = id {
        id["maximum"] = json!(n_vocab.saturating_sub(1));
    }
    doc.to_string()
}

/// An [`ApiError`] as axum answers it: the status, the JSON body, `Retry-After` or
/// `WWW-Authenticate` where they apply.
pub struct Failed(pub ApiError);

impl From<ApiError> for Failed {
    fn from(e: ApiError) -> Failed {
        Failed(e)
    }
}

impl IntoResponse for Failed {
    fn into_response(self) -> Response {
        let Failed(e) = self;
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, axum::Json(e.body())).into_response();
        match e.status {
            429 | 503 => {
                r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            401 => {
                r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        r
    }
}

/// Every route, with the API key check and the request counter around them.
pub fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", only(post(chat)))
        .route("/v1/completions", only(post(completions)))
        .route("/v1/messages", only(post(messages)))
        .route("/v1/responses", only(post(responses_route)))
        .route("/v1/embeddings", only(post(embeddings)))
        .route("/v1/models", only(get(models)))
        .route("/v1/models/{id}", only(get(model)))
        .route("/tokenize", only(post(tokenize)))
        .route("/detokenize", only(post(detokenize)))
        .route("/metrics", only(get(metrics)))
        .route_layer(middleware::from_fn_with_state(app.clone(), authorize));
    Router::new()
        .merge(v1)
        .route("/health", only(get(health)))
        .route("/openapi.json", only(get(openapi_json)))
        .fallback(|| async { Failed(ApiError::not_found("no such path; see GET /openapi.json")) })
        .layer(middleware::from_fn_with_state(app.clone(), count))
        .with_state(app)
}

/// A route's other methods answer `405` with a JSON error.
fn only(r: MethodRouter<Arc<App>>) -> MethodRouter<Arc<App>> {
    r.fallback(|| async { Failed(ApiError::method_not_allowed()) })
}

/// The route's name in the metrics (a fixed set, whatever paths clients send).
fn endpoint(path: &str) -> &'static str {
    const KNOWN: [&str; 12] = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/metrics",
        "/health",
        "/openapi.json",
        "/v1/models/{id}",
        "/v1/embeddings",
    ];
    KNOWN.iter().find(|k| **k == path).copied().unwrap_or(if path.starts_with("/v1/models/") { KNOWN[10] } else { "other" })
}

async fn count(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let name = endpoint(req.uri().path());
    let r = next.run(req).await;
    app.metrics.answered(name, r.status().as_u16());
    r
}

async fn authorize(State(app): State<Arc<App>>, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(want) = app.api_key {
        // `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it.
        let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        let given = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        // Digests compared, so the time taken says nothing of the key.
        let ok = given.is_some_and(|k| <[u8; 32]>::from(Sha256::digest(k.trim().as_bytes())) == want);
        if !ok {
            return match req.uri().path() {
                "/v1/messages" => AnthropicFailed(ApiError::unauthorized()).into_response(),
                _ => Failed(ApiError::unauthorized()).into_response(),
            };
        }
    }
    next.run(req).await
}

/// The body, whole: `413` past the cap (at once when `Content-Length` says so), `408` when it
/// trickles in slower than the read timeout.
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > app.max_body as u64) {
        return Err(ApiError::too_large(app.max_body));
    }
    match tokio::time::timeout(app.read_timeout, axum::body::to_bytes(body, app.max_body)).await {
        Err(_) => Err(ApiError::request_timeout()),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let too_large = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source())
                .any(|e| e.is::<http_body_util::LengthLimitError>());
            Err(if too_large { ApiError::too_large(app.max_body) } else { ApiError::invalid(format!("reading the body: {e}")) })
        }
    }
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, Failed> {
    let bytes = read_body(&app, &headers, body).await?;
    generate(app, api::chat_request(&bytes)?, Kind::Chat).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, Failed> {
    let bytes = read_body(&app, &headers, body).await?;
    generate(app, api::completion_request(&bytes)?, Kind::Text).await
}

/// A queued generation whose prompt was accepted: its events, its deadline, its prompt's tokens.
struct Started {
    rx: mpsc::UnboundedReceiver<Event>,
    deadline: Instant,
    limit: Duration,
    prompt_tokens: u32,
}

impl Started {
    /// The next event within the deadline.
    async fn next(&mut self) -> Result<Event, ApiError> {
        match tokio::time::timeout_at(self.deadline.into(), self.rx.recv()).await {
            Err(_) => Err(ApiError::timed_out(self.limit)),
            Ok(None) => Err(ApiError::internal("the engine stopped before the request ended")),
            Ok(Some(Event::Failed(e))) => Err(e),
            Ok(Some(e)) => Ok(e),
        }
    }

    /// Every choice, whole.
    async fn collect(&mut self, choices: usize, logprobs: bool) -> Result<(Vec<Answer>, Usage), ApiError> {
        let mut answers: Vec<Answer> = (0..choices)
            .map(|_| Answer { text: String::new(), finish: Finish::Stop, calls: Vec::new(), logprobs: logprobs.then(Vec::new) })
            .collect();
        let mut usage = Usage::default();
        let mut done = 0;
        while done < choices {
            match self.next().await? {
                Event::Text { index, text, logprobs } => {
                    let a = &mut answers[index];
                    a.text.push_str(&text);
                    if let Some(l) = &mut a.logprobs {
                        l.extend(logprobs);
                    }
                }
                Event::Calls { index, calls } => answers[index].calls = calls,
                Event::Done { index, finish, usage: u } => {
                    answers[index].finish = finish;
                    usage = add_usage(usage, u, done == 0);
                    done += 1;
                }
                Event::Started { .. } | Event::Failed(_) => {}
            }
        }
        Ok((answers, usage))
    }
}

/// Queues a generation and waits for its prompt to be accepted. The receiver of the job's
/// events lives in the response: a client that goes away drops it, and the worker ends the job
/// at its next turn.
async fn submit(app: &App, g: &mut Generation) -> Result<Started, ApiError> {
    if g.model != app.model_id {
        return Err(ApiError::unknown_model(&g.model, &app.model_id));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let arrived = Instant::now();
    let deadline = arrived + app.request_timeout;
    let job = Job {
        prompt: std::mem::replace(&mut g.prompt, api::Prompt::Tokens(Vec::new())),
        max_tokens: g.max_tokens,
        sampling: g.sampling,
        stop: g.stop.clone(),
        constraint: g.constraint.take(),
        logprobs: g.logprobs,
        n: g.n,
        events: tx,
        arrived,
        deadline,
        time_limit: app.request_timeout,
    };
    app.scheduler.submit(job)?;
    let mut started = Started { rx, deadline, limit: app.request_timeout, prompt_tokens: 0 };
    match started.next().await? {
        Event::Started { prompt_tokens } => started.prompt_tokens = prompt_tokens,
        _ => return Err(ApiError::internal("the engine stopped before the request ended")),
    }
    Ok(started)
}

/// Queues a generation, waits for its prompt to be accepted, then answers with the whole text
/// or streams it.
async fn generate(app: Arc<App>, mut g: Generation, kind: Kind) -> Result<Response, Failed> {
    let mut started = submit(&app, &mut g).await?;
    let (choices, logprobs) = (g.n as usize, g.logprobs.is_some());
    let head = Head::new(kind, &app.model_id);
    if g.stream {
        return Ok(stream(head, started.rx, choices, logprobs, g.include_usage).into_response());
    }
    let (answers, usage) = started.collect(choices, logprobs).await?;
    Ok(axum::Json(head.response_of(&answers, usage)).into_response())
}

/// An [`ApiError`] in Anthropic's shape (`/v1/messages`).
pub struct AnthropicFailed(pub ApiError);

impl From<ApiError> for AnthropicFailed {
    fn from(e: ApiError) -> AnthropicFailed {
        AnthropicFailed(e)
    }
}

impl IntoResponse for AnthropicFailed {
    fn into_response(self) -> Response {
        let mut r = Failed(self.0.clone()).into_response();
        *r.body_mut() = Body::from(anthropic::error_body(&self.0).to_string());
        r
    }
}

/// `POST /v1/messages`: Anthropic's Messages API, a message or its stream of events.
async fn messages(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, AnthropicFailed> {
    let bytes = read_body(&app, &headers, body).await?;
    let mut g = anthropic::messages_request(&bytes)?;
    let mut started = submit(&app, &mut g).await?;
    let head = anthropic::MessageHead::new(&app.model_id, g.stop.clone());
    if !g.stream {
        let (answers, usage) = started.collect(1, false).await?;
        let a = &answers[0];
        return Ok(axum::Json(head.response(&a.text, &a.calls, a.finish, usage)).into_response());
    }
    let sse = |(kind, v): (&'static str, Value)| SseEvent::default().event(kind).data(v.to_string());
    let usage = Usage { prompt_tokens: started.prompt_tokens, ..Usage::default() };
    let first = vec![head.start_event(usage), ("ping", json!({"type": "ping"}))];
    // (blocks so far, whether a text block is open)
    let state = (started, head, VecDeque::from_iter(first.into_iter().map(sse)), 0usize, false, false);
    let events = futures_util::stream::unfold(state, move |(mut st, head, mut out, mut blocks, mut open, mut done)| async move {
        loop {
            if let Some(e) = out.pop_front() {
                return Some((Ok::<_, Infallible>(e), (st, head, out, blocks, open, done)));
            }
            if done {
                return None;
            }
            let close = |out: &mut VecDeque<SseEvent>, open: &mut bool, blocks: &mut usize| {
                if std::mem::take(open) {
                    out.push_back(sse(anthropic::MessageHead::block_stop(*blocks)));
                    *blocks += 1;
                }
            };
            match st.next().await {
                Ok(Event::Text { text, .. }) => {
                    out.extend(anthropic::MessageHead::text_events(blocks, &text, !open).into_iter().map(sse));
                    open = true;
                }
                Ok(Event::Calls { calls, .. }) => {
                    close(&mut out, &mut open, &mut blocks);
                    for c in &calls {
                        out.extend(anthropic::MessageHead::call_events(blocks, c).into_iter().map(sse));
                        blocks += 1;
                    }
                }
                Ok(Event::Done { finish, usage, .. }) => {
                    close(&mut out, &mut open, &mut blocks);
                    out.extend(head.end_events(finish, usage).into_iter().map(sse));
                    done = true;
                }
                Ok(_) => {}
                Err(e) => {
                    out.push_back(sse(("error", anthropic::error_body(&e))));
                    done = true;
                }
            }
        }
    });
    Ok(Sse::new(events).into_response())
}

/// `POST /v1/responses`: OpenAI's Responses API, a response object or its stream of events.
async fn responses_route(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, Failed> {
    let bytes = read_body(&app, &headers, body).await?;
    let kept = |id: &str| {
        let kept = app.responses.lock().unwrap_or_else(|p| p.into_inner());
        kept.iter().find(|(k, _)| k == id).map(|(_, c)| c.clone())
    };
    let (mut g, conversation, echo) = responses::responses_request(&bytes, kept)?;
    let mut started = submit(&app, &mut g).await?;
    let mut head = responses::ResponseHead::new(&app.model_id, echo);
    let keep = move |app: &App, id: String, c: responses::Conversation| {
        let mut kept = app.responses.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= KEPT_RESPONSES {
            kept.pop_front();
        }
        kept.push_back((id, c));
    };
    if !g.stream {
        let (answers, usage) = started.collect(1, false).await?;
        let a = &answers[0];
        keep(&app, head.id.clone(), responses::ResponseHead::conversation(conversation, &a.text, &a.calls));
        return Ok(axum::Json(head.object(&a.text, &a.calls, Some((a.finish, usage)))).into_response());
    }
    let sse = |(kind, v): (&'static str, Value)| SseEvent::default().event(kind).data(v.to_string());
    let first: VecDeque<SseEvent> = head.start_events().into_iter().map(sse).collect();
    struct St {
        started: Started,
        head: responses::ResponseHead,
        out: VecDeque<SseEvent>,
        text: String,
        calls: Vec<Call>,
        open: bool,
        done: bool,
        conversation: Option<responses::Conversation>,
        app: Arc<App>,
    }
    let state = St { started, head, out: first, text: String::new(), calls: Vec::new(), open: false, done: false, conversation: Some(conversation), app: app.clone() };
    let events = futures_util::stream::unfold(state, move |mut s| async move {
        loop {
            if let Some(e) = s.out.pop_front() {
                return Some((Ok::<_, Infallible>(e), s));
            }
            if s.done {
                return None;
            }
            match s.started.next().await {
                Ok(Event::Text { text, .. }) => {
                    if !std::mem::replace(&mut s.open, true) {
                        s.out.extend(s.head.open_text_events().into_iter().map(sse));
                    }
                    s.out.push_back(sse(s.head.text_event(&text)));
                    s.text.push_str(&text);
                }
                Ok(Event::Calls { calls, .. }) => s.calls = calls,
                Ok(Event::Done { finish, usage, .. }) => {
                    if s.open {
                        s.out.extend(s.head.close_text_events(&s.text).into_iter().map(sse));
                    }
                    let first = usize::from(s.open);
                    for (i, c) in s.calls.iter().enumerate() {
                        s.out.extend(s.head.call_events(first + i, c).into_iter().map(sse));
                    }
                    s.out.push_back(sse(s.head.end_event(&s.text, &s.calls, finish, usage)));
                    let before = s.conversation.take().unwrap_or_default();
                    keep(&s.app, s.head.id.clone(), responses::ResponseHead::conversation(before, &s.text, &s.calls));
                    s.done = true;
                }
                Ok(_) => {}
                Err(e) => {
                    s.out.push_back(sse(s.head.error_event(&e)));
                    s.done = true;
                }
            }
        }
    });
    Ok(Sse::new(events).into_response())
}

/// The usage of a request's choices: the prompt once (the first's), the generated tokens of all.
fn add_usage(sum: Usage, u: Usage, first: bool) -> Usage {
    match first {
        true => u,
        false => Usage { completion_tokens: sum.completion_tokens + u.completion_tokens, ..sum },
    }
}

/// The events of one generation as server-sent events: for each choice the role, the text (with
/// its log-probabilities where asked), its calls, its finish reason; the usage when asked, then
/// `data: [DONE]`. An error after the first byte is a `data:` object with `error` (as OpenAI's
/// API streams one), then `[DONE]`.
fn stream(head: Head, rx: mpsc::UnboundedReceiver<Event>, choices: usize, logprobs: bool, include_usage: bool) -> impl IntoResponse {
    struct State {
        rx: mpsc::UnboundedReceiver<Event>,
        head: Head,
        include_usage: bool,
        out: VecDeque<SseEvent>,
        done: bool,
        /// Choices not yet finished, their usage so far, and each one's text bytes so far.
        left: usize,
        usage: Usage,
        offsets: Vec<usize>,
        logprobs: bool,
    }
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let mut out = VecDeque::new();
    for index in 0..choices {
        out.extend(head.opening_chunk_of(index).map(data));
    }
    let state = State { rx, head, include_usage, out, done: false, left: choices, usage: Usage::default(), offsets: vec![0; choices], logprobs };
    let events = futures_util::stream::unfold(state, move |mut s| async move {
        loop {
            if let Some(e) = s.out.pop_front() {
                return Some((Ok::<_, Infallible>(e), s));
            }
            if s.done {
                return None;
            }
            let end = |s: &mut State, last: Vec<Value>| {
                s.out.extend(last.into_iter().map(data));
                s.out.push_back(SseEvent::default().data("[DONE]"));
                s.done = true;
            };
            match s.rx.recv().await {
                Some(Event::Text { index, text, logprobs }) => {
                    let lp = s.logprobs.then(|| s.head.logprobs_json(&logprobs, s.offsets[index]));
                    s.offsets[index] += text.len();
                    s.out.push_back(data(s.head.text_chunk_of(index, &text, lp)));
                }
                Some(Event::Calls { index, calls }) => s.out.push_back(data(s.head.calls_chunk_of(index, &calls))),
                Some(Event::Done { index, finish, usage }) => {
                    s.usage = add_usage(s.usage, usage, s.left == s.offsets.len());
                    s.left -= 1;
                    s.out.push_back(data(s.head.finish_chunk_of(index, finish)));
                    if s.left == 0 {
                        let last = if s.include_usage { vec![s.head.usage_chunk(s.usage)] } else { Vec::new() };
                        end(&mut s, last);
                    }
                }
                Some(Event::Failed(e)) => end(&mut s, vec![e.body()]),
                Some(Event::Started { .. }) => {}
                None => end(&mut s, vec![ApiError::internal("the engine stopped before the request ended").body()]),
            }
        }
    });
    Sse::new(events)
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Result<Response, Failed> {
    if id != app.model_id {
        return Err(ApiError::unknown_model(&id, &app.model_id).into());
    }
    Ok(axum::Json(model_object(&app)).into_response())
}

fn model_object(app: &App) -> Value {
    api::model_object(&app.model_id, app.created)
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn openapi_json(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], app.openapi.clone()).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.encode()).into_response()
}

/// Hands a task to the scheduler and waits for its answer within the request's time limit.
async fn task<T>(app: &App, make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Task) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    app.scheduler.task(make(tx))?;
    match tokio::time::timeout(app.request_timeout, rx).await {
        Err(_) => Err(ApiError::timed_out(app.request_timeout)),
        Ok(Err(_)) => Err(ApiError::internal("the engine stopped before the request ended")),
        Ok(Ok(r)) => r,
    }
}

/// `POST /v1/embeddings`: the inputs' vectors, pooled as `--pooling` says, L2-normalized.
async fn embeddings(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, Failed> {
    let bytes = read_body(&app, &headers, body).await?;
    let r = api::embeddings::embeddings_request(&bytes, app.n_embd)?;
    if r.model != app.model_id {
        return Err(ApiError::unknown_model(&r.model, &app.model_id).into());
    }
    let (vectors, tokens) = task(&app, |reply| Task::Embed { inputs: r.inputs, reply }).await?;
    Ok(axum::Json(api::embeddings::embeddings_response(&app.model_id, &vectors, r.encoding, tokens)).into_response())
}

async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, Failed> {
    let bytes = read_body(&app, &headers, body).await?;
    let r: api::TokenizeRequest = api::parse(&bytes)?;
    let pieces = task(&app, |reply| Task::Tokenize {
        text: r.content,
        add_special: r.add_special,
        parse_special: r.parse_special,
        with_pieces: r.with_pieces,
        reply,
    })
    .await?;
    let tokens: Vec<Value> = pieces
        .into_iter()
        .map(|(id, piece)| match piece {
            Some(piece) => json!({"id": id, "piece": piece}),
            None => json!(id),
        })
        .collect();
    Ok(axum::Json(json!({"tokens": tokens})).into_response())
}

async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Result<Response, Failed> {
    let bytes = read_body(&app, &headers, body).await?;
    let r: api::DetokenizeRequest = api::parse(&bytes)?;
    if r.tokens.len() > api::MAX_TOKEN_IDS {
        return Err(ApiError::invalid_param("tokens", format!("more than {} tokens", api::MAX_TOKEN_IDS)).into());
    }
    let tokens = r.tokens.into_iter().map(|t| t.0).collect();
    let content = task(&app, |reply| Task::Detokenize { tokens, reply }).await?;
    Ok(axum::Json(json!({"content": content})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_openapi_document_describes_every_route_and_names_the_model() {
        let doc: Value = serde_json::from_str(&openapi("m", 10)).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        for p in ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings", "/v1/models", "/v1/models/{model}", "/tokenize", "/detokenize", "/health", "/metrics", "/openapi.json"] {
            assert!(paths.contains_key(p), "{p} is not documented");
        }
        assert_eq!(doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["enum"], json!(["m"]));
        assert_eq!(doc["components"]["schemas"]["TokenId"]["maximum"], json!(9));
    }

    #[test]
    fn metrics_name_known_routes_and_fold_the_rest() {
        assert_eq!(endpoint("/v1/completions"), "/v1/completions");
        assert_eq!(endpoint("/v1/models/abc"), "/v1/models/{id}");
        assert_eq!(endpoint("/anything/else"), "other");
    }
}
