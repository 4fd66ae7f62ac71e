"""A copy of a GGUF model with its vocabulary cut to its first V tokens, for timing alone.

    python3 bench/cut_vocab.py IN.gguf OUT.gguf [V=98304]

Gemma 3 270M's tied output projection (262,144 rows of Q8_0, 178 MB) is past lavapipe's 128 MiB
storage binding, so there it stays with the guest, whose CPU product then hides every other
part of a batched step. Cut to 98,304 tokens it is 67 MB and runs on the device: `WISP_TIMES=1
wisp bench --model OUT.gguf --gpu on --parallel 64 --matmul-size 0` then shows the guest's own
share of a step (each program run's "us after the last run's results came back") and the
host's planning. The text it generates means nothing; token ids past V never occur.

Needs the gguf and numpy packages (pip), as the architecture tests do.
"""

import sys

import gguf
import numpy as np


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    keep = int(sys.argv[3]) if len(sys.argv) > 3 else 98304
    r = gguf.GGUFReader(src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    if keep >= vocab:
        sys.exit(f"{src} has {vocab} tokens: nothing to cut")
    w = gguf.GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            values = [field.parts[i] for i in field.data]
            if sub == gguf.GGUFValueType.STRING:
                values = [bytes(v).decode("utf-8", errors="replace") for v in values]
            else:
                values = [v[0].item() for v in values]
            # The tokenizer's per-token arrays; merges (pairs of kept tokens or not) stay.
            if key.startswith("tokenizer.ggml.") and len(values) == vocab:
                values = values[:keep]
            w.add_key_value(key, values, kind, sub_type=sub)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), kind)
        else:
            w.add_key_value(key, field.parts[field.data[0]][0].item(), kind)
    for t in r.tensors:
        data = np.array(t.data)
        # The embedding and an untied output projection: one row a token.
        if t.name in ("token_embd.weight", "output.weight") and int(t.shape[-1]) == vocab:
            data = data[:keep]
        plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(t.name, data, raw_shape=data.shape if plain else None, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{dst}: {keep} of {vocab} tokens")


if __name__ == "__main__":
    main()
