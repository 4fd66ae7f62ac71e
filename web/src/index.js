// wisp in a browser: the guest component in a dedicated worker, behind an OpenAI-shaped API.
//
//   import { createEngine } from 'wisp-web';
//   const engine = await createEngine({ model: { url: '/models/gemma-3-270m-q4_k_m.gguf' } });
//   const stream = await engine.chat.completions.create({ messages, stream: true, max_tokens: 64 });
//   for await (const chunk of stream) out.textContent += chunk.choices[0]?.delta?.content ?? '';
//
// The page only posts messages: the guest, WebGPU and the model live in the worker (worker.js).
// Models are cached in Cache Storage by their sha256 (cache.js): a second visit loads them
// without downloading. Types: index.d.ts.

import { deleteCachedModel, listCachedModels, modelRef } from './cache.js';

export { deleteCachedModel, listCachedModels };

/** An engine error: `code` names it (OpenAI's codes for bad requests, the guest's error tags). */
export class WispError extends Error {
  constructor(message, { code = 'engine_error', param = null, type } = {}) {
    super(message);
    this.name = 'WispError';
    this.code = code;
    this.param = param;
    this.type = type ?? (['invalid_request_error', 'context_length_exceeded'].includes(code) ? 'invalid_request_error' : 'engine_error');
  }
}

function abortError(message = 'the request was aborted') {
  const e = new Error(message);
  e.name = 'AbortError';
  return e;
}

function fromWire(w) {
  if (w?.name === 'AbortError') return abortError(w.message);
  return new WispError(w?.message ?? 'unknown error', { code: w?.code, param: w?.param });
}

// ---- requests -------------------------------------------------------------------------------

/** The most stop sequences a request may give (OpenAI's limit), and the longest, in characters. */
const MAX_STOPS = 4;
const MAX_STOP_CHARS = 256;
/** The longest constraint source (a schema, regex or grammar), in characters. */
const MAX_CONSTRAINT_CHARS = 1 << 20;
/** The most messages, and the most characters of a prompt or of all messages. */
const MAX_MESSAGES = 4096;
const MAX_PROMPT_CHARS = 4 << 20;

const bad = (param, message) => new WispError(`${param}: ${message}`, { code: 'invalid_request_error', param });

function number(body, name, lo, hi, dflt) {
  const v = body[name];
  if (v === undefined || v === null) return dflt;
  if (typeof v !== 'number' || !Number.isFinite(v) || v < lo || v > hi) throw bad(name, `a number from ${lo} to ${hi}, not ${JSON.stringify(v)}`);
  return v;
}

function integer(body, name, lo, hi, dflt) {
  const v = number(body, name, lo, hi, dflt);
  if (v !== dflt && !Number.isInteger(v)) throw bad(name, `an integer, not ${v}`);
  return v;
}

function messageText(content, i) {
  if (typeof content === 'string') return content;
  if (Array.isArray(content)) {
    return content
      .map((part, j) => {
        if (part?.type !== 'text' || typeof part.text !== 'string') throw bad(`messages[${i}].content[${j}]`, 'only text parts are supported');
        return part.text;
      })
      .join('');
  }
  throw bad(`messages[${i}].content`, 'a string or a list of text parts');
}

function constraintOf(body) {
  const found = [];
  const schemaText = (param, s) => {
    if (!(typeof s === 'boolean' || (s && typeof s === 'object' && !Array.isArray(s)))) throw bad(param, 'a JSON schema is an object');
    return JSON.stringify(s);
  };
  const f = body.response_format;
  if (f !== undefined && f !== null) {
    if (f.type === 'json_object') found.push({ tag: 'json-schema', val: f.schema ? schemaText('response_format.schema', f.schema) : '{"type":"object"}' });
    else if (f.type === 'json_schema') {
      if (!f.json_schema || typeof f.json_schema !== 'object') throw bad('response_format.json_schema', 'a json_schema object ({ name, schema })');
      found.push({ tag: 'json-schema', val: f.json_schema.schema ? schemaText('response_format.json_schema.schema', f.json_schema.schema) : '{}' });
    } else if (f.type !== 'text') throw bad('response_format', 'its type is one of "text", "json_object" and "json_schema"');
  }
  if (body.json_schema !== undefined && body.json_schema !== null) found.push({ tag: 'json-schema', val: schemaText('json_schema', body.json_schema) });
  for (const [name, tag] of [['regex', 'regex'], ['grammar', 'lark']]) {
    const v = body[name];
    if (v === undefined || v === null) continue;
    if (typeof v !== 'string') throw bad(name, 'a string');
    found.push({ tag, val: v });
  }
  if (found.length > 1) throw bad('response_format', 'at most one of response_format, json_schema, regex and grammar');
  if (found[0] && found[0].val.length > MAX_CONSTRAINT_CHARS) throw bad('response_format', `a constraint is at most ${MAX_CONSTRAINT_CHARS} characters`);
  return found[0] ?? null;
}

