"""Two architectures that are Llama's block with a twist, added as names of the Llama file
(guest/src/models/qwen2.rs): Granite (llama.cpp's `granite`: the embedding, each block's output,
the attention scores and the logits scaled by numbers in the file) and SmolLM3 (`smollm3`: no
rotation in every fourth layer). Writes a tiny GGUF of each with random weights and its golden
file from the float64 numpy forward below; tests/tests/arch.rs holds wisp to them on every path.

    python3 tests/arch/llama_family.py OUT_DIR ARCH   # ARCH granite or smollm3:
                                                      # OUT_DIR/tiny-ARCH.gguf, OUT_DIR/tiny-ARCH.json
"""

import pathlib
import sys

import numpy as np

import tiny

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 64, 4, 2, 96, 4
HEAD_DIM = N_EMBD // N_HEAD
EPS, ROPE_BASE = 1e-5, 10000.0
# Granite's multipliers, far from 1 (the released models': 12, 0.22, 8, 0.0078125).
GRANITE = {"embedding": 6.0, "residual": 0.4, "logits": 0.5, "attention": 0.05}


def rng_weights(seed):
    mat, norm = tiny.random_weights(seed)
    w = {
        "token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 0.3),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(tiny.N_VOCAB, N_EMBD, 0.2),
    }
    kv = N_HEAD_KV * HEAD_DIM
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_q.weight"] = mat(N_EMBD, N_EMBD, 0.3)
        w[f"blk.{l}.attn_k.weight"] = mat(kv, N_EMBD, 0.3)
        w[f"blk.{l}.attn_v.weight"] = mat(kv, N_EMBD)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, N_EMBD)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    return w


def hparams(arch):
    def add(w):
        tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)
        if arch == "granite":
            w.add_embedding_scale(GRANITE["embedding"])
            w.add_residual_scale(GRANITE["residual"])
            w.add_logit_scale(GRANITE["logits"])
            w.add_attention_scale(GRANITE["attention"])
    return add


def forward(w, tokens, arch, quirk=True):
    """Logits after every token, float64: Llama with GGUF's pair rotation, and `arch`'s twist
    (without it where `quirk` is false)."""
    granite = arch == "granite" and quirk
    m = GRANITE if granite else {"embedding": 1.0, "residual": 1.0, "logits": 1.0, "attention": None}
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    see = tiny.causal(t)
    x = w["token_embd.weight"][tokens] * m["embedding"]
    for l in range(N_LAYER):
        turns = not (arch == "smollm3" and quirk and (l + 1) % 4 == 0)
        h = tiny.rms_norm(x, w[f"blk.{l}.attn_norm.weight"], EPS)
        q, k, v = h @ w[f"blk.{l}.attn_q.weight"].T, h @ w[f"blk.{l}.attn_k.weight"].T, h @ w[f"blk.{l}.attn_v.weight"].T
        if turns:
            q, k = tiny.rope_pairs(q, pos, HEAD_DIM, ROPE_BASE), tiny.rope_pairs(k, pos, HEAD_DIM, ROPE_BASE)
        if m["attention"] is not None:
            # tiny.attention scales by 1/sqrt(head_dim): the queries carry the rest.
            q = q * m["attention"] * np.sqrt(HEAD_DIM)
        a = tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see) @ w[f"blk.{l}.attn_output.weight"].T
        x = x + a * m["residual"]
        h = tiny.rms_norm(x, w[f"blk.{l}.ffn_norm.weight"], EPS)
        gate, up = h @ w[f"blk.{l}.ffn_gate.weight"].T, h @ w[f"blk.{l}.ffn_up.weight"].T
        x = x + ((gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T) * m["residual"]
    return tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w["output.weight"].T / m["logits"]


def main(out, arch):
    out.mkdir(parents=True, exist_ok=True)
    model = out / f"tiny-{arch}.gguf"
    exact = tiny.write_gguf(model, arch, rng_weights(17), ("attn_q", "ffn_down"), hparams(arch))
    plain = forward(exact, tiny.PROMPT, arch, quirk=False)[-1]
    twisted = forward(exact, tiny.PROMPT, arch)[-1]
    tiny.golden(out, f"tiny-{arch}", arch, model, lambda t: forward(exact, t, arch), {"quirk_effect_rmse": tiny.rmse(plain, twisted)})


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2])
