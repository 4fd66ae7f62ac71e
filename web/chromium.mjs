// How the browser tests run Chromium: Debian's package, headless, with WebGPU on SwiftShader and
// JSPI. Playwright adds --headless (headless: true); FLAGS are the rest. SwiftShader's WebGPU
// adapter needs --enable-unsafe-webgpu on Linux; JSPI ships enabled in Chromium 156 (the feature
// is named anyway, for older builds). $CHROMIUM overrides the path.

import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { build, DIST, GUEST_WASM } from './build.mjs';

export const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
export const FLAGS = [
  '--no-sandbox',
  '--enable-unsafe-webgpu',
  '--enable-features=Vulkan,WebAssemblyJSPI',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
  '--no-first-run',
];
/** Under CI=true, what a test cannot run is a failure, not a skip. */
export const CI = ['true', '1'].includes(process.env.CI ?? '');

/**
 * Why a test of the guest in Chromium cannot run here, or null: the guest must be built (its
 * transpilation into dist/ is made when missing) and Chromium installed.
 */
export function whyNoGuestInChromium() {
  if (!existsSync(GUEST_WASM)) return `${GUEST_WASM} is missing (cargo build --release -p wisp)`;
  if (!existsSync(join(DIST, 'guest.json'))) build({ quiet: true });
  if (!existsSync(CHROMIUM)) return `no Chromium at ${CHROMIUM} (apt-get install chromium)`;
  return null;
}

/** Keeps a page's console messages and uncaught errors in `lines`. */
export function recordConsole(page, lines) {
  page.on('console', (m) => lines.push(`${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => lines.push(`pageerror: ${e.message}`));
}
