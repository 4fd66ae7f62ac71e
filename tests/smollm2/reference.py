"""The references a real Llama-architecture file is held to: SmolLM2-135M-Instruct, GGUF Q4_1
(`tokenizer.ggml.pre = "smollm"`), as `wisp fetch smollm2-135m` caches it.

- Tokens: Hugging Face's `tokenizers` built from the file's vocabulary and merges with SmolLM2's
  own pre-tokenizer (every digit alone, then GPT-2's byte-level pattern), for TEXTS.
- Logits: a float64 numpy forward of the Llama block (Llama's GGUF rotation: adjacent pairs),
  every weight as the `gguf` package dequantizes it (Q4_1 and Q8_0 blocks, f32 norms), for a
  prompt and its greedy continuation, in wisp's golden format.

    python3 tests/smollm2/reference.py MODEL.gguf OUT_DIR   # OUT_DIR/tokens.json, OUT_DIR/smollm2.json
"""

import json
import pathlib
import sys

import gguf
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

# Digits, contractions, spaces before numbers and words, line breaks, runs of spaces, Unicode
# letters and numbers, punctuation runs: what the `smollm` split and the merges meet.
TEXTS = [
    "The capital of France is",
    "In 2024, it's 3.14159 and 1,000,000 dollars!",
    "def f(x):\n    return x**2  # square\n\n\nprint(f(12))",
    "Größe: 大小 — naïve café, ٣٤٥ and Ⅻ   spaces\t\ttabs",
    "I'm sure you'll see they've won't  'quoted' DON'T",
    "<|im_start|>user\nHello!<|im_end|>",
]
PROMPT = "Gravity is a force that"
STEPS = 8


def field(r, key):
    f = r.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]


def tokenizer(r):
    """SmolLM2's tokenizer as Hugging Face defines it (tokenizer.json), from the file's vocabulary."""
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    f = r.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(f.parts[i]).decode().split(" ", 1)) for i in f.data]
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) are special: matched whole in text, as wisp's parse_special does.
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])
    return tok


def weights(r):
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(d) for d in reversed(t.shape)]) for t in r.tensors}


def forward(w, hp, tokens):
    """Logits after every token, float64: Llama with GGUF's pair rotation."""
    n_head, n_kv, hd, eps, base = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["eps"], hp["base"]
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    freq = base ** (-2.0 * np.arange(hd // 2) / hd)
    ang = pos[:, None] * freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):
        h = x.reshape(t, -1, hd // 2, 2)
        a, b = h[..., 0], h[..., 1]
        return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    see = np.tril(np.ones((t, t), dtype=bool))
    x = w["token_embd.weight"][tokens]
    for l in range(hp["n_layer"]):
        p = lambda n: w[f"blk.{l}.{n}.weight"]
        h = norm(x, p("attn_norm"))
        q = rope(h @ p("attn_q").T).reshape(t, n_head, hd)
        k = rope(h @ p("attn_k").T).reshape(t, n_kv, hd)
        v = (h @ p("attn_v").T).reshape(t, n_kv, hd)
        out = np.zeros_like(q)
        for hh in range(n_head):
            g = hh // (n_head // n_kv)
            s = np.where(see, q[:, hh] @ k[:, g].T / np.sqrt(hd), -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (e / e.sum(-1, keepdims=True)) @ v[:, g]
        x = x + out.reshape(t, -1) @ p("attn_output").T
        h = norm(x, p("ffn_norm"))
        gate, up = h @ p("ffn_gate").T, h @ p("ffn_up").T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ p("ffn_down").T
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]) @ head.T


def main(model, out):
    out.mkdir(parents=True, exist_ok=True)
    r = gguf.GGUFReader(str(model))
    tok = tokenizer(r)
    (out / "tokens.json").write_text(json.dumps([{"text": s, "ids": tok.encode(s).ids} for s in TEXTS]))
    hp = {
        "n_layer": field(r, "llama.block_count"),
        "n_head": field(r, "llama.attention.head_count"),
        "n_head_kv": field(r, "llama.attention.head_count_kv"),
        "head_dim": field(r, "llama.embedding_length") // field(r, "llama.attention.head_count"),
        "eps": field(r, "llama.attention.layer_norm_rms_epsilon"),
        "base": field(r, "llama.rope.freq_base"),
    }
    w = weights(r)
    prompt = tok.encode(PROMPT).ids
    tokens = list(prompt)
    for _ in range(STEPS):
        tokens.append(int(np.argmax(forward(w, hp, tokens)[-1])))
    logits = forward(w, hp, tokens)[len(prompt) - 1 : -1]
    steps = []
    for row in logits:
        top = np.argsort(-row, kind="stable")[:5]
        steps.append({"top5": [[int(i), float(row[i])] for i in top], "margin": float(row[top[0]] - row[top[1]])})
    (out / "logits").mkdir(exist_ok=True)
    logits[0].astype("<f4").tofile(out / "logits" / "gravity.logits.f32")
    case = {"name": "gravity", "prompt": PROMPT, "prompt_tokens": prompt, "continuation": tokens[len(prompt) :], "steps": steps}
    (out / "smollm2.json").write_text(json.dumps({
        "architecture": "llama",
        "reference": "float64 numpy forward of tests/smollm2/reference.py over gguf's dequantized weights",
        "continuation_text": tok.decode(tokens[len(prompt) :]),
        "cases": [case],
    }))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