/** What the worker runs for `body`: the prompt, the sampling, the limits. Throws a WispError. */
function job(kind, body) {
  if (!body || typeof body !== 'object') throw bad('body', 'a request is an object');
  const out = { kind };
  if (kind === 'chat') {
    const m = body.messages;
    if (!Array.isArray(m) || m.length === 0) throw bad('messages', 'a non-empty list of { role, content }');
    if (m.length > MAX_MESSAGES) throw bad('messages', `at most ${MAX_MESSAGES} messages`);
    out.messages = m.map((msg, i) => {
      if (!msg || typeof msg.role !== 'string' || !msg.role) throw bad(`messages[${i}].role`, 'a string');
      return { role: msg.role, content: messageText(msg.content, i) };
    });
    if (out.messages.reduce((n, x) => n + x.content.length, 0) > MAX_PROMPT_CHARS) throw bad('messages', `at most ${MAX_PROMPT_CHARS} characters in all`);
  } else {
    if (typeof body.prompt !== 'string' || !body.prompt) throw bad('prompt', 'a non-empty string');
    if (body.prompt.length > MAX_PROMPT_CHARS) throw bad('prompt', `at most ${MAX_PROMPT_CHARS} characters`);
    out.prompt = body.prompt;
  }
  if ((body.n ?? 1) !== 1) throw bad('n', 'only n = 1 is supported');
  for (const name of ['presence_penalty', 'frequency_penalty']) {
    if (number(body, name, -2, 2, 0) !== 0) throw bad(name, `${name} is not supported (use repeat_penalty)`);
  }
  if (body.logprobs && body.logprobs !== 0) throw bad('logprobs', 'logprobs are not supported');
  if (Array.isArray(body.tools) && body.tools.length) throw bad('tools', 'tools are not supported');
  let maxTokens = null;
  for (const name of ['max_tokens', 'max_completion_tokens']) {
    const v = integer(body, name, 1, 2 ** 31 - 1, null);
    if (v !== null) maxTokens = v;
  }
  out.maxTokens = maxTokens;
  const seed = body.seed ?? Math.floor(Math.random() * 2 ** 53);
  if (!Number.isSafeInteger(seed) || seed < 0) throw bad('seed', `a non-negative integer, not ${JSON.stringify(body.seed)}`);
  out.sampling = {
    temperature: number(body, 'temperature', 0, 2, 1),
    topK: integer(body, 'top_k', 0, 2 ** 32 - 1, 0),
    topP: number(body, 'top_p', 0, 1, 1),
    minP: number(body, 'min_p', 0, 1, 0),
    repeatPenalty: number(body, 'repeat_penalty', 0.01, 10, 1),
    repeatLastN: 64,
    seed: String(seed),
  };
  const stop = body.stop === undefined || body.stop === null ? [] : typeof body.stop === 'string' ? [body.stop] : body.stop;
  if (!Array.isArray(stop) || stop.some((s) => typeof s !== 'string')) throw bad('stop', 'a string or a list of strings');
  if (stop.length > MAX_STOPS) throw bad('stop', `at most ${MAX_STOPS} stop sequences`);
  if (stop.some((s) => !s || s.length > MAX_STOP_CHARS)) throw bad('stop', `a stop sequence has 1 to ${MAX_STOP_CHARS} characters`);
  out.stop = stop;
  out.constraint = constraintOf(body);
  out.stream = body.stream === true;
  out.includeUsage = out.stream && body.stream_options?.include_usage === true;
  return out;
}

