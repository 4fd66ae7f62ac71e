#!/usr/bin/env python3
"""Writes the `gguf` target's seeds: complete models small enough to load in well under a
millisecond (a 1-layer Gemma 3, Qwen 2 and Llama of width 32, a 16-token vocabulary, f32,
Q8_0 and Q4_0 weights), so that the fuzzer mutates kilobytes rather than the real model's
hundreds of megabytes.

    python3 fuzz/seeds/gguf.py fuzz/corpus/gguf
"""
import random
import struct
import sys
from pathlib import Path

N_EMBD, N_FF, HEAD_DIM, N_CTX = 32, 32, 16, 16
N_HEAD, N_HEAD_KV = 2, 1
F32, Q4_0, Q8_0 = 0, 2, 8


def string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, value):
    out = string(key)
    if isinstance(value, bool):
        return out + struct.pack("<IB", 7, value)
    if isinstance(value, int):
        return out + struct.pack("<II", 4, value)
    if isinstance(value, float):
        return out + struct.pack("<If", 6, value)
    if isinstance(value, str):
        return out + struct.pack("<I", 8) + string(value)
    kind, items = value
    out += struct.pack("<IIQ", 9, {"str": 8, "f32": 6, "i32": 5}[kind], len(items))
    for x in items:
        out += string(x) if kind == "str" else struct.pack("<f" if kind == "f32" else "<i", x)
    return out


def f16(x):
    return struct.pack("<e", x)


def tensor_bytes(kind, n, rng):
    if kind == F32:
        return b"".join(struct.pack("<f", rng.uniform(-0.1, 0.1)) for _ in range(n))
    if kind == Q8_0:
        return b"".join(f16(0.01) + bytes(rng.randrange(256) for _ in range(32)) for _ in range(n // 32))
    return b"".join(f16(0.01) + bytes(rng.randrange(256) for _ in range(16)) for _ in range(n // 32))


def model(arch, bpe):
    rng = random.Random(arch)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", "\u2581a", "he", "ll", "o", "h", "e", "l", "w", "or", "ld", "!"]
    types = [3, 3, 3, 2] + [1] * (len(tokens) - 4)
    if bpe:
        tokens[4:6] = ["\u0120", "\u0120a"]
    meta = [
        ("general.architecture", arch),
        (f"{arch}.context_length", N_CTX),
        (f"{arch}.embedding_length", N_EMBD),
        (f"{arch}.block_count", 1),
        (f"{arch}.feed_forward_length", N_FF),
        (f"{arch}.attention.head_count", N_HEAD),
        (f"{arch}.attention.head_count_kv", N_HEAD_KV),
        (f"{arch}.attention.key_length", HEAD_DIM),
        (f"{arch}.attention.value_length", HEAD_DIM),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        (f"{arch}.rope.freq_base", 10000.0),
        ("tokenizer.ggml.model", "gpt2" if bpe else "llama"),
        ("tokenizer.ggml.tokens", ("str", tokens)),
        ("tokenizer.ggml.scores", ("f32", [-float(i) for i in range(len(tokens))])),
        ("tokenizer.ggml.token_type", ("i32", types)),
        ("tokenizer.ggml.bos_token_id", 2),
        ("tokenizer.ggml.eos_token_id", 1),
    ]
    if arch == "gemma3":
        meta.append(("gemma3.attention.sliding_window", 8))
    if bpe:
        meta += [("tokenizer.ggml.pre", "qwen2"), ("tokenizer.ggml.merges", ("str", ["h e", "l l", "o r"]))]
    nq, nkv = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    tensors = [("token_embd.weight", [N_EMBD, len(tokens)], F32)]
    blk = lambda s: f"blk.0.{s}"
    tensors += [
        (blk("attn_norm.weight"), [N_EMBD], F32),
        (blk("attn_q.weight"), [N_EMBD, nq], Q8_0),
        (blk("attn_k.weight"), [N_EMBD, nkv], Q4_0),
        (blk("attn_v.weight"), [N_EMBD, nkv], F32),
        (blk("attn_output.weight"), [nq, N_EMBD], Q8_0),
        (blk("ffn_norm.weight"), [N_EMBD], F32),
        (blk("ffn_gate.weight"), [N_EMBD, N_FF], Q4_0),
        (blk("ffn_up.weight"), [N_EMBD, N_FF], Q8_0),
        (blk("ffn_down.weight"), [N_FF, N_EMBD], F32),
        ("output_norm.weight", [N_EMBD], F32),
    ]
    if arch == "gemma3":
        tensors += [(blk(f"{t}.weight"), [n], F32) for t, n in
                    [("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM), ("post_attention_norm", N_EMBD),
                     ("post_ffw_norm", N_EMBD)]]
    else:
        tensors += [(blk(f"{t}.bias"), [n], F32) for t, n in [("attn_q", nq), ("attn_k", nkv), ("attn_v", nkv)]]
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(kv(k, v) for k, v in meta)
    infos, data = b"", b""
    for name, dims, kind in tensors:
        n = 1
        for d in dims:
            n *= d
        infos += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", kind, len(data))
        data += tensor_bytes(kind, n, rng)
        data += b"\0" * (-len(data) % 32)
    head = header + infos
    return head + b"\0" * (-len(head) % 32) + data


out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for arch, bpe in [("gemma3", False), ("qwen2", True), ("llama", True)]:
    (out / f"micro-{arch}.gguf").write_bytes(model(arch, bpe))
