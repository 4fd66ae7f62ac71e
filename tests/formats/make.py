"""Blocks of every GGUF tensor type wisp reads, and the `gguf` package's own dequantization of
them: `formats.gguf`, for each type T a tensor named T (random blocks of T) and one named
`T.f32` (what `gguf.quants.dequantize` makes of them). The guest's unit test
`quant::tests::dequantize_is_ggufs_bit_for_bit` holds wisp's reading of every block to it, bit
for bit; tests/tests/formats.rs runs this script again and checks it writes the same bytes.

Most blocks have moderate finite scales; each type's last block is random bytes through and
through (its scales may be infinite or NaN: a NaN must read as a NaN).

    python3 tests/formats/make.py OUT.gguf
"""

import sys

import gguf
import numpy as np

T = gguf.GGMLQuantizationType

# The byte offsets of each type's f16 scale fields within a block.
SCALES = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}
FLOATS = [T.F32, T.F16, T.BF16]


def blocks(rng, kind, n_blocks):
    """`n_blocks` random blocks of `kind`, as bytes (uint8, one row per block)."""
    size = gguf.GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in SCALES[kind]:
        scale = (rng.standard_normal(n_blocks - 1) * 0.02).astype(np.float16)
        raw[:-1, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw


def main(out):
    rng = np.random.default_rng(20261206)
    w = gguf.GGUFWriter(out, "formats")
    for kind in FLOATS + list(SCALES):
        block, size = gguf.GGML_QUANT_SIZES[kind]
        if kind in FLOATS:
            # Values of every magnitude, and raw bits (infinities, NaNs, subnormals) last.
            n = 512
            values = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n))).astype(np.float32)
            raw = values.view(np.uint8).reshape(n, 4)
            if kind == T.F16:
                with np.errstate(over="ignore"):
                    raw = values.astype(np.float16).view(np.uint8).reshape(n, 2)
            elif kind == T.BF16:
                raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, 2)
            raw[-64:] = rng.integers(0, 256, size=raw[-64:].shape, dtype=np.uint8)
        else:
            raw = blocks(rng, kind, max(8, 2048 // block // 4))
        n = raw.shape[0] * block
        data = raw.reshape(1, -1)
        with np.errstate(invalid="ignore", over="ignore"):
            exact = gguf.quants.dequantize(data, kind).astype(np.float32).reshape(n)
        w.add_tensor(kind.name, data, raw_shape=data.shape, raw_dtype=kind)
        w.add_tensor(f"{kind.name}.f32", exact)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1])
