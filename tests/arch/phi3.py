"""A third architecture, added in guest/ alone: Phi-3 (llama.cpp's `phi3`: fused `attn_qkv` and
`ffn_up`, a sliding window on every layer). Writes a tiny GGUF with random weights with the
`gguf` package, and its golden file: the logits of the float64 numpy forward below (the prompt's
full logits, every step's top 5 of the greedy continuation). tests/tests/arch.rs holds wisp to
them on its CPU path, on wgpu and on the host's CPU reference device.

    python3 tests/arch/phi3.py OUT_DIR   # OUT_DIR/tiny-phi3.gguf, OUT_DIR/tiny-phi3.json

With `longrope` after OUT_DIR it writes Phi-3.5's long-rope instead (`tiny-phi3-longrope.*`):
`rope_factors_long` and `_short`, an original context (64) below the model's (256), so that the
long factors apply, and `rope.scaling.attn_factor` on the cosines and sines. With `phi4mini`
Phi-4-mini's shape (`tiny-phi4mini.*`): a partial rotation (`rope.dimension_count` 12 of a head
of 16, as its 96 of 128), long-rope factors of that many frequencies, the output tied to the
embedding and no window.
"""

import pathlib
import sys

import numpy as np

import tiny

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER = 64, 4, 2, 16, 96, 3
WINDOW, EPS, ROPE_BASE = 7, 1e-5, 10000.0
# Phi-3.5's long-rope, for a model of context 256 first trained at 64 (attn_factor as its
# converter computes it: sqrt(1 + ln(256 / 64) / ln(64))).
ORIGINAL_CONTEXT = 64
ATTN_FACTOR = float(np.sqrt(1 + np.log(256 / ORIGINAL_CONTEXT) / np.log(ORIGINAL_CONTEXT)))
LONG = np.linspace(1.0, 12.0, HEAD_DIM // 2).astype(np.float32)
SHORT = np.linspace(1.0, 1.5, HEAD_DIM // 2).astype(np.float32)
# Phi-4-mini: the first three quarters of each head turn.
ROPE_DIM = HEAD_DIM * 3 // 4


def rng_weights(seed=7):
    mat, norm = tiny.random_weights(seed)
    nq, nkv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    w = {
        "token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 1.0),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(tiny.N_VOCAB, N_EMBD, 0.2),
    }
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_qkv.weight"] = mat(nq + 2 * nkv, N_EMBD)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, nq)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(2 * N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    return w


def hparams_longrope(w):
    hparams(w)
    w.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
    w.add_rope_scaling_attn_factors(ATTN_FACTOR)


def hparams(w):
    tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_sliding_window(WINDOW)


def hparams_phi4mini(w):
    tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)
    w.add_rope_dimension_count(ROPE_DIM)
    w.add_rope_scaling_orig_ctx_len(ORIGINAL_CONTEXT)
    w.add_rope_scaling_attn_factors(ATTN_FACTOR)


def forward(w, tokens, window=WINDOW, rope=(None, 1.0), rope_dim=HEAD_DIM):
    """Logits after every token, float64: the model card's Phi-3 with a window on every layer
    (`window` None: none), the output tied to the embedding where the file has no `output`."""
    t = len(tokens)
    nq, nkv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    pos = np.arange(t, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    see = tiny.causal(t, window)
    for l in range(N_LAYER):
        h = tiny.rms_norm(x, w[f"blk.{l}.attn_norm.weight"], EPS)
        qkv = h @ w[f"blk.{l}.attn_qkv.weight"].T
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        q, k = (tiny.rope(y, pos, HEAD_DIM, ROPE_BASE, *rope, rope_dim=rope_dim) for y in (q, k))
        x = x + tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see) @ w[f"blk.{l}.attn_output.weight"].T
        h = tiny.rms_norm(x, w[f"blk.{l}.ffn_norm.weight"], EPS)
        gu = h @ w[f"blk.{l}.ffn_up.weight"].T
        gate, up = gu[:, :N_FF], gu[:, N_FF:]
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T
    return tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w.get("output.weight", w["token_embd.weight"]).T


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-phi3.gguf"
    # The fused products go as Q8_0 (so that splitting them at load is checked on quantized
    # blocks too), the rest as f32.
    exact = tiny.write_gguf(model, "phi3", rng_weights(), ("attn_qkv", "ffn_up", "ffn_down"), hparams)
    # The same prompt without the window: far from the windowed logits, so that matching those
    # shows the window is right, not only the products.
    unwindowed = forward(exact, tiny.PROMPT, window=len(tiny.PROMPT))[-1]
    windowed = forward(exact, tiny.PROMPT)[-1]
    tiny.golden(out, "tiny-phi3", "phi3", model, lambda t: forward(exact, t), {"window_effect_rmse": tiny.rmse(unwindowed, windowed)})


def main_longrope(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-phi3-longrope.gguf"
    weights = rng_weights()
    weights["rope_factors_long.weight"] = LONG
    weights["rope_factors_short.weight"] = SHORT
    exact = tiny.write_gguf(model, "phi3", weights, ("attn_qkv",), hparams_longrope)
    long = (LONG.astype(np.float64), ATTN_FACTOR)
    want = forward(exact, tiny.PROMPT, rope=long)[-1]
    # The short factors, or none, are far from the long ones.
    effect = min(tiny.rmse(want, forward(exact, tiny.PROMPT, rope=(SHORT.astype(np.float64), ATTN_FACTOR))[-1]),
                 tiny.rmse(want, forward(exact, tiny.PROMPT)[-1]))
    tiny.golden(out, "tiny-phi3-longrope", "phi3", model, lambda t: forward(exact, t, rope=long), {"long_rope_effect_rmse": effect})


def main_phi4mini(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-phi4mini.gguf"
    weights = rng_weights()
    # Tied: the embedding is the output projection, at the scale of the untied one's logits.
    del weights["output.weight"]
    weights["token_embd.weight"] *= 0.25
    weights["rope_factors_long.weight"] = LONG[: ROPE_DIM // 2]
    weights["rope_factors_short.weight"] = SHORT[: ROPE_DIM // 2]
    exact = tiny.write_gguf(model, "phi3", weights, ("attn_qkv",), hparams_phi4mini)
    long = (LONG[: ROPE_DIM // 2].astype(np.float64), ATTN_FACTOR)
    run = lambda t, rope_dim=ROPE_DIM: forward(exact, t, window=None, rope=long, rope_dim=rope_dim)
    want = run(tiny.PROMPT)[-1]
    # Turning whole heads (with the factors padded by ones) is far from turning three quarters.
    padded = (np.concatenate([long[0], np.ones(HEAD_DIM // 2 - ROPE_DIM // 2)]), ATTN_FACTOR)
    effect = tiny.rmse(want, forward(exact, tiny.PROMPT, window=None, rope=padded)[-1])
    tiny.golden(out, "tiny-phi4mini", "phi3", model, run, {"partial_rotation_effect_rmse": effect})


if __name__ == "__main__":
    if sys.argv[2:] == ["longrope"]:
        main_longrope(pathlib.Path(sys.argv[1]))
    elif sys.argv[2:] == ["phi4mini"]:
        main_phi4mini(pathlib.Path(sys.argv[1]))
    else:
        main(pathlib.Path(sys.argv[1]))
