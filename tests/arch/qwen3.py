"""An architecture added as a file and a line: Qwen3 (llama.cpp's `qwen3`: Qwen2's block without
biases, each head of the queries and keys RMS-normed before it is turned, a head size that is not
`n_embd / n_head`). Writes a tiny GGUF with random weights with the `gguf` package, and its golden
file from the float64 numpy forward below. tests/tests/arch.rs holds wisp to them on its CPU
path, on wgpu and on the host's CPU reference device.

    python3 tests/arch/qwen3.py OUT_DIR   # OUT_DIR/tiny-qwen3.gguf, OUT_DIR/tiny-qwen3.json
"""

import pathlib
import sys

import numpy as np

import tiny

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER = 64, 4, 2, 32, 96, 3
EPS, ROPE_BASE = 1e-6, 1000000.0


def rng_weights(seed=11):
    mat, norm = tiny.random_weights(seed)
    nq, nkv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    w = {
        "token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 1.0),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(tiny.N_VOCAB, N_EMBD, 0.2),
    }
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_q.weight"] = mat(nq, N_EMBD)
        w[f"blk.{l}.attn_k.weight"] = mat(nkv, N_EMBD)
        w[f"blk.{l}.attn_v.weight"] = mat(nkv, N_EMBD)
        # Head norms far from 1, so that a model run without them is far off.
        w[f"blk.{l}.attn_q_norm.weight"] = (norm(HEAD_DIM) * np.linspace(0.3, 2.5, HEAD_DIM)).astype(np.float32)
        w[f"blk.{l}.attn_k_norm.weight"] = (norm(HEAD_DIM) * np.linspace(2.5, 0.3, HEAD_DIM)).astype(np.float32)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, nq)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    return w


def hparams(w):
    tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)


def forward(w, tokens, head_norms=True):
    """Logits after every token, float64: Hugging Face's Qwen3 (dense)."""
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    see = tiny.causal(t)
    for l in range(N_LAYER):
        h = tiny.rms_norm(x, w[f"blk.{l}.attn_norm.weight"], EPS)
        q, k, v = (h @ w[f"blk.{l}.attn_{p}.weight"].T for p in "qkv")
        if head_norms:
            q = tiny.rms_norm(q.reshape(t, N_HEAD, HEAD_DIM), w[f"blk.{l}.attn_q_norm.weight"], EPS).reshape(t, -1)
            k = tiny.rms_norm(k.reshape(t, N_HEAD_KV, HEAD_DIM), w[f"blk.{l}.attn_k_norm.weight"], EPS).reshape(t, -1)
        q, k = tiny.rope(q, pos, HEAD_DIM, ROPE_BASE), tiny.rope(k, pos, HEAD_DIM, ROPE_BASE)
        x = x + tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see) @ w[f"blk.{l}.attn_output.weight"].T
        h = tiny.rms_norm(x, w[f"blk.{l}.ffn_norm.weight"], EPS)
        gate, up = h @ w[f"blk.{l}.ffn_gate.weight"].T, h @ w[f"blk.{l}.ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T
    return tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w["output.weight"].T


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-qwen3.gguf"
    exact = tiny.write_gguf(model, "qwen3", rng_weights(), ("attn_q", "ffn_down"), hparams)
    # Without the head norms: far from the model's logits, so that matching those shows the
    # norms are applied, not only the products.
    plain = forward(exact, tiny.PROMPT, head_norms=False)[-1]
    normed = forward(exact, tiny.PROMPT)[-1]
    tiny.golden(out, "tiny-qwen3", "qwen3", model, lambda t: forward(exact, t), {"head_norm_effect_rmse": tiny.rmse(plain, normed)})


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
