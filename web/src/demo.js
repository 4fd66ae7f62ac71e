// The chat demo, on the package's API alone (index.js): the engine in its worker, the page
// posting messages. `?model=default|qwen` loads one at once, `?gpu=on|off|auto` sets the mode.
// `window.demo` is what the test reads: `loaded` (a promise per load) and `lastReply`.

import { createEngine, deleteCachedModel, listCachedModels } from './index.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const state = { engine: null, messages: [], controller: null, lastReply: null, loading: null };
const fmt = (n, d = 1) => (Number.isFinite(n) ? n.toFixed(d) : '–');

function setBusy(busy) {
  $('send').disabled = busy || !state.engine;
  $('load').disabled = busy;
  $('stop').disabled = !state.controller;
}

function showNotices(list) {
  $('notices').replaceChildren(...list.map((n) => Object.assign(document.createElement('div'), { className: 'notice', textContent: n })));
}

async function showCache() {
  const rows = (await listCachedModels()).map((m) => {
    const tr = document.createElement('tr');
    const del = Object.assign(document.createElement('button'), { textContent: 'Delete' });
    del.addEventListener('click', async () => {
      await deleteCachedModel(m.sha256);
      showCache();
    });
    tr.append(...[m.name, `${fmt(m.bytes / 2 ** 20, 0)} MiB`, m.sha256.slice(0, 16) + '…', m.cachedAt ?? ''].map((t) => Object.assign(document.createElement('td'), { textContent: t })));
    tr.append(Object.assign(document.createElement('td'), {}));
    tr.lastChild.append(del);
    return tr;
  });
  $('cached').replaceChildren(...rows);
}

async function load() {
  setBusy(true);
  state.engine?.unload();
  state.engine = null;
  const file = $('file').files[0];
  const [url, name] = file ? [URL.createObjectURL(file), file.name] : $('model').value.split('|');
  const gpu = $('gpu').value;
  try {
    const t0 = performance.now();
    state.engine = await createEngine({
      model: { url, name },
      gpu,
      onProgress: ({ phase, loaded, total }) => {
        const mib = (n) => fmt(n / 2 ** 20, 0);
        $('status').textContent = phase === 'download'
          ? `Downloading ${name}: ${mib(loaded)}${total ? ` of ${mib(total)}` : ''} MiB…`
          : phase === 'cache' ? `${name} from the browser's cache…` : `Loading ${name} into the engine…`;
      },
    });
    const m = state.engine.model;
    const where = m.device ? `${m.device.name} (${m.gpuWeights} weights on it)` : 'the CPU';
    $('status').textContent =
      `${m.name || m.id}: ${m.architecture}, ${fmt(m.nParams / 1e6, 0)}M parameters, ${m.fromCache ? 'from the cache' : 'downloaded'}, ` +
      `loaded in ${fmt((performance.now() - t0) / 1000)} s; products on ${where}, GPU ${m.gpu}; chat template ${m.chatTemplate ?? 'none'}`;
    showNotices(state.engine.env.notices);
    showCache();
    return { model: m, env: state.engine.env };
  } catch (e) {
    $('status').textContent = `Could not load ${name}: ${e.message}`;
    throw e;
  } finally {
    setBusy(false);
  }
}

function bubble(role, text) {
  const div = Object.assign(document.createElement('div'), { className: `msg ${role}`, textContent: text });
  $('chat').append(div);
  return div;
}

async function send() {
  const text = $('input').value.trim();
  if (!text || !state.engine) return;
  const system = $('system').value.trim();
  state.messages.push({ role: 'user', content: text });
  bubble('user', text);
  $('input').value = '';
  const out = bubble('assistant', '');
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let reply = '';
  let figures = null;
  let finish = null;
  try {
    const stream = await state.engine.chat.completions.create({
      messages: system ? [{ role: 'system', content: system }, ...state.messages] : state.messages,
      stream: true,
      max_tokens: Number($('max-tokens').value),
      temperature: Number($('temperature').value),
    }, { signal: controller.signal });
    for await (const chunk of stream) {
      reply += chunk.choices[0]?.delta?.content ?? '';
      out.textContent = reply;
      if (chunk.choices[0]?.finish_reason) finish = chunk.choices[0].finish_reason;
      if (chunk.wisp) figures = chunk.wisp;
    }
  } catch (e) {
    finish = e.name === 'AbortError' ? 'aborted' : 'error';
    if (e.name !== 'AbortError') out.classList.add('error');
    out.textContent = `${reply}${e.name === 'AbortError' ? ' [stopped]' : `\n[${e.message}]`}`;
  } finally {
    state.controller = null;
    setBusy(false);
  }
  state.messages.push({ role: 'assistant', content: reply });
  if (figures) {
    $('headline').textContent = `${fmt(figures.decode_tokens_per_s)} tokens/s`;
    const gpu = figures.gpu_calls > 0 ? `GPU: ${figures.gpu_calls} calls, ${fmt(figures.gpu_gflop, 2)} GFLOP` : 'GPU: none';
    $('stats').textContent =
      `prefill ${figures.prefill_tokens} tokens in ${fmt(figures.prefill_ms, 0)} ms (${fmt(figures.prefill_tokens_per_s)} tokens/s) · ` +
      `decode ${figures.decode_tokens} tokens in ${fmt(figures.decode_ms, 0)} ms · CPU: ${figures.cpu_matmuls} matmuls · ${gpu}`;
  }
  state.lastReply = { text: reply, finish, figures };
  return state.lastReply;
}

$('load').addEventListener('click', () => { state.loading = load().catch(() => {}); });
$('send').addEventListener('click', () => { send(); });
$('stop').addEventListener('click', () => state.controller?.abort());
$('clear').addEventListener('click', () => {
  state.messages = [];
  $('chat').replaceChildren();
});
$('input').addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !$('send').disabled) {
    e.preventDefault();
    send();
  }
});

if (['on', 'off', 'auto'].includes(params.get('gpu'))) $('gpu').value = params.get('gpu');
const pick = { default: 0, qwen: 1 }[params.get('model')];
if (pick !== undefined) {
  $('model').selectedIndex = pick;
  state.loading = load();
}
showCache();

window.demo = {
  loaded: () => state.loading,
  send: (text) => {
    $('input').value = text;
    return send();
  },
  lastReply: () => state.lastReply,
};
