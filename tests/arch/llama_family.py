"""Architectures that are Llama's block with a twist, added as names of the Llama file
(guest/src/models/qwen2.rs): Granite (llama.cpp's `granite`: the embedding, each block's output,
the attention scores and the logits scaled by numbers in the file), SmolLM3 (`smollm3`: no
rotation in every fourth layer) and Mistral 3 (`mistral3`: YaRN's rotation scaling and Llama 4's
attention temperature). Writes a tiny GGUF of each with random weights and its golden file from
the float64 numpy forward below; tests/tests/arch.rs holds wisp to them on every path.

    python3 tests/arch/llama_family.py OUT_DIR ARCH   # ARCH granite, smollm3 or mistral3:
                                                      # OUT_DIR/tiny-ARCH.gguf, OUT_DIR/tiny-ARCH.json
"""

import pathlib
import sys

import gguf
import numpy as np

import tiny

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER = 64, 4, 2, 96, 4
HEAD_DIM = N_EMBD // N_HEAD
EPS, ROPE_BASE = 1e-5, 10000.0
# Granite's multipliers, far from 1 (the released models': 12, 0.22, 8, 0.0078125).
GRANITE = {"embedding": 6.0, "residual": 0.4, "logits": 0.5, "attention": 0.05}
# Mistral 3's YaRN (factor 16 over 16384 positions, betas 32 and 1 in the released models) and
# temperature (0.1): here a short original context, so that the temperature (from position 8)
# reaches the prompt, and betas that put YaRN's blend across frequencies 1 to 7 of 8 (each
# number exact in the file's f32).
YARN = {"factor": 4.0, "original": 8, "beta_fast": 0.375, "beta_slow": 2.0**-10}
TEMPERATURE = 0.75
SOFTER = 0.5


def rng_weights(seed):
    mat, norm = tiny.random_weights(seed)
    w = {
        "token_embd.weight": mat(tiny.N_VOCAB, N_EMBD, 0.3),
        "output_norm.weight": norm(N_EMBD),
        "output.weight": mat(tiny.N_VOCAB, N_EMBD, 0.2),
    }
    kv = N_HEAD_KV * HEAD_DIM
    for l in range(N_LAYER):
        w[f"blk.{l}.attn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.attn_q.weight"] = mat(N_EMBD, N_EMBD, 0.3)
        w[f"blk.{l}.attn_k.weight"] = mat(kv, N_EMBD, 0.3)
        w[f"blk.{l}.attn_v.weight"] = mat(kv, N_EMBD)
        w[f"blk.{l}.attn_output.weight"] = mat(N_EMBD, N_EMBD)
        w[f"blk.{l}.ffn_norm.weight"] = norm(N_EMBD)
        w[f"blk.{l}.ffn_gate.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_up.weight"] = mat(N_FF, N_EMBD)
        w[f"blk.{l}.ffn_down.weight"] = mat(N_EMBD, N_FF)
    return w