// ---- responses ------------------------------------------------------------------------------

/** The engine's figures of one completion: token rates and where the matrix products ran. */
function figures(s) {
  const rate = (n, ns) => (ns > 0 ? n / (ns / 1e9) : null);
  return {
    prefill_tokens: s.prefillTokens,
    prefill_ms: s.prefillNs / 1e6,
    prefill_tokens_per_s: rate(s.prefillTokens, s.prefillNs),
    decode_tokens: s.decodeTokens,
    decode_ms: s.decodeNs / 1e6,
    decode_tokens_per_s: rate(s.decodeTokens, s.decodeNs),
    cpu_matmuls: s.cpuMatmuls,
    cpu_gflop: s.cpuFlops / 1e9,
    gpu_calls: s.gpuCalls,
    gpu_gflop: s.gpuFlops / 1e9,
    gpu_ms: s.gpuNs / 1e6,
    gpu_fallbacks: s.gpuFallbacks,
  };
}

/** The chunks of a streamed completion, as an async iterator; `controller.abort()` cancels it. */
class Stream {
  #queue = [];
  #waiting = null;
  #done = false;
  #error = null;
  constructor(controller) {
    this.controller = controller;
  }
  push(chunk) {
    this.#queue.push(chunk);
    this.#wake();
  }
  end(error = null) {
    this.#done = true;
    this.#error = error;
    this.#wake();
  }
  #wake() {
    const w = this.#waiting;
    this.#waiting = null;
    w?.();
  }
  async *[Symbol.asyncIterator]() {
    try {
      for (;;) {
        if (this.#queue.length) {
          yield this.#queue.shift();
          continue;
        }
        if (this.#done) {
          if (this.#error) throw this.#error;
          return;
        }
        await new Promise((resolve) => { this.#waiting = resolve; });
      }
    } finally {
      // A consumer that stops reading (break) stops the generation.
      if (!this.#done) this.controller.abort();
    }
  }
  /** The whole text of the stream, read to its end. */
  async text() {
    let text = '';
    for await (const c of this) text += c.choices[0]?.delta?.content ?? c.choices[0]?.text ?? '';
    return text;
  }
}

let nextId = 1;
const rid = (prefix) => `${prefix}-${Date.now().toString(36)}${Math.floor(Math.random() * 2 ** 32).toString(16).padStart(8, '0')}`;

/** The most inputs one embeddings request takes (OpenAI's limit, and the engine's). */
const MAX_EMBED_INPUTS = 2048;

/** An embeddings request's inputs: texts, or token ids as they are. Throws a WispError. */
function embedInputs(body) {
  if (!body || typeof body !== 'object') throw bad('body', 'a request is an object');
  const input = body.input;
  const ids = (v) => Array.isArray(v) && v.length > 0 && v.every((t) => Number.isInteger(t) && t >= 0 && t < 2 ** 32);
  let inputs;
  if (typeof input === 'string') inputs = [input];
  else if (Array.isArray(input) && input.length > 0 && input.every((t) => typeof t === 'number')) inputs = [input];
  else if (Array.isArray(input)) inputs = input;
  else throw bad('input', 'a string, a list of strings, token ids or lists of token ids');
  if (inputs.length === 0 || inputs.length > MAX_EMBED_INPUTS) throw bad('input', `1 to ${MAX_EMBED_INPUTS} inputs, not ${inputs.length}`);
  let chars = 0;
  inputs.forEach((x, i) => {
    if (typeof x === 'string') {
      if (!x) throw bad('input', `input[${i}] is empty`);
      chars += x.length;
    } else if (!ids(x)) throw bad('input', `input[${i}] is neither a non-empty string nor a non-empty list of token ids`);
  });
  if (chars > MAX_PROMPT_CHARS) throw bad('input', `at most ${MAX_PROMPT_CHARS} characters in all`);
  const encoding = body.encoding_format ?? 'float';
  if (encoding !== 'float' && encoding !== 'base64') throw bad('encoding_format', 'float or base64');
  return { inputs, encoding };
}

/** A vector as OpenAI's `base64` encoding writes it: its little-endian f32 values. */
function base64Of(v) {
  const bytes = new Uint8Array(v.length * 4);
  const view = new DataView(bytes.buffer);
  v.forEach((x, i) => view.setFloat32(4 * i, x, true));
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

class Engine {
  #worker;
  #pending = new Map();
  #closed = null;
  #pooling;

  constructor(worker, ready, pooling) {
    this.#pooling = pooling;
    this.#worker = worker;
    /** What this browser gave the engine: `{ jspi, webgpu, variant, notices, component }`. */
    this.env = ready.env;
    /** The loaded model: `{ id, sha256, fromCache, architecture, device, ... }`. */
    this.model = ready.model;
    this.chat = { completions: { create: (body, options) => this.#create('chat', body, options) } };
    this.completions = { create: (body, options) => this.#create('completion', body, options) };
    this.embeddings = { create: (body) => this.#embed(body) };
    worker.onmessage = (ev) => this.#onMessage(ev.data);
    worker.onerror = (ev) => this.#fail(new WispError(`the engine's worker failed: ${ev.message ?? 'unknown error'}`, { code: 'worker_failed' }));
  }

  #fail(error) {
    this.#closed = error;
    for (const p of this.#pending.values()) p.fail(error);
    this.#pending.clear();
    this.#worker.terminate();
  }

  #onMessage(m) {
    const p = this.#pending.get(m?.id);
    if (!p) return;
    if (m.type === 'start') p.start(m.promptTokens);
    else if (m.type === 'delta') p.delta(m.text);
    else if (m.type === 'embedded') {
      this.#pending.delete(m.id);
      p.end(m);
    }
    else if (m.type === 'end') {
      this.#pending.delete(m.id);
      p.end(m);
    } else if (m.type === 'error') {
      this.#pending.delete(m.id);
      p.fail(fromWire(m.error));
    }
  }

  /** Starts a completion; resolves to a `Stream` (`stream: true`) or the whole response. */
  #create(kind, body, { signal } = {}) {
    if (this.#closed) return Promise.reject(this.#closed);
    let work;
    try {
      work = job(kind, body);
    } catch (e) {
      return Promise.reject(e);
    }
    if (signal?.aborted) return Promise.reject(abortError());
    const id = nextId++;
    const head = { id: rid(kind === 'chat' ? 'chatcmpl' : 'cmpl'), created: Math.floor(Date.now() / 1000), model: this.model.id };
    const object = kind === 'chat' ? 'chat.completion' : 'text_completion';
    const chunkObject = kind === 'chat' ? 'chat.completion.chunk' : 'text_completion';
    const choice = (text, finish) =>
      kind === 'chat'
        ? { index: 0, delta: text === null ? {} : { content: text }, logprobs: null, finish_reason: finish }
        : { index: 0, text: text ?? '', logprobs: null, finish_reason: finish };
    const abort = () => {
      this.#worker.postMessage({ type: 'abort', id });
    };
    const controller = { abort };
    signal?.addEventListener('abort', abort, { once: true });
    const cleanup = () => signal?.removeEventListener('abort', abort);
    this.#worker.postMessage({ type: 'generate', id, job: work });

    if (work.stream) {
      const stream = new Stream(controller);
      this.#pending.set(id, {
        start: () => {
          if (kind === 'chat') stream.push({ ...head, object: chunkObject, choices: [{ index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }] });
        },
        delta: (text) => stream.push({ ...head, object: chunkObject, choices: [choice(text, null)] }),
        end: (m) => {
          cleanup();
          const wisp = figures(m.stats);
          stream.push({ ...head, object: chunkObject, choices: [choice(null, m.finish)], wisp });
          if (work.includeUsage) stream.push({ ...head, object: chunkObject, choices: [], usage: m.usage, wisp });
          stream.end();
        },
        fail: (e) => {
          cleanup();
          stream.end(e);
        },
      });
      return Promise.resolve(stream);
    }
    return new Promise((resolve, reject) => {
      let text = '';
      this.#pending.set(id, {
        start: () => {},
        delta: (t) => { text += t; },
        end: (m) => {
          cleanup();
          const c = kind === 'chat'
            ? { index: 0, message: { role: 'assistant', content: text }, logprobs: null, finish_reason: m.finish }
            : { index: 0, text, logprobs: null, finish_reason: m.finish };
          resolve({ ...head, object, choices: [c], usage: m.usage, wisp: figures(m.stats) });
        },
        fail: (e) => {
          cleanup();
          reject(e);
        },
      });
    });
  }

  /** Embeddings of texts (or token ids), pooled as `createEngine`'s `pooling` says. */
  #embed(body) {
    if (this.#closed) return Promise.reject(this.#closed);
    let work;
    try {
      work = embedInputs(body);
    } catch (e) {
      return Promise.reject(e);
    }
    const id = nextId++;
    this.#worker.postMessage({ type: 'embed', id, job: { inputs: work.inputs, pooling: this.#pooling } });
    return new Promise((resolve, reject) => {
      this.#pending.set(id, {
        end: (m) => {
          const data = m.vectors.map((v, index) => ({ object: 'embedding', index, embedding: work.encoding === 'base64' ? base64Of(v) : Array.from(v) }));
          resolve({ object: 'list', data, model: this.model.id, usage: { prompt_tokens: m.promptTokens, total_tokens: m.promptTokens } });
        },
        fail: reject,
      });
    });
  }

  /** Stops the worker: pending completions fail, the engine takes no more. */
  unload() {
    if (!this.#closed) this.#fail(new WispError('the engine was unloaded', { code: 'unloaded' }));
  }
}

/**
 * Starts an engine: a worker with the guest, and `model` in it (from the cache when it is
 * there, else downloaded and cached). Options: `model` (a URL, or `{ url, sha256?, name? }`),
 * `gpu` ('auto' | 'on' | 'off'), `precision` ('exact' | 'fast'), `contextSize` (tokens a
 * completion may span, 2048 by default), `pooling` ('mean' | 'last' | 'cls': how
 * `embeddings.create` makes one vector of a text's tokens, 'mean' by default),
 * `onProgress({ phase, loaded, total })`, `signal`;
 * `jspi: false` / `webgpu: false` run as a browser without them would.
 */
export async function createEngine(options = {}) {
  const { onProgress, signal, ...rest } = options;
  const ref = modelRef(rest.model);
  for (const [name, allowed] of [['gpu', ['auto', 'on', 'off']], ['precision', ['exact', 'fast']], ['pooling', ['mean', 'last', 'cls']]]) {
    if (rest[name] !== undefined && !allowed.includes(rest[name])) throw new TypeError(`${name}: one of ${allowed.join(', ')}`);
  }
  if (rest.contextSize !== undefined && !(Number.isInteger(rest.contextSize) && rest.contextSize > 0)) throw new TypeError('contextSize: a positive integer');
  if (signal?.aborted) throw abortError();
  const worker = new Worker(new URL('./worker.js', import.meta.url), { type: 'module', name: 'wisp' });
  const ready = await new Promise((resolve, reject) => {
    const stop = () => {
      worker.terminate();
      reject(abortError('createEngine was aborted'));
    };
    signal?.addEventListener('abort', stop, { once: true });
    worker.onerror = (ev) => {
      signal?.removeEventListener('abort', stop);
      worker.terminate();
      reject(new WispError(`the engine's worker did not start: ${ev.message ?? 'a module failed to load'}`, { code: 'worker_failed' }));
    };
    worker.onmessage = (ev) => {
      const m = ev.data;
      if (m?.type === 'progress') onProgress?.({ phase: m.phase, loaded: m.loaded, total: m.total });
      else if (m?.type === 'ready' || m?.type === 'failed') {
        signal?.removeEventListener('abort', stop);
        if (m.type === 'ready') resolve(m);
        else {
          worker.terminate();
          reject(fromWire(m.error));
        }
      }
    };
    worker.postMessage({ type: 'init', options: { ...rest, model: ref } });
  });
  return new Engine(worker, ready, rest.pooling ?? 'mean');
}
