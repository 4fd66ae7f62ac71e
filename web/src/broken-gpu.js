// Deliberately broken hosts of `wisp:llm/gpu`: wrappers around a correct import object (gpu.js's),
// each breaking one rule of the contract in wit/gpu.wit. The conformance kit must fail on every
// one of them (web/test/conformance.test.mjs; conformance.html?broken=NAME shows it in a browser).
// Each entry: `what` it breaks, and `wrap(imports)`, the broken import object.

/** `imports` with every program `createProgram` makes running through `run(inner, inputs,
 *  batch, ops)`, `inner` the program's own `run` and `ops` the ops it was made of. The program
 *  stays the host's own object (jco accepts no other as a `program`); only its `run` is
 *  replaced. */
function wrapRuns(imports, run) {
  return {
    ...imports,
    async createProgram(weights, caches, ops) {
      const made = await imports.createProgram(weights, caches, ops);
      if (made.tag === 'ok') {
        const program = made.val;
        const inner = program.run.bind(program);
        program.run = (inputs, batch) => run(inner, inputs, batch, ops);
      }
      return made;
    },
  };
}

export const BROKEN = {
  'perturbed-products': {
    what: 'a program run answers with the last value of every rows output off by 0.5 + 10% (products among them)',
    wrap: (imports) => wrapRuns(imports, async (run, inputs, batch) => {
      const r = await run(inputs, batch);
      if (r.tag === 'ok') {
        for (const out of r.val) {
          if (out.tag !== 'rows') continue;
          const y = out.val;
          const i = y.length - 1;
          if (i >= 0) y[i] += 0.5 + 0.1 * Math.abs(y[i]);
        }
      }
      return r;
    }),
  },
  'lenient-inputs': {
    what: 'a program run trusts the batch\'s rows: an input of another length is cut or padded with zeros to rows * width',
    wrap: (imports) => wrapRuns(imports, (run, inputs, batch, ops) => {
      const widths = ops.filter((op) => op.tag === 'input').map((op) => op.val);
      const rows = batch.reduce((n, q) => n + q.rows, 0);
      const fitted = inputs.map((x, i) => {
        const n = rows * (widths[i] ?? 0);
        if (x.length === n || n === 0 || n > 1 << 20) return x;
        const y = new Float32Array(n);
        y.set(x.length > n ? x.slice(0, n) : x);
        return y;
      });
      return run(fitted, batch);
    }),
  },
};
