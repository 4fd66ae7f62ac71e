"""Writes a GGUF file with every tensor of another dequantized to F32, its metadata kept (the
file type set to all-F32): the same model, past wasm32's 4 GiB where the original is a 1.5B.

    python3 tests/f32/make.py IN.gguf OUT.gguf

The tensors are written one at a time (the output is never held in memory whole), to OUT's
name with `.tmp` added, which is renamed to OUT once complete. Needs the `gguf` package (pip).
"""

import os
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main(src: str, dst: str) -> None:
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    w = GGUFWriter(tmp, arch)
    for key, field in r.fields.items():
        # The writer writes the header's own keys and the architecture itself.
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            w.add_key_value(key, 0, GGUFValueType.UINT32)  # LLAMA_FTYPE_ALL_F32
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), kind, sub)
    shapes = []
    for t in r.tensors:
        # GGUF lists dimensions innermost first; numpy's shape is the reverse.
        shape = [int(d) for d in reversed(t.shape.tolist())]
        shapes.append(shape)
        n = int(np.prod(shape))
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * n, raw_dtype=GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, shape in zip(r.tensors, shapes):
        values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        w.write_tensor_data(values)
        print(f"{t.name}: {t.tensor_type.name} -> F32 {shape}", file=sys.stderr)
    w.close()
    os.replace(tmp, dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
