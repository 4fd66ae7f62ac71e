"""OLMo 2 (llama.cpp's `olmo2`): norms after each block instead of before it, and the queries'
and keys' RMS norms across all their heads at once. Writes a tiny GGUF with random weights
and its golden file from the float64 numpy forward below; tests/tests/arch.rs holds wisp to them
on every path.

    python3 tests/arch/olmo2.py OUT_DIR   # OUT_DIR/tiny-olmo2.gguf, OUT_DIR/tiny-olmo2.json

With `olmo3` after OUT_DIR it writes OLMo 3's shape instead (`tiny-olmo3.*`, still `olmo2`): a
sliding window on the layers its pattern marks (here as flags: the first and the last), YaRN's
scaling on the others' rotation alone (llama.cpp turns sliding layers unscaled).
"""

import pathlib
import sys

import gguf
import numpy as np

import tiny

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 64, 4, 2, 96, 3
HEAD_DIM = N_EMBD // N_HEAD
EPS, ROPE_BASE = 1e-6, 500000.0
# OLMo 3: the layers that slide, their window, and the global layers' YaRN (the released 7B:
# window 4096, three of four layers sliding, YaRN factor 8 over 8192 positions).
SLIDING, WINDOW = [True, False, True], 5
YARN = {"factor": 4.0, "original": 8, "beta_fast": 0.375, "beta_slow": 2.0**-10}


def rng_weights(seed=23):
    mat, norm = tiny.random_weights(seed)
    kv = N_HEAD_KV * HEAD_DIM
    w = {
        "token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 1.0),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(tiny.N_VOCAB, N_EMBD, 0.2),
    }
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_q.weight"] = mat(N_EMBD, N_EMBD)
        w[f"blk.{l}.attn_k.weight"] = mat(kv, N_EMBD)
        w[f"blk.{l}.attn_v.weight"] = mat(kv, N_EMBD)
        # Norms across the heads, far from 1 and unlike from head to head.
        w[f"blk.{l}.attn_q_norm.weight"] = (norm(N_EMBD) * np.linspace(0.3, 2.5, N_EMBD)).astype(np.float32)
        w[f"blk.{l}.attn_k_norm.weight"] = (norm(kv) * np.linspace(2.5, 0.3, kv)).astype(np.float32)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, N_EMBD)
        w[f"blk.{l}.post_attention_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
        w[f"blk.{l}.post_ffw_norm.weight"] = norm(N_EMBD)
    return w


def hparams(w):
    tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)


def hparams_olmo3(w):
    hparams(w)
    w.add_sliding_window(WINDOW)
    w.add_sliding_window_pattern(SLIDING)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(YARN["factor"])
    w.add_rope_scaling_orig_ctx_len(YARN["original"])
    w.add_rope_scaling_yarn_beta_fast(YARN["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(YARN["beta_slow"])


def forward(w, tokens, per_head=False, olmo3=False, yarn=True):
    """Logits after every token, float64: Hugging Face's Olmo2 (the q/k norms per head instead,
    where `per_head`: Qwen3's reading, which OLMo 2's files must not get); with `olmo3`, Olmo3's
    sliding layers and YaRN on the others (without it where not `yarn`)."""
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)

    def qk_norm(x, g):
        if not per_head:
            return tiny.rms_norm(x, g, EPS)
        h = x.reshape(t, -1, HEAD_DIM)
        return tiny.rms_norm(h, g.reshape(-1, HEAD_DIM), EPS).reshape(x.shape)

    x = w["token_embd.weight"][tokens]
    for l in range(N_LAYER):
        slides = olmo3 and SLIDING[l]
        see = tiny.causal(t, WINDOW if slides else None)
        q = qk_norm(x @ w[f"blk.{l}.attn_q.weight"].T, w[f"blk.{l}.attn_q_norm.weight"])
        k = qk_norm(x @ w[f"blk.{l}.attn_k.weight"].T, w[f"blk.{l}.attn_k_norm.weight"])
        v = x @ w[f"blk.{l}.attn_v.weight"].T
        if olmo3 and yarn and not slides:
            freq, mscale = tiny.yarn(HEAD_DIM, ROPE_BASE, YARN)
            factors = ROPE_BASE ** (-2.0 * np.arange(HEAD_DIM // 2) / HEAD_DIM) / freq
            q, k = (tiny.rope(y, pos, HEAD_DIM, ROPE_BASE, factors, mscale) for y in (q, k))
        else:
            q, k = tiny.rope(q, pos, HEAD_DIM, ROPE_BASE), tiny.rope(k, pos, HEAD_DIM, ROPE_BASE)
        a = tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see) @ w[f"blk.{l}.attn_output.weight"].T
        x = x + tiny.rms_norm(a, w[f"blk.{l}.post_attention_norm.weight"], EPS)
        gate, up = x @ w[f"blk.{l}.ffn_gate.weight"].T, x @ w[f"blk.{l}.ffn_up.weight"].T
        f = (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T
        x = x + tiny.rms_norm(f, w[f"blk.{l}.post_ffw_norm.weight"], EPS)
    return tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w["output.weight"].T


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-olmo2.gguf"
    exact = tiny.write_gguf(model, "olmo2", rng_weights(), ("attn_v", "ffn_up"), hparams)
    whole = forward(exact, tiny.PROMPT)[-1]
    per_head = forward(exact, tiny.PROMPT, per_head=True)[-1]
    tiny.golden(out, "tiny-olmo2", "olmo2", model, lambda t: forward(exact, t), {"head_norm_effect_rmse": tiny.rmse(whole, per_head)})


def main_olmo3(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-olmo3.gguf"
    exact = tiny.write_gguf(model, "olmo2", rng_weights(), ("attn_v", "ffn_up"), hparams_olmo3)
    want = forward(exact, tiny.PROMPT, olmo3=True)[-1]
    # Without the window (OLMo 2's reading), or with the global layers turned plainly, far off.
    effect = min(tiny.rmse(want, forward(exact, tiny.PROMPT)[-1]), tiny.rmse(want, forward(exact, tiny.PROMPT, olmo3=True, yarn=False)[-1]))
    tiny.golden(out, "tiny-olmo3", "olmo2", model, lambda t: forward(exact, t, olmo3=True), {"olmo3_effect_rmse": effect})


if __name__ == "__main__":
    if sys.argv[2:] == ["olmo3"]:
        main_olmo3(pathlib.Path(sys.argv[1]))
    else:
        main(pathlib.Path(sys.argv[1]))
