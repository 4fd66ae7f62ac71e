// The teacher-forcing check of tests/golden/README.md, as host/src/golden.rs does it: feed
// `prompt_tokens + continuation` one token at a time and hold each step's logits to the
// reference. Thresholds: the argmax where the reference's margin is at least 0.25, every logit
// of the reference's top 5 within 1.5, and the RMSE over all logits after the prompt within 0.6.

/** Where the reference's argmax must be ours. */
export const MARGIN = 0.25;
/** Largest difference allowed on each of the reference's top-5 logits. */
export const TOP5_TOLERANCE = 1.5;
/** Largest root-mean-square difference over the full logits after the prompt. */
export const RMSE_TOLERANCE = 0.6;

/** Reads a golden file; each case's reference logits are `logits/NAME.logits.f32` beside it. */
export async function loadGolden(url) {
  const res = await fetch(url);
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  const golden = await res.json();
  if (!Array.isArray(golden.cases)) throw new Error(`${url}: no \`cases\` array`);
  return golden.cases.map((c) => ({
    name: c.name,
    prompt: c.prompt ?? '',
    promptTokens: c.prompt_tokens,
    continuation: c.continuation,
    steps: (c.steps ?? []).map((s) => ({ top5: s.top5, margin: s.margin ?? 0 })),
    logits: new URL(`logits/${c.name}.logits.f32`, new URL(url, location.href)).href,
  }));
}

async function readLogits(url) {
  const res = await fetch(url);
  if (res.status === 404) return null;
  if (!res.ok) throw new Error(`${url}: HTTP ${res.status}`);
  return new Float32Array(await res.arrayBuffer());
}

/** The largest value's index (first on ties; NaN never wins). */
export function argmax(v) {
  let best = 0;
  for (let i = 0; i < v.length; i++) {
    if (v[i] > v[best] || Number.isNaN(v[best])) best = i;
  }
  return best;
}

/** Whether the thresholds hold (a case without references passes). */
export function pass(o) {
  return !o.judged || (o.argmaxMismatches.length === 0 && o.maxTop5Diff <= TOP5_TOLERANCE && (o.rmse === null || o.rmse <= RMSE_TOLERANCE));
}

/**
 * Runs one case on `model` (a loaded engine Model). `maxSteps` limits the continuation fed
 * (all of it by default). Resolves to what was measured; `pass(outcome)` judges it.
 */
export async function runCase(model, c, { maxSteps = Infinity } = {}) {
  const steps = Math.min(c.continuation.length, maxSteps);
  const session = model.newSession(c.promptTokens.length + steps + 1);
  const out = {
    name: c.name,
    steps,
    judged: c.steps.length > 0,
    argmaxChecked: 0,
    argmaxMismatches: [],
    maxTop5Diff: 0,
    rmse: null,
    argmax: [],
  };
  try {
    await session.feed(Uint32Array.from(c.promptTokens));
    for (let i = 0; i < steps; i++) {
      const next = c.continuation[i];
      const logits = await session.logits();
      if (i === 0) {
        const reference = await readLogits(c.logits);
        if (reference) {
          if (reference.length !== logits.length) {
            throw new Error(`${c.name}: the reference has ${reference.length} logits, the model ${logits.length}`);
          }
          let se = 0;
          for (let k = 0; k < logits.length; k++) se += (logits[k] - reference[k]) ** 2;
          out.rmse = Math.sqrt(se / logits.length);
        }
      }
      const top = argmax(logits);
      out.argmax.push(top);
      const step = c.steps[i];
      if (step) {
        if (step.margin >= MARGIN) {
          out.argmaxChecked += 1;
          if (top !== next) out.argmaxMismatches.push(i);
        }
        for (const [id, want] of step.top5) {
          if (id >= logits.length) throw new Error(`${c.name}: a reference id is past the vocabulary`);
          const diff = Math.abs(logits[id] - want);
          out.maxTop5Diff = Number.isNaN(diff) ? Infinity : Math.max(out.maxTop5Diff, diff);
        }
      }
      // The reference's token goes in (teacher forcing); after the last step nothing is judged.
      if (i + 1 < steps) await session.feed(Uint32Array.of(next));
    }
    out.stats = Object.fromEntries(Object.entries(session.stats()).map(([k, v]) => [k, Number(v)]));
  } finally {
    session[Symbol.dispose]?.();
  }
  out.pass = pass(out);
  return out;
}
