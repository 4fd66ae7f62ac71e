"""A third architecture, added in guest/ alone: Phi-3 (llama.cpp's `phi3`: fused `attn_qkv` and
`ffn_up`, a sliding window on every layer). Writes a tiny GGUF with random weights with the
`gguf` package, and its golden file: the logits of the float64 numpy forward below (the prompt's
full logits, every step's top 5 of the greedy continuation). tests/tests/arch.rs holds wisp to
them on its CPU path, on wgpu and on the host's CPU reference device.

    python3 tests/arch/phi3.py OUT_DIR   # OUT_DIR/tiny-phi3.gguf, OUT_DIR/tiny-phi3.json
"""

import hashlib
import json
import pathlib
import sys

import gguf
import numpy as np

N_EMBD, N_HEAD, N_HEAD_KV, HEAD_DIM, N_FF, N_LAYER = 64, 4, 2, 16, 96, 3
WINDOW, EPS, ROPE_BASE = 7, 1e-5, 10000.0
# <unk>, <s>, </s>, the 256 bytes, then pieces.
N_VOCAB = 320
PROMPT = [1, 17, 203, 44, 301, 88, 9, 150, 260, 71, 33, 299, 5, 120]
STEPS = 8


def rng_weights(seed=7):
    r = np.random.default_rng(seed)
    nq, nkv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    mat = lambda rows, cols, s=0.15: (r.standard_normal((rows, cols)) * s).astype(np.float32)
    norm = lambda n: (1.0 + 0.1 * r.standard_normal(n)).astype(np.float32)
    w = {
        "token_embd.weight": mat(N_VOCAB, N_EMBD, 1.0),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(N_VOCAB, N_EMBD, 0.2),
    }
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_qkv.weight"] = mat(nq + 2 * nkv, N_EMBD)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, nq)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(2 * N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    return w


# The fused products go as Q8_0 (so that splitting them at load is checked on quantized blocks
# too), the rest as f32.
Q8 = ("attn_qkv", "ffn_up", "ffn_down")


def stored(name, values):
    """The tensor as the file stores it, and its exact values (what wisp computes with)."""
    if any(f".{q}." in name for q in Q8):
        q = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        return q, gguf.GGMLQuantizationType.Q8_0, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    return values, None, values


def write_gguf(path, weights):
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_name("tiny random phi3")
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_block_count(N_LAYER)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(EPS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_sliding_window(WINDOW)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581p{i}" for i in range(N_VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (N_VOCAB - 259)
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(N_VOCAB)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    exact = {}
    for name, values in weights.items():
        data, kind, exact[name] = stored(name, values)
        if kind is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v.astype(np.float64) for k, v in exact.items()}


def rms_norm(x, g):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g


def rope(x, positions):
    """NEOX rotation of each head: pairs (j, j + HEAD_DIM / 2)."""
    half = HEAD_DIM // 2
    freq = ROPE_BASE ** (-2.0 * np.arange(half) / HEAD_DIM)
    ang = positions[:, None] * freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.reshape(len(positions), -1, HEAD_DIM)
    a, b = h[..., :half], h[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)


def forward(w, tokens, window=WINDOW):
    """Logits after every token, float64: the model card's Phi-3 with a window on every layer."""
    t = len(tokens)
    nq, nkv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    pos = np.arange(t, dtype=np.float64)
    x = w["token_embd.weight"][tokens]
    see = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    for l in range(N_LAYER):
        h = rms_norm(x, w[f"blk.{l}.attn_norm.weight"])
        qkv = h @ w[f"blk.{l}.attn_qkv.weight"].T
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
        q, k = rope(q, pos), rope(k, pos)
        q = q.reshape(t, N_HEAD, HEAD_DIM)
        k = k.reshape(t, N_HEAD_KV, HEAD_DIM)
        v = v.reshape(t, N_HEAD_KV, HEAD_DIM)
        out = np.zeros_like(q)
        for hh in range(N_HEAD):
            g = hh // (N_HEAD // N_HEAD_KV)
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(HEAD_DIM)
            s = np.where(see, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh, :] = (p / p.sum(-1, keepdims=True)) @ v[:, g, :]
        x = x + out.reshape(t, nq) @ w[f"blk.{l}.attn_output.weight"].T
        h = rms_norm(x, w[f"blk.{l}.ffn_norm.weight"])
        gu = h @ w[f"blk.{l}.ffn_up.weight"].T
        gate, up = gu[:, :N_FF], gu[:, N_FF:]
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T
    return rms_norm(x, w["output_norm.weight"]) @ w["output.weight"].T


def main(out):
    """The tiny model and its golden file: the prompt, the reference's greedy continuation, the
    top 5 of every step and the full logits after the prompt."""
    out.mkdir(parents=True, exist_ok=True)
    model = out / "tiny-phi3.gguf"
    exact = write_gguf(model, rng_weights())
    tokens = list(PROMPT)
    for _ in range(STEPS):
        tokens.append(int(np.argmax(forward(exact, tokens)[-1])))
    logits = forward(exact, tokens)[len(PROMPT) - 1 : -1]
    steps = []
    for row in logits:
        top = np.argsort(-row, kind="stable")[:5]
        steps.append({"top5": [[int(i), float(row[i])] for i in top], "margin": float(row[top[0]] - row[top[1]])})
    (out / "logits").mkdir(exist_ok=True)
    logits[0].astype("<f4").tofile(out / "logits" / "random.logits.f32")
    # The same prompt without the window: far from the windowed logits, so that matching those
    # shows the window is right, not only the products.
    unwindowed = forward(exact, PROMPT, window=len(PROMPT))[-1]
    case = {"name": "random", "prompt": "", "prompt_tokens": PROMPT, "continuation": tokens[len(PROMPT) :], "steps": steps}
    (out / "tiny-phi3.json").write_text(json.dumps({
        "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "architecture": "phi3",
        "reference": "float64 numpy forward of tests/arch/phi3.py",
        "window_effect_rmse": float(np.sqrt(((unwindowed - logits[0]) ** 2).mean())),
        "cases": [case],
    }))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
