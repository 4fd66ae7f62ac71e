"""Records what llama.cpp's `llama-tokenize` makes of the corpus under every `tokenizer.ggml.pre`
its vocabulary loader knows (the names in its src/llama-vocab.cpp), each on the same real
vocabulary (tests/pretok/vocab.py): tests/pretok/ids.json, which tests/tests/pretok.rs holds wisp
to, on a real vocabulary and on the `substrings` one, whose ids spell out each cut. The suite
does not build llama.cpp; this script is run by hand against a build of it.

    python3 tests/pretok/record.py LLAMA_CPP_DIR BIN_DIR VOCAB.gguf

The texts go to `llama-tokenize -f` from a file of their exact bytes, with `--no-escape` (a
backslash stays one), `--no-bos` (no BOS or EOS) and `--no-parse-special` (the tool parses
special tokens by default): wisp's `tokenize(text, add_special = false, parse_special = false)`.
One run a name takes them all, joined by `<tool_call>`: a user-defined token of the vocabulary,
which llama.cpp cuts out of the text before the pre-tokenizer sees it even where special tokens
are not parsed, so that each text is tokenized alone. For the names in CHECK every text is also
run alone, and the two must agree.
"""

import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import vocab

HERE = pathlib.Path(__file__).parent

# Names llama.cpp knows whose vocabularies are not GPT-2 byte-level BPE: their tokens are raw
# UTF-8 with U+2581 for a space (or whole whitespace-free runs), so a byte-level vocabulary
# under them tokenizes nothing like the real thing.
NOT_BYTE_LEVEL = {
    "gemma4": "raw UTF-8 pieces, spaces escaped as U+2581 (byte_encode = false)",
    "granite-embed-multi-311m": "Gemma 4's type: raw UTF-8 pieces, spaces as U+2581",
    "sarvam-moe": "raw UTF-8 pieces, spaces escaped as U+2581 (byte_encode = false)",
    "whitespace": "raw UTF-8 whitespace-free runs (byte_encode = false)",
}

# Names wisp does not implement yet, and why; recorded nowhere, so that the test holds wisp to
# every name in ids.json.
NOT_IMPLEMENTED = {}


def names(llama_cpp):
    """The pre-tokenizer names in llama.cpp's loader, in its order, `default` first."""
    src = (pathlib.Path(llama_cpp) / "src/llama-vocab.cpp").read_text()
    out = []
    for n in re.findall(r'tokenizer_pre == "([^"]+)"', src):
        if n not in out:
            out.append(n)
    return out


def tokenize(tool, model, path):
    env = dict(os.environ, LD_LIBRARY_PATH=str(pathlib.Path(tool).parent))
    args = [tool, "-m", model, "-f", path, "--ids", "--log-disable", "--no-bos", "--no-escape", "--no-parse-special"]
    r = subprocess.run(args, capture_output=True, env=env)
    if r.returncode != 0:
        return None, r.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return json.loads(r.stdout.decode().strip().splitlines()[-1]), None


SEPARATOR = vocab.SEPARATOR
CHECK = ["qwen2", "gpt-2", "tekken", "deepseek-llm", "bloom"]


def tokenize_all(tool, model, path, sep_id):
    """The ids of each text of the joined file at `path`."""
    ids, err = tokenize(tool, model, path)
    if err is not None:
        return None, err
    out = [[]]
    for i in ids:
        if i == sep_id:
            out.append([])
        else:
            out[-1].append(i)
    return out, None


def record(name_list, tool, voc, texts, tmp, left_out):
    """`{pre: ids of each text}` under vocabulary `voc` for every name llama.cpp loads."""
    files = []
    for i, t in enumerate(texts):
        p = tmp / f"text{i}.txt"
        p.write_bytes(t.encode("utf-8"))
        files.append(str(p))
    assert not any(SEPARATOR in t for t in texts)
    joined = tmp / "joined.txt"
    joined.write_bytes(SEPARATOR.join(texts).encode("utf-8"))
    sep_id = voc[0].index(SEPARATOR)
    assert voc[1][sep_id] == 4, "the separator must be a user-defined token"
    w = vocab.weights(len(voc[0]))
    out = {}
    for name in name_list:
        if name in NOT_BYTE_LEVEL:
            left_out[name] = NOT_BYTE_LEVEL[name]
            continue
        if name in NOT_IMPLEMENTED:
            left_out[name] = "not implemented in wisp: " + NOT_IMPLEMENTED[name]
            continue
        model = tmp / "model.gguf"
        vocab.write(model, voc, name, w)
        ids, err = tokenize_all(tool, str(model), str(joined), sep_id)
        if err is not None:
            left_out[name] = f"llama.cpp fails: {err}"
            print(name, err, file=sys.stderr, flush=True)
            continue
        assert len(ids) == len(texts)
        if name in CHECK:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                alone = list(pool.map(lambda f: tokenize(tool, str(model), f)[0], files))
            assert alone == ids, f"{name}: the joined run differs from the texts run alone"
        out[name] = ids
        print(name, "ok", file=sys.stderr, flush=True)
    return out


def main():
    llama_cpp, bin_dir, src = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
    tool = str(bin_dir / "llama-tokenize")
    texts = json.loads((HERE / "corpus.json").read_text())
    all_names = names(llama_cpp)
    result = {"llama_cpp": pathlib.Path(llama_cpp).name, "texts": texts, "left_out": {}, "vocabs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        sha = hashlib.sha256(src.read_bytes()).hexdigest()
        real = record(all_names, tool, vocab.read_vocab(src), texts, tmp, result["left_out"])
        result["vocabs"]["real"] = {"file": src.name, "sha256": sha, "pre": real}
        subs = record(all_names, tool, vocab.substring_vocab(), texts, tmp, result["left_out"])
        result["vocabs"]["substrings"] = {"max_len": vocab.MAX_LEN, "pre": subs}
    with open(HERE / "ids.json", "w") as f:
        # One line a text, for readable diffs.
        f.write("{\n")
        for k in ("llama_cpp", "texts", "left_out"):
            f.write(f"{json.dumps(k)}: {json.dumps(result[k], ensure_ascii=False)},\n")
        f.write('"vocabs": {\n')
        for i, (vname, v) in enumerate(result["vocabs"].items()):
            head = {k: x for k, x in v.items() if k != "pre"}
            f.write(f"{json.dumps(vname)}: {json.dumps(head)[:-1]}, \"pre\": {{\n")
            for j, (pre, ids) in enumerate(v["pre"].items()):
                f.write(f" {json.dumps(pre)}: [\n")
                f.write(",\n".join("  " + json.dumps(x, separators=(",", ":")) for x in ids))
                f.write("\n ]" + ("," if j + 1 < len(v["pre"]) else "") + "\n")
            f.write("}}" + ("," if i + 1 < len(result["vocabs"]) else "") + "\n")
        f.write("}\n}\n")
    json.loads((HERE / "ids.json").read_text())


if __name__ == "__main__":
    main()
