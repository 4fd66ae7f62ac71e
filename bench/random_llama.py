"""Writes a random-weight GGUF of Llama-3.1-8B's shape in Q4_K_M's mix of block types, for
trying a model past wasm32's 4 GiB where no real one can be fetched (the GPU machine has no
network). The vocabulary and tokenizer are borrowed from another GGUF (any llama-style BPE or
SentencePiece one: Qwen2.5's, Gemma's), so the embedding and output have its vocabulary's rows.

    python3 bench/random_llama.py TOKENIZER.gguf OUT.gguf [--layers 32]

The blocks are written as such (random 4- and 6-bit values, scales that keep each weight
within about 0.1), not quantized from floats: the same types and sizes llama.cpp's Q4_K_M
gives (Q6_K for the output and for `attn_v` and `ffn_down` of the first and last eighth of
the layers and every third between, Q4_K for the rest), without a 16 GB F16 file first.
Tensors are written one at a time; needs numpy and the `gguf` package (pip).
"""

import argparse
import os

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

EMBD, FF, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
# Bytes of a 256-value block, and where its f16 scales lie.
BLOCK = {Q.Q4_K: 144, Q.Q6_K: 210}


def blocks(rng: np.random.Generator, kind: Q, rows: int, cols: int) -> np.ndarray:
    """`rows` rows of `cols` values of `kind`, as GGUF stores them: `[rows, bytes a row]`."""
    n = rows * cols // 256
    b = rng.integers(0, 256, size=(n, BLOCK[kind]), dtype=np.uint8)
    small = np.frombuffer(np.float16(1e-4).tobytes(), dtype=np.uint8)
    if kind == Q.Q4_K:
        # d and dmin (f16) first, then 12 bytes of 6-bit sub-block scales and mins, then nibbles.
        b[:, 0:2] = small
        b[:, 2:4] = small
    else:
        # ql, qh, then 16 int8 sub-block scales, then d (f16): scales within +-31.
        b[:, 192:208] = (b[:, 192:208].view(np.int8) >> 2).view(np.uint8)
        b[:, 208:210] = small
    return b.reshape(rows, cols // 256 * BLOCK[kind])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer", help="a GGUF whose tokenizer.* metadata is borrowed")
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    r = GGUFReader(a.tokenizer)
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    tmp = a.out + ".tmp"
    w = GGUFWriter(tmp, "llama")
    w.add_name("random Llama-3.1-8B shape, Q4_K_M block types")
    w.add_uint32("general.file_type", 15)  # MOSTLY_Q4_K_M
    w.add_context_length(8192)
    w.add_embedding_length(EMBD)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    for key, field in r.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub)

    n = a.layers

    def more_bits(i: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    tensors = [("token_embd.weight", Q.Q4_K, vocab, EMBD)]
    for i in range(n):
        q6 = Q.Q6_K if more_bits(i) else Q.Q4_K
        tensors += [
            (f"blk.{i}.attn_norm.weight", Q.F32, 1, EMBD),
            (f"blk.{i}.attn_q.weight", Q.Q4_K, HEADS * HEAD_DIM, EMBD),
            (f"blk.{i}.attn_k.weight", Q.Q4_K, KV_HEADS * HEAD_DIM, EMBD),
            (f"blk.{i}.attn_v.weight", q6, KV_HEADS * HEAD_DIM, EMBD),
            (f"blk.{i}.attn_output.weight", Q.Q4_K, EMBD, HEADS * HEAD_DIM),
            (f"blk.{i}.ffn_norm.weight", Q.F32, 1, EMBD),
            (f"blk.{i}.ffn_gate.weight", Q.Q4_K, FF, EMBD),
            (f"blk.{i}.ffn_up.weight", Q.Q4_K, FF, EMBD),
            (f"blk.{i}.ffn_down.weight", q6, EMBD, FF),
        ]
    tensors += [("output_norm.weight", Q.F32, 1, EMBD), ("output.weight", Q.Q6_K, vocab, EMBD)]
    for name, kind, rows, cols in tensors:
        if kind == Q.F32:
            w.add_tensor_info(name, [cols], np.dtype(np.float32), 4 * cols)
        else:
            w.add_tensor_info(name, [rows, cols // 256 * BLOCK[kind]], np.dtype(np.uint8), rows * cols // 256 * BLOCK[kind], raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(8)
    for name, kind, rows, cols in tensors:
        w.write_tensor_data(np.ones(cols, dtype=np.float32) if kind == Q.F32 else blocks(rng, kind, rows, cols))
    w.close()
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
