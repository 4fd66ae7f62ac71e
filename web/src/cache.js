// Models kept in the browser's Cache Storage, by the sha256 of their bytes, and the download
// that fills it.
//
// Two kinds of entries in the cache `wisp-models`, both under a path of this origin that is only
// ever a key (nothing is fetched from it):
//   .wisp-models/sha256/<hex>   the file, with its source, name and time in headers
//   .wisp-models/source/<url>   the sha256 of what that URL gave when it was downloaded
// A model named by URL and sha256 loads from the first kind; one named by URL alone from the
// sha256 its URL had when it was cached (`deleteCachedModel` forgets both).
//
// Works in a page and in a worker (Cache Storage and SubtleCrypto are in both).

export const CACHE_NAME = 'wisp-models';
const PREFIX = '.wisp-models/';

const key = (kind, name) => new URL(`/${PREFIX}${kind}/${encodeURIComponent(name)}`, globalThis.location.href).href;

/** Whether this context has Cache Storage (not in opaque origins, nor some private modes). */
export function cacheAvailable() {
  return typeof caches !== 'undefined' && globalThis.isSecureContext !== false;
}

/**
 * The bytes at `url`, with `onProgress(got, total)` as they arrive (`total` 0 where the server
 * gives no length). Throws `URL: HTTP status` for an answer that is not 200.
 */
export async function download(url, onProgress = () => {}) {
  const res = await fetch(url);
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  const total = Number(res.headers.get('content-length')) || 0;
  // Into one buffer where the length is known; in chunks, joined at the end, where not.
  const whole = total ? new Uint8Array(total) : null;
  const chunks = [];
  let got = 0;
  const reader = res.body.getReader();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    if (whole && got + value.length <= total) whole.set(value, got);
    else chunks.push({ at: got, value });
    got += value.length;
    onProgress(got, total);
  }
  if (whole && got === total && chunks.length === 0) return whole;
  const all = new Uint8Array(got);
  if (whole) all.set(whole.subarray(0, Math.min(got, total)));
  for (const { at, value } of chunks) all.set(value, at);
  return all;
}

/** The sha256 of `bytes`, as lowercase hex. */
export async function sha256Hex(bytes) {
  const digest = await crypto.subtle.digest('SHA-256', bytes);
  return [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, '0')).join('');
}

/** What a `model` names: `{ url, sha256, name }` (sha256 lowercase, or null). */
export function modelRef(model) {
  const ref = typeof model === 'string' || model instanceof URL ? { url: String(model) } : { ...model };
  if (typeof ref.url !== 'string' || !ref.url) throw new TypeError('model: a URL, or { url, sha256?, name? }');
  ref.url = new URL(ref.url, globalThis.location.href).href;
  if (ref.sha256 !== undefined && ref.sha256 !== null) {
    if (typeof ref.sha256 !== 'string' || !/^[0-9a-fA-F]{64}$/.test(ref.sha256)) {
      throw new TypeError('model.sha256: 64 hexadecimal digits');
    }
    ref.sha256 = ref.sha256.toLowerCase();
  } else {
    ref.sha256 = null;
  }
  ref.name = ref.name || decodeURIComponent(new URL(ref.url).pathname.split('/').pop() || 'model.gguf');
  return ref;
}

/**
 * The cached file of `ref` (by its sha256, or by the sha256 its URL had), or null:
 * `{ sha256, size, file }`, `file` what `modelFile` takes. In a worker the file stays in Cache
 * Storage and is read a piece at a time as the guest asks (`FileReaderSync` over slices of the
 * response's Blob), so the tab never holds the whole model; elsewhere its bytes are read whole.
 */
export async function cachedModel(ref) {
  if (!cacheAvailable()) return null;
  const cache = await caches.open(CACHE_NAME);
  let sha = ref.sha256;
  if (!sha) {
    const known = await cache.match(key('source', ref.url));
    if (!known) return null;
    sha = (await known.text()).trim();
  }
  const hit = await cache.match(key('sha256', sha));
  if (!hit) return null;
  const blob = await hit.blob();
  const file = typeof FileReaderSync === 'function' ? blobFile(blob) : new Uint8Array(await blob.arrayBuffer());
  return { sha256: sha, size: blob.size, file };
}

/** A Blob as the file entry of preview2-shim's in-memory file system reads it (`byteLength`,
 *  and `slice(from, to)` giving those bytes), each slice read synchronously (workers only). */
function blobFile(blob) {
  const reader = new FileReaderSync();
  return {
    byteLength: blob.size,
    slice: (from, to) => new Uint8Array(reader.readAsArrayBuffer(blob.slice(from, to))),
  };
}

/** Keeps `bytes` (whose sha256 is `sha`) for `ref`. Throws what the browser refused (its quota). */
export async function keepModel(ref, sha, bytes) {
  const cache = await caches.open(CACHE_NAME);
  const headers = {
    'content-type': 'application/octet-stream',
    'content-length': String(bytes.length),
    'x-wisp-source': ref.url,
    'x-wisp-name': encodeURIComponent(ref.name),
    'x-wisp-cached-at': new Date().toISOString(),
  };
  await cache.put(key('sha256', sha), new Response(bytes, { headers }));
  await cache.put(key('source', ref.url), new Response(sha, { headers: { 'content-type': 'text/plain' } }));
}

/**
 * The models in this origin's cache: `[{ sha256, name, url, bytes, cachedAt }]`, oldest first.
 */
export async function listCachedModels() {
  if (!cacheAvailable()) return [];
  const cache = await caches.open(CACHE_NAME);
  const out = [];
  for (const req of await cache.keys()) {
    const path = new URL(req.url).pathname;
    const at = path.indexOf(`${PREFIX}sha256/`);
    if (at < 0) continue;
    const res = await cache.match(req);
    if (!res) continue;
    out.push({
      sha256: decodeURIComponent(path.slice(at + PREFIX.length + 'sha256/'.length)),
      name: decodeURIComponent(res.headers.get('x-wisp-name') || ''),
      url: res.headers.get('x-wisp-source') || null,
      bytes: Number(res.headers.get('content-length')) || 0,
      cachedAt: res.headers.get('x-wisp-cached-at') || null,
    });
  }
  return out.sort((a, b) => String(a.cachedAt).localeCompare(String(b.cachedAt)));
}

/**
 * Deletes a cached model by its sha256, and every URL that named it. Resolves to whether there
 * was one.
 */
export async function deleteCachedModel(sha256) {
  if (typeof sha256 !== 'string' || !/^[0-9a-fA-F]{64}$/.test(sha256)) throw new TypeError('sha256: 64 hexadecimal digits');
  if (!cacheAvailable()) return false;
  const sha = sha256.toLowerCase();
  const cache = await caches.open(CACHE_NAME);
  const found = await cache.delete(key('sha256', sha));
  for (const req of await cache.keys()) {
    if (!new URL(req.url).pathname.includes(`${PREFIX}source/`)) continue;
    const res = await cache.match(req);
    if (res && (await res.text()).trim() === sha) await cache.delete(req);
  }
  return found;
}
