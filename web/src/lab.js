// The lab page: the guest on the page's own thread (no worker), with what the tests drive:
// load a GGUF, type a prompt, watch the tokens stream, with tokens/s, the
// prefill/decode split and where the matrix products ran (the session's stats).
//
// Query parameters: `?gpu=on|off|auto` (the initial GPU mode), `?jspi=off` and `?webgpu=off`
// (run as a browser without them would), `?lanes=N` (LANES_K of the gemv kernel), `?model=default`
// (load the default model at once).
// `window.wisp` is what the test drives: `ready`, `loadDefault`, `loadModel`, `generate`, `golden`.

import { download } from './cache.js';
import { componentSha256, describeError, instantiate, manifest, modelFile, probe, Serial, stats } from './wisp.js';
import { loadGolden, runCase, MARGIN, TOP5_TOLERANCE, RMSE_TOLERANCE } from './golden.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const DEFAULT_MODEL = '/model/default.gguf';
const GOLDEN = new URL('../../tests/golden/gemma3-270m.json', import.meta.url).href;

const state = {
  env: null,
  guest: null,
  model: null,
  modelBytes: null,
  modelName: null,
  info: null,
  generating: false,
  stop: false,
  streamLog: [],
};
const serial = new Serial();

function notice(el, text, kind) {
  el.textContent = text;
  el.className = `notice${kind ? ` ${kind}` : ''}`;
}

const fmt = (n, d = 1) => (Number.isFinite(n) ? n.toFixed(d) : '–');
const perSecond = (tokens, ns) => (ns > 0 ? tokens / (ns / 1e9) : NaN);

function showStats(s) {
  if (!s) return;
  const pre = perSecond(s.prefillTokens, s.prefillNs);
  const dec = perSecond(s.decodeTokens, s.decodeNs);
  $('headline').textContent = s.decodeTokens > 0 ? `${fmt(dec)} tokens/s` : `${fmt(pre)} tokens/s (prefill)`;
  $('stat-prefill').textContent = `${s.prefillTokens} tokens in ${fmt(s.prefillNs / 1e6, 0)} ms (${fmt(pre)} tokens/s)`;
  $('stat-decode').textContent = `${s.decodeTokens} tokens in ${fmt(s.decodeNs / 1e6, 0)} ms (${fmt(dec)} tokens/s)`;
  const gpu = s.gpuCalls > 0
    ? `GPU: ${s.gpuCalls} calls, ${fmt(s.gpuFlops / 1e9, 2)} GFLOP in ${fmt(s.gpuNs / 1e6, 0)} ms`
    : 'GPU: none';
  const fallbacks = s.gpuFallbacks > 0 ? ` · ${s.gpuFallbacks} GPU calls redone on the CPU` : '';
  $('stat-where').textContent = `CPU: ${s.cpuMatmuls} matmuls, ${fmt(s.cpuFlops / 1e9, 2)} GFLOP · ${gpu}${fallbacks}`;
  $('stat-where').dataset.gpuCalls = s.gpuCalls;
  $('stat-where').dataset.cpuMatmuls = s.cpuMatmuls;
}

function showDevice() {
  const d = state.info?.device;
  const mode = $('gpu-mode').value;
  $('stat-device').textContent = d
    ? `${d.name} (${d.backend}, ${d.deviceType}), ${state.info.gpuWeights} weights on it, GPU mode ${mode}`
    : `none: the guest runs on its CPU kernels (${state.guest?.gpu.why ?? 'no device'})`;
}

function setBusy(busy) {
  const ready = Boolean(state.guest);
  $('generate').disabled = busy || !state.model;
  $('stop').disabled = !state.generating;
  $('load-default').disabled = busy || !ready;
  $('file').disabled = busy || !ready;
  $('gpu-mode').disabled = busy || !ready;
  $('golden-run').disabled = busy || !ready || !state.modelBytes;
}