def hparams(arch):
    def add(w):
        tiny.add_decoder(w, N_EMBD, N_FF, N_LAYER, N_HEAD, N_HEAD_KV, EPS, ROPE_BASE)
        if arch == "granite":
            w.add_embedding_scale(GRANITE["embedding"])
            w.add_residual_scale(GRANITE["residual"])
            w.add_logit_scale(GRANITE["logits"])
            w.add_attention_scale(GRANITE["attention"])
        if arch == "mistral3":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(YARN["factor"])
            w.add_rope_scaling_orig_ctx_len(YARN["original"])
            w.add_rope_scaling_yarn_beta_fast(YARN["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(YARN["beta_slow"])
            w.add_attn_temperature_scale(TEMPERATURE)
    return add


def rope_pairs_at(x, positions, head_dim, freq, mscale):
    """GGUF Llama's pair rotation with frequencies `freq` and the cosines and sines times `mscale`."""
    ang = positions[:, None] * freq[None, :]
    cos, sin = mscale * np.cos(ang)[:, None, :], mscale * np.sin(ang)[:, None, :]
    h = x.reshape(len(positions), -1, head_dim // 2, 2)
    a, b = h[..., 0], h[..., 1]
    return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)


def forward(w, tokens, arch, quirk=True, scaled=True, tempered=True):
    """Logits after every token, float64: Llama with GGUF's pair rotation, and `arch`'s twist
    (without it where `quirk` is false; Mistral 3's YaRN and temperature each off where not
    `scaled`, `tempered`)."""
    mistral3 = arch == "mistral3" and quirk
    granite = arch == "granite" and quirk
    m = GRANITE if granite else {"embedding": 1.0, "residual": 1.0, "logits": 1.0, "attention": None}
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    see = tiny.causal(t)
    x = w["token_embd.weight"][tokens] * m["embedding"]
    for l in range(N_LAYER):
        turns = not (arch == "smollm3" and quirk and (l + 1) % 4 == 0)
        h = tiny.rms_norm(x, w[f"blk.{l}.attn_norm.weight"], EPS)
        q, k, v = h @ w[f"blk.{l}.attn_q.weight"].T, h @ w[f"blk.{l}.attn_k.weight"].T, h @ w[f"blk.{l}.attn_v.weight"].T
        if mistral3 and scaled:
            freq, mscale = tiny.yarn(HEAD_DIM, ROPE_BASE, YARN)
            q, k = rope_pairs_at(q, pos, HEAD_DIM, freq, mscale), rope_pairs_at(k, pos, HEAD_DIM, freq, mscale)
        elif turns:
            q, k = tiny.rope_pairs(q, pos, HEAD_DIM, ROPE_BASE), tiny.rope_pairs(k, pos, HEAD_DIM, ROPE_BASE)
        if mistral3 and tempered:
            q = q * (1 + TEMPERATURE * np.log(np.floor(pos / YARN["original"]) + 1))[:, None]
        if m["attention"] is not None:
            # tiny.attention scales by 1/sqrt(head_dim): the queries carry the rest.
            q = q * m["attention"] * np.sqrt(HEAD_DIM)
        a = tiny.attention(q, k, v, N_HEAD, N_HEAD_KV, HEAD_DIM, see) @ w[f"blk.{l}.attn_output.weight"].T
        x = x + a * m["residual"]
        h = tiny.rms_norm(x, w[f"blk.{l}.ffn_norm.weight"], EPS)
        gate, up = h @ w[f"blk.{l}.ffn_gate.weight"].T, h @ w[f"blk.{l}.ffn_up.weight"].T
        x = x + ((gate / (1.0 + np.exp(-gate)) * up) @ w[f"blk.{l}.ffn_down.weight"].T) * m["residual"]
    return tiny.rms_norm(x, w["output_norm.weight"], EPS) @ w["output.weight"].T / m["logits"]


def main(out, arch):
    out.mkdir(parents=True, exist_ok=True)
    model = out / f"tiny-{arch}.gguf"
    weights = rng_weights(17)
    if arch == "mistral3":
        # Softer attention: YaRN's magnitude and the temperature sharpen it, and the guest's
        # 16-bit activations would then move the logits past the bounds the others keep.
        for l in range(N_LAYER):
            for n in ("attn_q", "attn_k"):
                weights[f"blk.{l}.{n}.weight"] *= SOFTER
    exact = tiny.write_gguf(model, arch, weights, ("attn_q", "ffn_down"), hparams(arch))
    twisted = forward(exact, tiny.PROMPT, arch)[-1]
    effect = tiny.rmse(forward(exact, tiny.PROMPT, arch, quirk=False)[-1], twisted)
    if arch == "mistral3":
        # YaRN alone and the temperature alone each move the logits far.
        effect = min(tiny.rmse(forward(exact, tiny.PROMPT, arch, scaled=False)[-1], twisted),
                     tiny.rmse(forward(exact, tiny.PROMPT, arch, tempered=False)[-1], twisted))
    tiny.golden(out, f"tiny-{arch}", arch, model, lambda t: forward(exact, t, arch), {"quirk_effect_rmse": effect})


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2])
