// How the browser tests run Chromium: Debian's package, headless, with WebGPU on SwiftShader and
// JSPI. Playwright adds --headless (headless: true); FLAGS are the rest. SwiftShader's WebGPU
// adapter needs --enable-unsafe-webgpu on Linux; JSPI ships enabled in Chromium 156 (the feature
// is named anyway, for older builds). $CHROMIUM overrides the path.

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
