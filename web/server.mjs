// A small static server for the demo page and its test, on 127.0.0.1 only.
//
//   /                  -> /web/index.html
//   /web/...           web/ (the page, its scripts, dist/ from build.mjs, the WASI shim in node_modules/)
//   /shaders/...       shaders/ (the WGSL the native host compiles in; the page loads it at run time)
//   /tests/golden/...  the golden references
//   /model/default.gguf  the default model from wisp's cache ($WISP_CACHE, else ~/.cache/wisp),
//                        as `wisp fetch` leaves it
//   /model/NAME.gguf     any other GGUF file in that cache (`wisp fetch qwen2.5-coder-0.5b`)
//
// `serve({ root })` serves the folder `root` at / instead of the mounts above (the /model/ paths
// stay): the packaging test's empty project.
//
// `node server.mjs [--port N]` (default 8080; 0 picks a free port). `serve()` does the same for
// a test and resolves to the running server and its URL.

import { createReadStream, existsSync, statSync } from 'node:fs';
import { createServer } from 'node:http';
import { homedir } from 'node:os';
import { extname, join, normalize, resolve, sep } from 'node:path';
import { fileURLToPath } from 'node:url';

const WEB = fileURLToPath(new URL('.', import.meta.url));
const ROOT = resolve(WEB, '..');
export const DEFAULT_MODEL = 'gemma-3-270m-q4_k_m.gguf';

export function modelPath(name = DEFAULT_MODEL) {
  return join(cacheDir(), name);
}

const TYPES = {
  '.html': 'text/html; charset=utf-8',
  '.js': 'text/javascript; charset=utf-8',
  '.mjs': 'text/javascript; charset=utf-8',
  '.css': 'text/css; charset=utf-8',
  '.json': 'application/json',
  '.wasm': 'application/wasm',
  '.wgsl': 'text/plain; charset=utf-8',
  '.png': 'image/png',
  '.svg': 'image/svg+xml',
};

// URL prefixes and the folders they serve.
const MOUNTS = [
  ['/web/', join(ROOT, 'web')],
  ['/shaders/', join(ROOT, 'shaders')],
  ['/tests/golden/', join(ROOT, 'tests', 'golden')],
];

function cacheDir() {
  return process.env.WISP_CACHE || join(homedir(), '.cache', 'wisp');
}

function resolvePath(pathname, mounts) {
  if (pathname === '/model/default.gguf') return modelPath();
  const named = /^\/model\/([\w.-]+\.gguf)$/.exec(pathname);
  if (named) return join(cacheDir(), named[1]);
  for (const [prefix, dir] of mounts) {
    if (!pathname.startsWith(prefix)) continue;
    const file = normalize(join(dir, pathname.slice(prefix.length)));
    // Nothing outside the mount, whatever the URL says.
    if (file !== dir && !file.startsWith(dir + sep)) return null;
    return file;
  }
  return null;
}

function handle(req, res, mounts, root) {
  let pathname;
  try {
    pathname = decodeURIComponent(new URL(req.url, 'http://127.0.0.1').pathname);
  } catch {
    res.writeHead(400).end('bad request');
    return;
  }
  if (req.method !== 'GET' && req.method !== 'HEAD') {
    res.writeHead(405, { allow: 'GET, HEAD' }).end();
    return;
  }
  if (!root && (pathname === '/' || pathname === '/web' || pathname === '/index.html')) {
    res.writeHead(302, { location: '/web/index.html' }).end();
    return;
  }
  let file = resolvePath(pathname, mounts);
  if (file && existsSync(file) && statSync(file).isDirectory()) file = join(file, 'index.html');
  if (!file || !existsSync(file) || !statSync(file).isFile()) {
    res.writeHead(404, { 'content-type': 'text/plain' }).end(`not found: ${pathname}`);
    return;
  }
  const size = statSync(file).size;
  res.writeHead(200, {
    'content-type': TYPES[extname(file)] || 'application/octet-stream',
    'content-length': size,
    'cache-control': 'no-cache',
  });
  if (req.method === 'HEAD') {
    res.end();
    return;
  }
  createReadStream(file).on('error', () => res.destroy()).pipe(res);
}

/**
 * Starts the server on 127.0.0.1; resolves to `{ server, url, hits }`, `hits` counting the GET
 * requests of each path.
 */
export function serve({ port = 8080, root = null } = {}) {
  const mounts = root ? [['/', resolve(root)]] : MOUNTS;
  const hits = new Map();
  return new Promise((ok, fail) => {
    const server = createServer((req, res) => {
      const path = (req.url ?? '').split('?')[0];
      if (req.method === 'GET') hits.set(path, (hits.get(path) ?? 0) + 1);
      handle(req, res, mounts, root);
    });
    server.on('error', fail);
    server.listen(port, '127.0.0.1', () => {
      const url = `http://127.0.0.1:${server.address().port}`;
      ok({ server, url, hits });
    });
  });
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const i = process.argv.indexOf('--port');
  const port = i > 0 ? Number(process.argv[i + 1]) : Number(process.env.PORT || 8080);
  const { url } = await serve({ port });
  console.log(`wisp demo: ${url}/web/index.html (the lab page: ${url}/web/lab.html)`);
  if (!existsSync(modelPath())) {
    console.log(`(no default model at ${modelPath()}: run \`wisp fetch\`, or pick a GGUF file in the page)`);
  }
}
