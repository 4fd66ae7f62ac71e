"""One tiny Llama per GGUF tensor type, every product's weight (q, k, v, the attention output,
gate, up, down and the output projection) stored in that type: random blocks (moderate scales,
any values) for the types `gguf` cannot quantize, `gguf`'s own quantization of random weights
for the rest. The float64 numpy forward uses `gguf`'s dequantization of the very blocks in the
file. tests/tests/arch.rs holds wisp to each on the guest's CPU, the CPU reference device, the
native device and wgpu.

    python3 tests/arch/formats.py OUT_DIR TYPE...   # OUT_DIR/tiny-TYPE.gguf, OUT_DIR/tiny-TYPE.json
"""

import pathlib
import sys

import gguf
import numpy as np

import tiny

T = gguf.GGMLQuantizationType
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 256, 4, 2, 512, 2
HEAD_DIM = N_EMBD // N_HEAD
EPS, ROPE_BASE = 1e-5, 10000.0
PRODUCTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# The f16 scale fields of the types written as random blocks: (byte offset, value), chosen so
# that a weight's magnitude is ~0.1 whatever the block's integer scales, and (for the types with
# mins) its mean near 0.
SCALES = {
    T.Q2_K: [(80, 0.004), (82, 0.006)],
    T.Q3_K: [(108, 0.001)],
    T.Q4_K: [(0, 0.0002), (2, 0.0015)],
    T.Q5_K: [(0, 0.0001), (2, 0.00155)],
    T.Q6_K: [(208, 0.00003)],
    T.IQ4_NL: [(0, 0.001)],
    T.IQ4_XS: [(0, 0.00003)],
}


def rng_weights(seed=5):
    mat, norm = tiny.random_weights(seed)
    w = {
        "token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 1.0),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(tiny.N_VOCAB, N_EMBD, 0.1),
    }
    kv = N_HEAD_KV * HEAD_DIM
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_q.weight"] = mat(N_EMBD, N_EMBD, 0.1)
        w[f"blk.{l}.attn_k.weight"] = mat(kv, N_EMBD, 0.1)
        w[f"blk.{l}.attn_v.weight"] = mat(kv, N_EMBD, 0.1)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, N_EMBD, 0.1)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD, 0.1)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD, 0.1)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF, 0.1)
    return w


def stored(kind, values, rng):
    """`values` ([rows, cols]) as blocks of `kind`, the bytes of each row."""
    rows, cols = values.shape
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if kind in SCALES:
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for at, scale in SCALES[kind]:
            d = (scale * (0.5 + rng.random((rows, cols // block)))).astype(np.float16)
            data[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
        return data.reshape(rows, -1)
    if kind in (T.F32, T.F16):
        return values.astype(np.float32 if kind == T.F32 else np.float16).view(np.uint8)
    if kind == T.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return gguf.quants.quantize(values, kind)


def hparams(w):
    tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)


def forward(w, tokens):
    """Logits after every token, float64: Llama with GGUF's pair rotation."""
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    see = tiny.causal(t)
    x = w["token_embd.weight"][tokens]
    for l in range(N_LAYER):
        h = tiny.rms_norm(x, w[f"blk.{l}.attn_norm.weight"], EPS)
        q = tiny.rope_pairs(h @ w[f"blk.{l}.attn_q.weight"].T, pos, HEAD_DIM, ROPE_BASE)
        k = tiny.rope_pairs(h @ w[f"blk.{l}.attn_k.weight"].T, pos, HEAD_DIM, ROPE_BASE)
        v = h @ w[f"blk.{l}.attn_v.weight"].T
        x = x + tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see) @ w[f"blk.{l}.attn_output.weight"].T
        h = tiny.rms_norm(x, w[f"blk.{l}.ffn_norm.weight"], EPS)
        gate, up = h @ w[f"blk.{l}.ffn_gate.weight"].T, h @ w[f"blk.{l}.ffn_up.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T
    return tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w["output.weight"].T


def main(out, kinds):
    out.mkdir(parents=True, exist_ok=True)
    for name in kinds:
        kind = T[name]
        rng = np.random.default_rng(int(kind))
        weights = rng_weights()
        products = [n for n in weights if n == "output.weight" or any(f".{p}." in n for p in PRODUCTS)]
        blocks = {n: (kind, stored(kind, weights[n], rng)) for n in products}
        model = out / f"tiny-{name}.gguf"
        exact = tiny.write_gguf(model, "llama", weights, (), hparams, blocks)
        # The same weights with each block of 32 of every product read backwards: the logits
        # a reading in the wrong order would give.
        flipped = dict(exact)
        for n in products:
            flipped[n] = exact[n].reshape(-1, 32)[:, ::-1].reshape(exact[n].shape)
        misread = tiny.rmse(forward(flipped, tiny.PROMPT)[-1], forward(exact, tiny.PROMPT)[-1])
        tiny.golden(out, f"tiny-{name}", "llama", model, lambda t: forward(exact, t), {"type": name, "misread_effect_rmse": misread})


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