/** Loads a model from bytes with a GPU mode (the previous model is dropped first). */
function loadModel(bytes, name, mode = $('gpu-mode').value) {
  return serial.run(async () => {
    setBusy(true);
    try {
      $('gpu-mode').value = mode;
      state.model?.[Symbol.dispose]?.();
      state.model = null;
      state.info = null;
      state.modelBytes = bytes;
      state.modelName = name;
      $('model-status').textContent = `Loading ${name} (${fmt(bytes.length / 2 ** 20, 0)} MiB, GPU ${mode})…`;
      const t0 = performance.now();
      const model = await state.guest.engine.Model.open(modelFile(bytes), { gpu: mode, precision: 'exact' });
      const ms = performance.now() - t0;
      state.model = model;
      const info = model.info();
      state.info = info;
      $('model-status').textContent =
        `${info.name || name}: ${info.architecture}, ${fmt(Number(info.nParams) / 1e6, 0)}M parameters, ` +
        `${info.nLayers} layers, loaded in ${fmt(ms / 1000, 1)} s`;
      showDevice();
      return { ms, architecture: info.architecture, device: info.device ? info.device.name : null, gpuWeights: info.gpuWeights };
    } catch (e) {
      $('model-status').textContent = `Could not load ${name}: ${describeError(e)}`;
      throw new Error(describeError(e));
    } finally {
      setBusy(false);
    }
  });
}

async function loadDefault(mode) {
  setBusy(true);
  let bytes;
  try {
    bytes = await download(DEFAULT_MODEL, (got, total) => {
      $('model-status').textContent = `Downloading the default model: ${fmt(got / 2 ** 20, 0)}${total ? ` of ${fmt(total / 2 ** 20, 0)}` : ''} MiB…`;
    });
  } catch (e) {
    $('model-status').textContent = `${e.message}${/HTTP 404$/.test(e.message) ? ' (run `wisp fetch` to get the default model)' : ''}`;
    setBusy(false);
    throw e;
  }
  return loadModel(bytes, 'gemma-3-270m-q4_k_m.gguf', mode);
}

/** The next frame, so that what was just written is painted before the guest runs again. */
function nextFrame() {
  return new Promise((resolve) => {
    if (document.hidden) setTimeout(resolve, 0);
    else requestAnimationFrame(() => setTimeout(resolve, 0));
  });
}

/**
 * The WIT `constraint` of `generate`'s `constraint` option: `{ jsonSchema }` (a schema object or
 * its JSON text), `{ regex }` (Rust regex syntax) or `{ grammar }` (llguidance's Lark dialect).
 */
function witConstraint(c) {
  if (c === undefined || c === null) return undefined;
  if (c.jsonSchema !== undefined) {
    return { tag: 'json-schema', val: typeof c.jsonSchema === 'string' ? c.jsonSchema : JSON.stringify(c.jsonSchema) };
  }
  if (typeof c.regex === 'string') return { tag: 'regex', val: c.regex };
  if (typeof c.grammar === 'string') return { tag: 'lark', val: c.grammar };
  throw new Error('a constraint is { jsonSchema }, { regex } or { grammar }');
}

/**
 * Generates from `prompt`, streaming into the page, under `constraint` if given (see
 * `witConstraint`). Resolves to the text, the stats, the token count and why it ended: `stop`
 * (the end of generation), `length` (`maxTokens` or the context) or `constraint` (the constraint
 * admitted no further token).
 */
