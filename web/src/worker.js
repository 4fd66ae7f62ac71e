// The engine's dedicated worker: the guest component, its WebGPU device and the model live here,
// so a long prefill never blocks the page. `index.js` starts it and speaks to it with messages:
//
//   page -> worker  { type: 'init', options }        probe, instantiate, load the model
//                   { type: 'generate', id, job }     one completion (queued: the guest runs
//                                                     one call at a time)
//                   { type: 'abort', id }             stop that completion (queued or running)
//                   { type: 'embed', id, job }        embeddings of texts or token ids (queued)
//   worker -> page  { type: 'progress', ... }         downloading, caching, loading
//                   { type: 'ready', ... }            the engine: environment and model
//                   { type: 'start' | 'delta' | 'end' | 'error', id, ... }  a completion's events
//                   { type: 'embedded' | 'error', id, ... }                 an embedding's answer
//                   { type: 'failed', error }         init failed
//
// With JSPI (WebAssembly.Suspending in this worker) the guest may wait for WebGPU; without it, or
// without an adapter, it runs on its own CPU kernels and `ready` carries a notice saying why.

import { cachedModel, cacheAvailable, download, keepModel, modelRef, sha256Hex } from './cache.js';
import { describeError, instantiate, manifest, modelFile, probe, stats } from './wisp.js';

const state = { guest: null, model: null, info: null, contextSize: 0, bos: null };
/** Completions waiting or running, by id: `{ job, aborted }`. */
const jobs = new Map();
let tail = Promise.resolve();

const post = (m) => self.postMessage(m);

/** A task boundary: lets this worker take the messages that arrived (an abort) in between. */
function yieldTask() {
  return new Promise((resolve) => {
    const ch = new MessageChannel();
    ch.port1.onmessage = () => resolve();
    ch.port2.postMessage(null);
  });
}

/** An error as the page rebuilds it: its name, OpenAI-style code and param, and message. */
function wireError(e, fallbackCode = 'engine_error') {
  if (e?.name === 'AbortError') return { name: 'AbortError', code: 'aborted', message: e.message };
  // A guest error carries its WIT variant: its tag is the code.
  const p = e?.payload;
  const code = p && typeof p === 'object' && 'tag' in p ? p.tag : e?.code ?? fallbackCode;
  return { name: 'WispError', code, param: e?.param, message: describeError(e) };
}

class RequestError extends Error {
  constructor(code, message, param) {
    super(message);
    this.code = code;
    this.param = param;
  }
}

/**
 * The model's file (`{ file, size }`, what `modelFile` takes): from the cache (read a piece at a
 * time from there as the guest asks), else downloaded and checked. `keep()` caches downloaded
 * bytes (called once the engine has loaded them: a file that is no model is not kept).
 */
async function modelBytes(ref, notices) {
  const progress = (phase, loaded, total) => post({ type: 'progress', phase, loaded, total });
  const hit = await cachedModel(ref).catch((e) => {
    notices.push(`the model cache could not be read (${describeError(e)}): downloading`);
    return null;
  });
  if (hit) {
    progress('cache', hit.size, hit.size);
    return { file: hit.file, size: hit.size, sha256: hit.sha256, fromCache: true, keep: async () => {} };
  }
  let bytes;
  try {
    bytes = await download(ref.url, (got, total) => progress('download', got, total));
  } catch (e) {
    throw new RequestError('model_not_found', e.message);
  }
  const sha = await sha256Hex(bytes);
  if (ref.sha256 && sha !== ref.sha256) {
    throw new RequestError('model_mismatch', `${ref.url} has sha256 ${sha}, not the ${ref.sha256} asked for`);
  }
  const keep = async () => {
    if (!cacheAvailable()) {
      notices.push('this context has no Cache Storage: the model will be downloaded again next time');
      return;
    }
    try {
      await keepModel(ref, sha, bytes);
    } catch (e) {
      notices.push(`the model was not cached (${describeError(e)}): it will be downloaded again next time`);
    }
  };
  return { file: bytes, size: bytes.length, sha256: sha, fromCache: false, keep };
}

