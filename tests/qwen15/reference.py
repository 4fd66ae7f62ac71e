"""The references the real Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, `wisp fetch
qwen2.5-coder-1.5b`) is held to:

- Tokens: Hugging Face's `tokenizers` built from the file's vocabulary and merges with Qwen2's own
  pre-tokenizer (its tokenizer.json's split pattern, then byte-level), control tokens special.
- Logits: a float64 numpy forward of Qwen2 (q/k/v biases, NEOX rotation, grouped-query
  attention) over the `gguf` package's dequantization of every tensor, with a cache of keys and
  values (the prompt in one pass, then one token a step); the weights kept as float32 (exact for
  every value the file holds) and widened to float64 for each product, so that the 1.5B
  parameters take 7 GiB, not 14. For each case: the greedy continuation and, after every step,
  the top 5 and the margin, in wisp's golden format; all the logits after the prompt.

    python3 tests/qwen15/reference.py MODEL.gguf OUT_DIR   # OUT_DIR/qwen15.json, OUT_DIR/logits/
"""

import json
import pathlib
import sys

import gguf
import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# Qwen2's pre-tokenizer (tokenizer.json of the Qwen2.5 models).
SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CASES = {
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "chat": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a Python one-liner that reverses a string s.<|im_end|>\n<|im_start|>assistant\n",
}
STEPS = 8


def field(r, key):
    f = r.fields[key]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]


def tokenizer(r):
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    f = r.fields["tokenizer.ggml.merges"]
    merges = [tuple(bytes(f.parts[i]).decode().split(" ", 1)) for i in f.data]
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])
    return tok


class Model:
    def __init__(self, r):
        a = "qwen2"
        self.n_layer = field(r, f"{a}.block_count")
        self.n_head = field(r, f"{a}.attention.head_count")
        self.n_kv = field(r, f"{a}.attention.head_count_kv")
        self.hd = field(r, f"{a}.embedding_length") // self.n_head
        self.eps = field(r, f"{a}.attention.layer_norm_rms_epsilon")
        self.base = field(r, f"{a}.rope.freq_base")
        self.w = {}
        for t in r.tensors:
            shape = [int(d) for d in reversed(t.shape)]
            self.w[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])
        self.k = [np.zeros((0, self.n_kv, self.hd)) for _ in range(self.n_layer)]
        self.v = [np.zeros((0, self.n_kv, self.hd)) for _ in range(self.n_layer)]

    def mm(self, x, name):
        return x @ self.w[name].astype(np.float64).T

    def norm(self, x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name].astype(np.float64)

    def rope(self, x, pos):
        half = self.hd // 2
        freq = self.base ** (-2.0 * np.arange(half) / self.hd)
        ang = pos[:, None] * freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def forward(self, tokens):
        """Logits after each of `tokens`, which follow the ones already seen."""
        t, past = len(tokens), self.k[0].shape[0]
        pos = np.arange(past, past + t, dtype=np.float64)
        x = self.w["token_embd.weight"][tokens].astype(np.float64)
        see = np.arange(past + t)[None, :] <= pos[:, None]
        for l in range(self.n_layer):
            p = lambda n: f"blk.{l}.{n}"
            h = self.norm(x, p("attn_norm.weight"))
            q = (self.mm(h, p("attn_q.weight")) + self.w[p("attn_q.bias")]).reshape(t, self.n_head, self.hd)
            k = (self.mm(h, p("attn_k.weight")) + self.w[p("attn_k.bias")]).reshape(t, self.n_kv, self.hd)
            v = (self.mm(h, p("attn_v.weight")) + self.w[p("attn_v.bias")]).reshape(t, self.n_kv, self.hd)
            self.k[l] = np.concatenate([self.k[l], self.rope(k, pos)])
            self.v[l] = np.concatenate([self.v[l], v])
            q = self.rope(q, pos)
            out = np.zeros_like(q)
            for hh in range(self.n_head):
                g = hh // (self.n_head // self.n_kv)
                s = np.where(see, q[:, hh] @ self.k[l][:, g].T / np.sqrt(self.hd), -np.inf)
                e = np.exp(s - s.max(-1, keepdims=True))
                out[:, hh] = (e / e.sum(-1, keepdims=True)) @ self.v[l][:, g]
            x = x + self.mm(out.reshape(t, -1), p("attn_output.weight"))
            h = self.norm(x, p("ffn_norm.weight"))
            gate, up = self.mm(h, p("ffn_gate.weight")), self.mm(h, p("ffn_up.weight"))
            x = x + self.mm(gate / (1.0 + np.exp(-gate)) * up, p("ffn_down.weight"))
        return self.norm(x, "output_norm.weight") @ self.head.astype(np.float64).T

    def reset(self):
        self.k = [k[:0] for k in self.k]
        self.v = [v[:0] for v in self.v]


def main(model, out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "logits").mkdir(exist_ok=True)
    r = gguf.GGUFReader(str(model))
    tok = tokenizer(r)
    m = Model(r)
    cases = []
    for name, text in CASES.items():
        prompt = tok.encode(text).ids
        m.reset()
        rows = [m.forward(prompt)[-1]]
        rows[0].astype("<f4").tofile(out / "logits" / f"{name}.logits.f32")
        continuation = []
        for _ in range(STEPS):
            continuation.append(int(np.argmax(rows[-1])))
            rows.append(m.forward([continuation[-1]])[-1])
        steps = []
        for row in rows[:-1]:
            top = np.argsort(-row, kind="stable")[:5]
            steps.append({"top5": [[int(i), float(row[i])] for i in top], "margin": float(row[top[0]] - row[top[1]])})
        cases.append({"name": name, "prompt": text, "prompt_tokens": prompt, "continuation": continuation, "steps": steps,
                      "continuation_text": tok.decode(continuation)})
    (out / "qwen15.json").write_text(json.dumps({
        "architecture": "qwen2",
        "reference": "float64 numpy forward of tests/qwen15/reference.py over gguf's dequantized weights",
        "cases": cases,
    }))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
