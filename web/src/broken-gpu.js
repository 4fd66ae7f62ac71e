// Deliberately broken hosts of `wisp:llm/gpu`: wrappers around a correct import object (gpu.js's),
// each breaking one rule of the contract in wit/gpu.wit. The conformance kit must fail on every
// one of them (web/test/conformance.test.mjs; conformance.html?broken=NAME shows it in a browser).
// Each entry: `what` it breaks, and `wrap(imports)`, the broken import object.

export const BROKEN = {
  'perturbed-matmul': {
    what: 'matmul answers with the last value of every output off by 0.5 + 10%',
    wrap: (imports) => ({
      ...imports,
      async matmul(x, t, nIn, jobs) {
        const r = await imports.matmul(x, t, nIn, jobs);
        if (r.tag === 'ok') {
          for (const y of r.val) {
            const i = y.length - 1;
            if (i >= 0) y[i] += 0.5 + 0.1 * Math.abs(y[i]);
          }
        }
        return r;
      },
    }),
  },
  'lenient-matmul': {
    what: 'matmul trusts t and n-in: an x of another length is cut or padded with zeros to t * n-in',
    wrap: (imports) => ({
      ...imports,
      async matmul(x, t, nIn, jobs) {
        const n = t * nIn;
        if (x.length !== n && n > 0 && n <= 1 << 20) {
          const fitted = new Float32Array(n);
          fitted.set(x.length > n ? x.slice(0, n) : x);
          return imports.matmul(fitted, t, nIn, jobs);
        }
        return imports.matmul(x, t, nIn, jobs);
      },
    }),
  },
};