async function init(options) {
  const notices = [];
  const env = await probe({ jspi: options.jspi !== false, webgpu: options.webgpu !== false, lanes: options.lanes, maxBindingBytes: options.maxBindingBytes });
  if (!env.jspi) notices.push(`${env.jspiWhy}: the model runs on the CPU`);
  else if (!env.gpu) notices.push(`${env.gpuWhy}: the model runs on the CPU`);
  state.guest = await instantiate(env);
  const ref = modelRef(options.model);
  const got = await modelBytes(ref, notices);
  post({ type: 'progress', phase: 'load', loaded: 0, total: got.size });
  const t0 = performance.now();
  // The guest reads the file a piece at a time (it never holds the whole file; with the weights
  // on the WebGPU device, none of them either).
  state.model = await state.guest.engine.Model.open(modelFile(got.file), { gpu: options.gpu ?? 'auto', precision: options.precision ?? 'exact' });
  const loadMs = performance.now() - t0;
  const guestMemoryBytes = state.guest.memoryBytes();
  await got.keep();
  const info = state.model.info();
  state.info = info;
  state.bos = info.bos ?? null;
  state.contextSize = Math.max(1, Math.min(options.contextSize ?? 2048, info.nCtxTrain || Infinity));
  const m = await manifest();
  const device = info.device ? { name: info.device.name, backend: info.device.backend, deviceType: info.device.deviceType } : null;
  return {
    env: {
      jspi: env.jspi,
      webgpu: Boolean(env.gpu),
      variant: state.guest.variant,
      notices,
      component: { sha256: m.sha256, bytes: m.bytes, jco: m.jco },
    },
    model: {
      id: ref.name,
      url: ref.url,
      sha256: got.sha256,
      fromCache: got.fromCache,
      bytes: got.size,
      loadMs,
      architecture: info.architecture,
      name: info.name,
      nParams: Number(info.nParams),
      nLayers: info.nLayers,
      nVocab: info.nVocab,
      nCtxTrain: info.nCtxTrain,
      contextSize: state.contextSize,
      chatTemplate: info.chatTemplate ? (info.chatTemplate.tag === 'builtin' ? `builtin:${info.chatTemplate.val}` : info.chatTemplate.tag) : null,
      device,
      gpuWeights: info.gpuWeights,
      guestMemoryBytes,
      gpu: options.gpu ?? 'auto',
      precision: options.precision ?? 'exact',
    },
  };
}

/** Holds back what may be the start of a stop sequence; ends at the first one. */
class StopMatcher {
  #stops;
  #held = '';
  constructor(stops) {
    this.#stops = stops;
  }
  /** `{ text, stopped }`: the text that is safe to send, and whether a stop sequence came. */
  push(text) {
    const s = this.#held + text;
    let first = -1;
    for (const stop of this.#stops) {
      const at = s.indexOf(stop);
      if (at >= 0 && (first < 0 || at < first)) first = at;
    }
    if (first >= 0) {
      this.#held = '';
      return { text: s.slice(0, first), stopped: true };
    }
    let keep = 0;
    for (const stop of this.#stops) {
      for (let l = Math.min(stop.length - 1, s.length); l > keep; l--) {
        if (s.endsWith(stop.slice(0, l))) {
          keep = l;
          break;
        }
      }
    }
    this.#held = s.slice(s.length - keep);
    return { text: s.slice(0, s.length - keep), stopped: false };
  }
  finish() {
    const h = this.#held;
    this.#held = '';
    return h;
  }
}

/** The prompt's tokens: a chat through the model's template, as `wisp serve` makes them. */
function promptTokens(job) {
  const { model } = state;
  if (job.kind === 'completion') return [...model.tokenize(job.prompt, true, false)];
  let text;
  try {
    text = model.applyChatTemplate(job.messages.map((m) => [m.role, m.content]), true);
  } catch (e) {
    const w = wireError(e);
    throw new RequestError('invalid_request_error', `messages: ${w.message}`, 'messages');
  }
  const tokens = [...model.tokenize(text, true, true)];
  // A template that writes the BOS itself, then tokenize adding one: keep one.
  if (tokens.length >= 2 && tokens[0] === state.bos && tokens[1] === tokens[0]) tokens.shift();
  return tokens;
}

/** Prompt tokens fed in parts of this many, an abort taken between them. */
const FEED_CHUNK = 256;

