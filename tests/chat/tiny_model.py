"""A tiny random-weight Llama GGUF whose vocabulary holds a family's BOS and EOS texts and which
carries the family's chat template (`tokenizer.chat_template`), for rendering the template
(`bos_token`, `eos_token`) in llama.cpp (tests/chat/record.py) and in wisp
(tests/tests/chat_jinja.rs) alike. The vocabulary does not add BOS or EOS by itself
(`add_bos_token`, `add_eos_token` false): llama.cpp would otherwise strip a leading BOS from the
rendered text.

    python3 tests/chat/tiny_model.py OUT.gguf BOS_TEXT EOS_TEXT TEMPLATE_FILE
"""

import pathlib
import sys

import gguf
import numpy as np

N_VOCAB, N_EMBD, N_HEAD, N_FF = 320, 32, 2, 64


def write(path, bos, eos, template):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny chat-template model")
    w.add_context_length(256)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_block_count(1)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    # <unk>, BOS, EOS (one token where they are the same text), the 256 bytes, then pieces.
    specials = ["<unk>", bos] + ([eos] if eos != bos else [])
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581p{i}" for i in range(N_VOCAB - len(tokens))]
    types = [2] + [3] * (len(specials) - 1) + [6] * 256 + [1] * (N_VOCAB - len(specials) - 256)
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(N_VOCAB)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(tokens.index(eos))
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(template)
    r = np.random.default_rng(5)
    mat = lambda rows, cols: (r.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    ones = lambda n: np.ones(n, dtype=np.float32)
    tensors = {
        "token_embd.weight": mat(N_VOCAB, N_EMBD),
        "output_norm.weight": ones(N_EMBD),
        "output.weight": mat(N_VOCAB, N_EMBD),
        "blk.0.attn_norm.weight": ones(N_EMBD),
        "blk.0.attn_q.weight": mat(N_EMBD, N_EMBD),
        "blk.0.attn_k.weight": mat(N_EMBD, N_EMBD),
        "blk.0.attn_v.weight": mat(N_EMBD, N_EMBD),
        "blk.0.attn_output.weight": mat(N_EMBD, N_EMBD),
        "blk.0.ffn_norm.weight": ones(N_EMBD),
        "blk.0.ffn_gate.weight": mat(N_FF, N_EMBD),
        "blk.0.ffn_up.weight": mat(N_FF, N_EMBD),
        "blk.0.ffn_down.weight": mat(N_EMBD, N_FF),
    }
    for name, values in tensors.items():
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    write(sys.argv[1], sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4]).read_text())
