//! OpenAI's embeddings (`POST /v1/embeddings`): the request read and checked, the response
//! written, each vector as a list of numbers or, with `encoding_format: "base64"` (what the
//! `openai` package asks for by default), as the base64 of its little-endian f32 values.

use crate::{ApiError, Integer, TokenId, parse};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};

/// The most inputs one request embeds (OpenAI's limit, and the engine's per call).
pub const MAX_INPUTS: usize = 2048;

/// One input: a text, or token ids as they are.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Text(String),
    Tokens(Vec<u32>),
}

/// How the vectors are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Float,
    Base64,
}

/// A checked embeddings request.
#[derive(Debug)]
pub struct EmbeddingsRequest {
    pub model: String,
    pub inputs: Vec<Input>,
    pub encoding: Encoding,
}

#[derive(Deserialize)]
struct Body {
    model: String,
    input: InputField,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<Integer>,
    /// OpenAI's end-user id: read (a string, or null) and not used.
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum InputField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<TokenId>),
    TokenLists(Vec<Vec<TokenId>>),
}

/// `POST /v1/embeddings` for a model whose vectors have `width` values: `input` a string, a
/// list of strings, a list of token ids or a list of such lists (1 to [`MAX_INPUTS`], none
/// empty, at most [`crate::MAX_TOKEN_IDS`] token ids in all); `encoding_format` `float` (the
/// default) or `base64`; `dimensions`, where given, must be `width` (the vectors are not
/// shortened).
pub fn embeddings_request(bytes: &[u8], width: usize) -> Result<EmbeddingsRequest, ApiError> {
    let body: Body = parse(bytes)?;
    let inputs: Vec<Input> = match body.input {
        InputField::Text(t) => vec![Input::Text(t)],
        InputField::Texts(t) => t.into_iter().map(Input::Text).collect(),
        InputField::Tokens(t) => vec![Input::Tokens(t.into_iter().map(|t| t.0).collect())],
        InputField::TokenLists(l) => l.into_iter().map(|t| Input::Tokens(t.into_iter().map(|t| t.0).collect())).collect(),
    };
    if inputs.is_empty() || inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid_param("input", format!("{} inputs: 1 to {MAX_INPUTS} are taken", inputs.len())));
    }
    let mut ids = 0usize;
    for (i, input) in inputs.iter().enumerate() {
        let empty = match input {
            Input::Text(t) => t.is_empty(),
            Input::Tokens(t) => {
                ids += t.len();
                t.is_empty()
            }
        };
        if empty {
            return Err(ApiError::invalid_param("input", format!("input[{i}] is empty")));
        }
    }
    if ids > crate::MAX_TOKEN_IDS {
        return Err(ApiError::invalid_param("input", format!("more than {} token ids", crate::MAX_TOKEN_IDS)));
    }
    let encoding = match body.encoding_format.as_deref() {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => return Err(ApiError::invalid_param("encoding_format", format!("encoding_format {other:?}: float or base64"))),
    };
    if let Some(Integer(d)) = body.dimensions {
        if d != width as i64 {
            return Err(ApiError::invalid_param("dimensions", format!("this model's embeddings have {width} dimensions, not {d}")));
        }
    }
    Ok(EmbeddingsRequest { model: body.model, inputs, encoding })
}

/// Input `i`'s tokens (`ids`), checked to fit a request's context of `ctx` tokens: `input[i]`
/// with no tokens is a 400, one past the context `context_length_exceeded`.
pub fn input_tokens(i: usize, ids: Vec<u32>, ctx: u32) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid_param("input", format!("input[{i}] has no tokens")));
    }
    if ids.len() > ctx as usize {
        let message = format!("input[{i}] is {} tokens, and a request's context holds {ctx}", ids.len());
        return Err(ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid_param("input", message) });
    }
    Ok(ids)
}

/// The response: one `embedding` object for each vector, in order, and the tokens embedded.
pub fn embeddings_response(model: &str, vectors: &[Vec<f32>], encoding: Encoding, prompt_tokens: u32) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = match encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    json!({"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_of_input_is_read() {
        let read = |body: &str| embeddings_request(body.as_bytes(), 4).map(|r| r.inputs);
        assert_eq!(read(r#"{"model":"m","input":"hi"}"#).unwrap(), vec![Input::Text("hi".into())]);
        assert_eq!(read(r#"{"model":"m","input":["a","b"]}"#).unwrap(), vec![Input::Text("a".into()), Input::Text("b".into())]);
        assert_eq!(read(r#"{"model":"m","input":[1,2.0]}"#).unwrap(), vec![Input::Tokens(vec![1, 2])]);
        assert_eq!(read(r#"{"model":"m","input":[[1],[2,3]]}"#).unwrap(), vec![Input::Tokens(vec![1]), Input::Tokens(vec![2, 3])]);
    }

    #[test]
    fn bad_requests_name_their_field() {
        let param = |body: &str| embeddings_request(body.as_bytes(), 4).unwrap_err().param;
        for (body, field) in [
            (r#"{"model":"m","input":[]}"#, "input"),
            (r#"{"model":"m","input":""}"#, "input"),
            (r#"{"model":"m","input":["a",""]}"#, "input"),
            (r#"{"model":"m","input":[[1],[]]}"#, "input"),
            (r#"{"model":"m","input":{"text":"a"}}"#, "input"),
            (r#"{"model":"m","input":[-1]}"#, "input"),
            (r#"{"model":"m","input":"a","encoding_format":"int8"}"#, "encoding_format"),
            (r#"{"model":"m","input":"a","dimensions":3}"#, "dimensions"),
            (r#"{"input":"a"}"#, "."),
        ] {
            let got = param(body);
            assert!(got.as_deref() == Some(field) || (field == "." && got.is_none()), "{body}: {got:?}");
        }
        let many = format!(r#"{{"model":"m","input":[{}]}}"#, vec!["\"a\""; MAX_INPUTS + 1].join(","));
        assert_eq!(param(&many).as_deref(), Some("input"));
        assert!(embeddings_request(br#"{"model":"m","input":"a","dimensions":4}"#, 4).is_ok());
    }

    #[test]
    fn an_inputs_tokens_must_be_some_and_fit_the_context() {
        assert_eq!(input_tokens(0, vec![1, 2], 2).unwrap(), vec![1, 2]);
        assert_eq!(input_tokens(1, vec![], 2).unwrap_err().param.as_deref(), Some("input"));
        let e = input_tokens(2, vec![1, 2, 3], 2).unwrap_err();
        assert_eq!((e.param.as_deref(), e.code), (Some("input"), Some("context_length_exceeded")));
        assert!(e.message.contains("input[2] is 3 tokens"), "{}", e.message);
    }

    #[test]
    fn base64_is_the_little_endian_floats() {
        let r = embeddings_response("m", &[vec![1.0, -0.5]], Encoding::Base64, 3);
        let b64 = r["data"][0]["embedding"].as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
        assert_eq!(bytes, [1.0f32.to_le_bytes(), (-0.5f32).to_le_bytes()].concat());
        assert_eq!(r["usage"], json!({"prompt_tokens": 3, "total_tokens": 3}));
        let r = embeddings_response("m", &[vec![0.25]], Encoding::Float, 1);
        assert_eq!(r["data"][0], json!({"object": "embedding", "index": 0, "embedding": [0.25]}));
    }
}