async function run(id, entry) {
  const { job } = entry;
  const checkAbort = () => {
    if (entry.aborted) {
      const e = new Error('the request was aborted');
      e.name = 'AbortError';
      throw e;
    }
  };
  checkAbort();
  const tokens = promptTokens(job);
  if (tokens.length === 0) throw new RequestError('invalid_request_error', 'the prompt has no tokens', 'prompt');
  if (tokens.length >= state.contextSize) {
    throw new RequestError('context_length_exceeded', `the prompt is ${tokens.length} tokens, and this engine's context holds ${state.contextSize} (contextSize)`, job.kind === 'chat' ? 'messages' : 'prompt');
  }
  const nCtx = Math.min(tokens.length + (job.maxTokens ?? Infinity), state.contextSize);
  const budget = nCtx - tokens.length;
  const session = state.model.newSession(nCtx);
  try {
    post({ type: 'start', id, promptTokens: tokens.length });
    for (let at = 0; at < tokens.length; at += FEED_CHUNK) {
      await session.feed(tokens.slice(at, at + FEED_CHUNK));
      await yieldTask();
      checkAbort();
    }
    session.constrain(job.constraint ?? undefined);
    const sampling = { ...job.sampling, seed: BigInt(job.sampling.seed) };
    const decoder = new TextDecoder();
    const stops = new StopMatcher(job.stop ?? []);
    let generated = 0;
    let finish = null;
    let stopped = false;
    const send = (text) => {
      if (text) post({ type: 'delta', id, text });
    };
    while (finish === null) {
      const step = await session.next(sampling);
      if (step.deadEnd) {
        finish = 'constraint';
        break;
      }
      generated += 1;
      if (step.endOfGeneration) {
        finish = 'stop';
        break;
      }
      const released = stops.push(decoder.decode(step.piece, { stream: true }));
      send(released.text);
      if (released.stopped) {
        finish = 'stop';
        stopped = true;
        break;
      }
      if (generated >= budget) finish = 'length';
      await yieldTask();
      checkAbort();
    }
    if (!stopped) {
      // What the decoder and the stop matcher held back.
      const released = stops.push(decoder.decode());
      send(released.text);
      if (released.stopped) finish = 'stop';
      else send(stops.finish());
    }
    post({
      type: 'end',
      id,
      finish,
      usage: { prompt_tokens: tokens.length, completion_tokens: generated, total_tokens: tokens.length + generated },
      stats: stats(session),
    });
  } finally {
    session[Symbol.dispose]?.();
  }
}

/** The embeddings of `job.inputs` (texts, or token ids as they are), pooled by `job.pooling`:
 *  their vectors (Float32Array each) and the tokens they came to. */
async function embed(id, job) {
  const texts = job.inputs.map((input, i) => {
    const tokens = typeof input === 'string' ? [...state.model.tokenize(input, true, false)] : input;
    if (tokens.length === 0) throw new RequestError('invalid_request_error', `input[${i}] has no tokens`, 'input');
    if (tokens.length > state.contextSize) {
      throw new RequestError('context_length_exceeded', `input[${i}] is ${tokens.length} tokens, and this engine's context holds ${state.contextSize} (contextSize)`, 'input');
    }
    return Uint32Array.from(tokens);
  });
  const vectors = await state.model.embed(texts, job.pooling);
  const promptTokens = texts.reduce((n, t) => n + t.length, 0);
  post({ type: 'embedded', id, vectors: [...vectors], promptTokens });
}

function generate(id, job) {
  const entry = { job, aborted: false };
  jobs.set(id, entry);
  const go = () =>
    run(id, entry)
      .catch((e) => post({ type: 'error', id, error: wireError(e) }))
      .finally(() => jobs.delete(id));
  tail = tail.then(go, go);
}

self.onmessage = (ev) => {
  const m = ev.data;
  switch (m?.type) {
    case 'init':
      init(m.options).then(
        (ready) => post({ type: 'ready', ...ready }),
        (e) => post({ type: 'failed', error: wireError(e, 'load_failed') }),
      );
      break;
    case 'generate':
      if (!state.model) post({ type: 'error', id: m.id, error: { name: 'WispError', code: 'not_ready', message: 'no model loaded' } });
      else generate(m.id, m.job);
      break;
    case 'embed': {
      if (!state.model) {
        post({ type: 'error', id: m.id, error: { name: 'WispError', code: 'not_ready', message: 'no model loaded' } });
        break;
      }
      const go = () => embed(m.id, m.job).catch((e) => post({ type: 'error', id: m.id, error: wireError(e) }));
      tail = tail.then(go, go);
      break;
    }
    case 'abort': {
      const entry = jobs.get(m.id);
      if (entry) entry.aborted = true;
      break;
    }
    default:
      break;
  }
};
