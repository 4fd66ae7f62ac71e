"""Tiny Llama-architecture GGUFs that carry a byte-level BPE vocabulary under any
`tokenizer.ggml.pre`: a one-layer random body (seeded), `tokenizer.ggml.model = "gpt2"`, and

- a real vocabulary: the tokens, token types and merges of a cached file (Qwen2.5-Coder-0.5B's,
  151936 tokens), so that llama.cpp and wisp are held to each other on real merges whatever
  family the name belongs to; or
- `substrings`: every substring of up to MAX_LEN bytes of the corpus (tests/pretok/corpus.json)
  a token, and every way of joining two of them into a third a merge. BPE then makes each word
  of up to MAX_LEN bytes one token, so the ids spell out where the pre-tokenizer cut. A real
  vocabulary's merges never cross the cuts its own pre-tokenizer makes, so under another
  pre-tokenizer it often gives the same ids for different cuts (Qwen's digits are one a token,
  whatever the grouping).

    python3 tests/pretok/vocab.py VOCAB.gguf OUT_DIR PRE...   # OUT_DIR/<PRE>.gguf for each PRE
    python3 tests/pretok/vocab.py substrings OUT_DIR PRE...
"""

import json
import pathlib
import sys

import gguf
import numpy as np

N_EMBD, N_HEAD, N_FF, N_LAYER = 32, 1, 64, 1
MAX_LEN = 20
# A user-defined token (cut out of any text, special tokens parsed or not) and a control token.
SEPARATOR, END = "<tool_call>", "<|endoftext|>"


def field(r, key):
    f = r.fields[key]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]


def read_vocab(path):
    """The tokens, token types, merges and end-of-text id of the file at `path`."""
    r = gguf.GGUFReader(str(path))
    assert field(r, "tokenizer.ggml.model") == "gpt2", "a byte-level BPE vocabulary is needed"
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    eos = field(r, "tokenizer.ggml.eos_token_id")
    return tokens, types, merges, eos


def byte_chars():
    """GPT-2's reversible map from bytes to printable characters."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def substring_vocab():
    """The `substrings` vocabulary of the corpus (see the module comment)."""
    texts = json.loads((pathlib.Path(__file__).parent / "corpus.json").read_text())
    chars = byte_chars()
    subs = set()
    for t in texts:
        s = "".join(chars[b] for b in t.encode("utf-8"))
        for i in range(len(s)):
            for k in range(2, min(MAX_LEN, len(s) - i) + 1):
                subs.add(s[i : i + k])
    longer = sorted(subs, key=lambda s: (len(s), s))
    tokens = [chars[b] for b in range(256)] + longer + [SEPARATOR, END]
    types = [1] * (len(tokens) - 2) + [4, 3]
    merges = [f"{s[:i]} {s[i:]}" for s in longer for i in range(1, len(s))]
    return tokens, types, merges, len(tokens) - 1


def weights(n_vocab, seed=5):
    r = np.random.default_rng(seed)
    mat = lambda rows, cols: (r.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    w = {
        "token_embd.weight": mat(n_vocab, N_EMBD).astype(np.float16),
        "output_norm.weight": np.ones(N_EMBD, np.float32),
    }
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = np.ones(N_EMBD, np.float32)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w[f"blk.{l}.{name}.weight"] = mat(N_EMBD, N_EMBD)
        w[f"blk.{l}.ffn_norm.weight"] = np.ones(N_EMBD, np.float32)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    return w


def write(path, vocab, pre, w):
    tokens, types, merges, eos = vocab
    g = gguf.GGUFWriter(str(path), "llama")
    g.add_name(f"tiny llama, pre-tokenizer {pre}")
    g.add_context_length(256)
    g.add_embedding_length(N_EMBD)
    g.add_feed_forward_length(N_FF)
    g.add_block_count(N_LAYER)
    g.add_head_count(N_HEAD)
    g.add_head_count_kv(N_HEAD)
    g.add_layer_norm_rms_eps(1e-6)
    g.add_rope_freq_base(10000.0)
    g.add_tokenizer_model("gpt2")
    g.add_tokenizer_pre(pre)
    g.add_token_list(tokens)
    g.add_token_types(types)
    g.add_token_merges(merges)
    g.add_bos_token_id(eos)
    g.add_eos_token_id(eos)
    for name, values in w.items():
        g.add_tensor(name, values)
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


def main():
    src, out, pres = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    vocab = substring_vocab() if str(src) == "substrings" else read_vocab(src)
    w = weights(len(vocab[0]))
    for pre in pres:
        write(out / f"{pre}.gguf", vocab, pre, w)


if __name__ == "__main__":
    main()