function generate({ prompt = $('prompt').value, maxTokens = Number($('max-tokens').value), sampling, constraint } = {}) {
  return serial.run(async () => {
    if (!state.model) throw new Error('no model loaded');
    const sample = sampling ?? {
      temperature: Number($('temperature').value),
      topK: Number($('top-k').value),
      topP: Number($('top-p').value),
      minP: 0,
      repeatPenalty: 1,
      repeatLastN: 64,
      seed: BigInt(Number($('seed').value) || 0),
    };
    state.generating = true;
    state.stop = false;
    state.streamLog = [];
    setBusy(true);
    const out = $('output');
    out.dataset.done = 'false';
    out.dataset.tokens = '0';
    out.textContent = '';
    const shown = document.createElement('span');
    shown.className = 'prompt';
    shown.textContent = prompt;
    const gen = document.createElement('span');
    gen.className = 'generated';
    out.append(shown, gen);
    const decoder = new TextDecoder();
    let text = '';
    let finish = 'length';
    let session;
    try {
      const wanted = witConstraint(constraint);
      const tokens = state.model.tokenize(prompt, true, false);
      const nCtx = Math.min(tokens.length + maxTokens + 1, state.info.nCtxTrain || Infinity);
      session = state.model.newSession(nCtx);
      await session.feed(tokens);
      session.constrain(wanted);
      showStats(stats(session));
      await nextFrame();
      for (let i = 0; i < maxTokens && !state.stop; i++) {
        const step = await session.next(sample);
        if (step.endOfGeneration) {
          finish = step.deadEnd ? 'constraint' : 'stop';
          break;
        }
        const piece = decoder.decode(step.piece, { stream: true });
        text += piece;
        gen.textContent = text;
        const s = stats(session);
        showStats(s);
        state.streamLog.push({ at: performance.now(), chars: text.length, token: step.token });
        out.dataset.tokens = String(state.streamLog.length);
        await nextFrame();
        if (session.position() >= session.capacity()) break;
      }
      text += decoder.decode();
      gen.textContent = text;
      const s = stats(session);
      showStats(s);
      return { text, stats: s, tokens: state.streamLog.length, finish };
    } catch (e) {
      gen.textContent = `${text}\n[error: ${describeError(e)}]`;
      throw new Error(describeError(e));
    } finally {
      session?.[Symbol.dispose]?.();
      state.generating = false;
      out.dataset.done = 'true';
      setBusy(false);
    }
  });
}

/**
 * The golden check in this page: loads the model kept from the last load with `gpu`, and runs
 * the named cases (at most `maxSteps` reference steps each).
 */
async function golden({ gpu = $('gpu-mode').value, cases = ['capital', 'count', 'unicode'], maxSteps = Infinity } = {}) {
  if (!state.modelBytes) throw new Error('no model bytes: load the default model first');
  const all = await loadGolden(GOLDEN);
  const chosen = cases.map((name) => {
    const c = all.find((x) => x.name === name);
    if (!c) throw new Error(`no golden case ${name}`);
    return c;
  });
  const load = await loadModel(state.modelBytes, state.modelName, gpu);
  return serial.run(async () => {
    setBusy(true);
    try {
      const runsBefore = state.guest.gpu.programRuns();
      const outcomes = [];
      for (const c of chosen) {
        const t0 = performance.now();
        const o = await runCase(state.model, c, { maxSteps });
        o.ms = performance.now() - t0;
        outcomes.push(o);
        showGolden(outcomes, gpu);
      }
      // The guest's whole passes on the device: runs of its model's program.
      const programRuns = state.guest.gpu.programRuns() - runsBefore;
      return { gpu, load, device: state.info.device ? state.info.device.name : null, outcomes, programRuns };
    } finally {
      setBusy(false);
    }
  });
}

function showGolden(outcomes, gpu) {
  const rows = outcomes.map((o) =>
    `<tr><td>${o.name}</td><td>${o.steps}</td><td>${o.argmaxChecked - o.argmaxMismatches.length}/${o.argmaxChecked}</td>` +
    `<td>${fmt(o.maxTop5Diff, 3)}</td><td>${o.rmse === null ? '–' : fmt(o.rmse, 3)}</td>` +
    `<td>${o.stats.gpuCalls}</td><td class="${o.pass ? 'pass' : 'fail'}">${o.pass ? 'pass' : 'FAIL'}</td></tr>`);
  $('golden-table').innerHTML =
    `<tr><th>case</th><th>steps</th><th>argmax (margin ≥ ${MARGIN})</th><th>max |Δ| top-5 (≤ ${TOP5_TOLERANCE})</th>` +
    `<th>RMSE (≤ ${RMSE_TOLERANCE})</th><th>GPU calls</th><th>GPU ${gpu}</th></tr>${rows.join('')}`;
}

