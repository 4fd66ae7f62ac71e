"""Gemma 2 (llama.cpp's `gemma2`): Gemma 3's block without its q/k norms, a sliding window on
every other layer (the even ones), and soft-capping: each attention score `s` becomes
`c tanh(s / c)` (`attn_logit_softcapping`), and the logits likewise (`final_logit_softcapping`).
Writes a tiny GGUF with random weights and its golden file from the float64 numpy forward below;
tests/tests/arch.rs holds wisp to them on every path. The caps are far tighter than the real
models' 50 and 30, so that they move the tiny model's scores and logits a long way.

    python3 tests/arch/gemma2.py OUT_DIR   # OUT_DIR/tiny-gemma2.gguf, OUT_DIR/tiny-gemma2.json
"""

import pathlib
import sys

import numpy as np

import tiny

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 64, 4, 2, 96, 4
HEAD_DIM = N_EMBD // N_HEAD
EPS, ROPE_BASE, WINDOW = 1e-6, 10000.0, 6
ATTN_CAP, FINAL_CAP = 1.5, 10.0


def rng_weights(seed=29):
    mat, norm = tiny.random_weights(seed)
    kv = N_HEAD_KV * HEAD_DIM
    # Gemma's embedding is tied to the output; no output.weight.
    w = {"token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 0.5), "output_norm.weight": norm(N_EMBD)}
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_q.weight"] = mat(N_EMBD, N_EMBD, 0.3)
        w[f"blk.{l}.attn_k.weight"] = mat(kv, N_EMBD, 0.3)
        w[f"blk.{l}.attn_v.weight"] = mat(kv, N_EMBD)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, N_EMBD)
        w[f"blk.{l}.post_attention_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
        w[f"blk.{l}.post_ffw_norm.weight"] = norm(N_EMBD)
    return w


def hparams(w):
    tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)
    w.add_sliding_window(WINDOW)
    w.add_attn_logit_softcapping(ATTN_CAP)
    w.add_final_logit_softcapping(FINAL_CAP)


def forward(w, tokens, attn_cap=ATTN_CAP, final_cap=FINAL_CAP):
    """Logits after every token, float64: Hugging Face's Gemma2 (a cap of None: none)."""
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    x = w["token_embd.weight"][tokens] * np.sqrt(N_EMBD)
    for l in range(N_LAYER):
        see = tiny.causal(t, WINDOW if l % 2 == 0 else None)
        h = tiny.rms_norm(x, w[f"blk.{l}.attn_norm.weight"], EPS)
        q, k, v = (h @ w[f"blk.{l}.attn_{n}.weight"].T for n in "qkv")
        q, k = tiny.rope(q, pos, HEAD_DIM, ROPE_BASE), tiny.rope(k, pos, HEAD_DIM, ROPE_BASE)
        a = tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see, softcap=attn_cap)
        x = x + tiny.rms_norm(a @ w[f"blk.{l}.attn_output.weight"].T, w[f"blk.{l}.post_attention_norm.weight"], EPS)
        h = tiny.rms_norm(x, w[f"blk.{l}.ffn_norm.weight"], EPS)
        gate, up = h @ w[f"blk.{l}.ffn_gate.weight"].T, h @ w[f"blk.{l}.ffn_up.weight"].T
        gelu = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate**3)))
        f = (gelu * up) @ w[f"blk.{l}.ffn_down.weight"].T
        x = x + tiny.rms_norm(f, w[f"blk.{l}.post_ffw_norm.weight"], EPS)
    logits = tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w["token_embd.weight"].T
    return logits if final_cap is None else final_cap * np.tanh(logits / final_cap)


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-gemma2.gguf"
    exact = tiny.write_gguf(model, "gemma2", rng_weights(), ("attn_v", "ffn_up"), hparams)
    capped = forward(exact, tiny.PROMPT)[-1]
    # Each cap alone moves the logits far: the attention's, and the logits' own.
    effect = min(tiny.rmse(capped, forward(exact, tiny.PROMPT, attn_cap=None)[-1]),
                 tiny.rmse(capped, forward(exact, tiny.PROMPT, final_cap=None)[-1]))
    tiny.golden(out, "tiny-gemma2", "gemma2", model, lambda t: forward(exact, t), {"softcap_effect_rmse": effect})


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