async function init() {
  const env = await probe({
    jspi: params.get('jspi') !== 'off',
    webgpu: params.get('webgpu') !== 'off',
    lanes: params.has('lanes') ? Number(params.get('lanes')) : undefined,
  });
  state.env = env;
  notice($('env-jspi'), env.jspi ? 'JSPI: yes (the guest can wait for WebGPU).' : `JSPI: no. ${env.jspiWhy}. Running on the CPU.`, env.jspi ? '' : 'warn');
  notice($('env-gpu'), env.gpu ? 'WebGPU: yes.' : `WebGPU: not used (${env.gpuWhy}). The guest runs its matrix products on the CPU.`, env.gpu ? '' : 'warn');
  state.guest = await instantiate(env);
  if (state.guest.gpu.info) {
    const i = state.guest.gpu.info;
    notice($('env-gpu'), `WebGPU: ${i.name} (${i.deviceType}); matmuls go there as the GPU mode says.`, '');
  }
  const [m, sha] = await Promise.all([manifest(), componentSha256()]);
  $('env-guest').textContent =
    `Guest: ${m.source}, ${m.bytes} bytes, sha256 ${sha}${sha === m.sha256 ? '' : ' (differs from the build manifest!)'}; ` +
    `jco ${m.jco}, ${state.guest.variant === 'jspi' ? '--async-mode jspi' : 'synchronous (no JSPI)'}`;
  $('env-guest').dataset.sha256 = sha;
  const mode = params.get('gpu');
  if (mode && ['on', 'off', 'auto'].includes(mode)) $('gpu-mode').value = mode;
  setBusy(false);
  return { jspi: env.jspi, webgpu: Boolean(env.gpu), gpuWhy: env.gpuWhy, variant: state.guest.variant, device: state.guest.gpu.info, sha256: sha, manifest: m };
}

$('load-default').addEventListener('click', () => loadDefault().catch(() => {}));
$('file').addEventListener('change', async () => {
  const f = $('file').files[0];
  if (!f) return;
  $('model-status').textContent = `Reading ${f.name}…`;
  const bytes = new Uint8Array(await f.arrayBuffer());
  loadModel(bytes, f.name).catch(() => {});
});
$('gpu-mode').addEventListener('change', () => {
  if (state.modelBytes) loadModel(state.modelBytes, state.modelName).catch(() => {});
});
$('generate').addEventListener('click', () => {
  // Pending from the click on (the run may wait for a model load to finish).
  $('output').dataset.done = 'false';
  $('output').dataset.tokens = '0';
  generate().catch(() => {});
});
$('stop').addEventListener('click', () => { state.stop = true; });
$('golden-run').addEventListener('click', () => {
  $('golden-status').textContent = 'Running…';
  golden()
    .then((r) => { $('golden-status').textContent = r.outcomes.every((o) => o.pass) ? 'All pass.' : 'Some cases FAIL.'; })
    .catch((e) => { $('golden-status').textContent = e.message; });
});

const ready = init().catch((e) => {
  notice($('env-guest'), `The guest could not start: ${describeError(e)}`, 'bad');
  throw e;
});
ready.then(() => { if (params.get('model') === 'default') loadDefault().catch(() => {}); }, () => {});

window.wisp = {
  ready,
  loadDefault,
  loadModel: (mode) => loadModel(state.modelBytes, state.modelName, mode),
  generate,
  golden,
  streamLog: () => state.streamLog,
  simulateDeviceLoss: () => state.guest?.gpu.simulateDeviceLoss(),
};
