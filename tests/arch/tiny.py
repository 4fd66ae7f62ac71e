"""What the tiny random-weight models of tests/arch share: their vocabulary, the GGUF writer
(some tensors stored as Q8_0, the exact values they hold kept for the reference), the float64
pieces of a decoder (RMS norm, NEOX rotation, grouped-query attention) and the golden file of a
greedy continuation. Each `<arch>.py` beside it is one architecture's weights and forward."""

import hashlib
import json

import gguf
import numpy as np

# <unk>, <s>, </s>, the 256 bytes, then pieces.
N_VOCAB = 320
PROMPT = [1, 17, 203, 44, 301, 88, 9, 150, 260, 71, 33, 299, 5, 120]
STEPS = 8


def random_weights(seed):
    """Makers of random matrices (`mat(rows, cols, scale)`) and norm weights near 1 (`norm(n)`)."""
    r = np.random.default_rng(seed)
    mat = lambda rows, cols, s=0.15: (r.standard_normal((rows, cols)) * s).astype(np.float32)
    norm = lambda n: (1.0 + 0.1 * r.standard_normal(n)).astype(np.float32)
    return mat, norm


def write_gguf(path, arch, weights, q8, hparams, blocks=None):
    """The GGUF of `weights` (a tensor whose name holds `.{q}.` for a `q` of `q8` stored as
    Q8_0, the rest as f32), with a SentencePiece-style vocabulary; `hparams(writer)` adds the
    architecture's keys. `blocks` (name -> (kind, bytes of its rows)) stores those tensors as
    the given blocks instead. Returns the exact values of every tensor (`gguf`'s dequantization
    of what the file holds), float64."""
    blocks = blocks or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny random {arch}")
    w.add_context_length(256)
    hparams(w)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581p{i}" for i in range(N_VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (N_VOCAB - 259)
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(N_VOCAB)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    exact = {}
    for name, values in weights.items():
        if name in blocks:
            kind, data = blocks[name]
            exact[name] = gguf.quants.dequantize(data, kind)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        elif any(f".{q}." in name for q in q8):
            kind = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(values, kind)
            exact[name] = gguf.quants.dequantize(data, kind)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            exact[name] = values
            w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v.astype(np.float64) for k, v in exact.items()}


def add_decoder(w, n_embd, n_ff, n_layer, n_head, n_head_kv, eps, base):
    """The hyperparameters every decoder here has, to the GGUF writer `w`."""
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(base)


def rms_norm(x, g, eps):
    """RMS norm of each row of `x` (its last axis), times `g`."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def rope_pairs(x, positions, head_dim, base):
    """Llama's GGUF rotation of each head of each row: adjacent pairs (2j, 2j + 1)."""
    freq = base ** (-2.0 * np.arange(head_dim // 2) / head_dim)
    ang = positions[:, None] * freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.reshape(len(positions), -1, head_dim // 2, 2)
    a, b = h[..., 0], h[..., 1]
    return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)


def rope(x, positions, head_dim, base, factors=None, mscale=1.0, rope_dim=None):
    """NEOX rotation of the first `rope_dim` values (all where None) of each head of each row:
    pairs (j, j + rope_dim / 2), frequency `j` base^(-2j / rope_dim) divided by `factors[j]`
    where given, the cosines and sines times `mscale`; the rest of each head as it is."""
    rope_dim = rope_dim or head_dim
    half = rope_dim // 2
    freq = base ** (-2.0 * np.arange(half) / rope_dim)
    if factors is not None:
        freq = freq / factors
    ang = positions[:, None] * freq[None, :]
    cos, sin = mscale * np.cos(ang)[:, None, :], mscale * np.sin(ang)[:, None, :]
    h = x.reshape(len(positions), -1, head_dim)
    a, b, rest = h[..., :half], h[..., half:rope_dim], h[..., rope_dim:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos, rest], -1).reshape(x.shape)


def yarn(head_dim, base, y):
    """YaRN's frequencies and magnitude (ggml's `rope_yarn`, in float64) for `y` (factor,
    original context, beta_fast, beta_slow): frequency j interpolated (divided by the factor)
    below the band of frequencies [low, high], kept above it, blended linearly within."""
    n, j = head_dim, np.arange(head_dim // 2)
    corr = lambda beta: n * np.log(y["original"] / (beta * 2 * np.pi)) / (2 * np.log(base))
    low, high = max(0.0, np.floor(corr(y["beta_fast"]))), min(n - 1.0, np.ceil(corr(y["beta_slow"])))
    ramp = 1 - np.clip((j - low) / max(0.001, high - low), 0, 1)
    freq = base ** (-2.0 * j / n) * (ramp + (1 - ramp) / y["factor"])
    return freq, 1 + 0.1 * np.log(y["factor"])


def attention(q, k, v, n_head, n_head_kv, head_dim, see, scale=None, softcap=None):
    """Grouped-query attention of rows `q` over `k`, `v` where `see[i, j]`; queries scaled by
    `scale` (`1/sqrt(head_dim)` where None), each score `s` then soft-capped as
    `softcap * tanh(s / softcap)` where given."""
    t = q.shape[0]
    q = q.reshape(t, n_head, head_dim)
    k = k.reshape(-1, n_head_kv, head_dim)
    v = v.reshape(-1, n_head_kv, head_dim)
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.zeros_like(q)
    for hh in range(n_head):
        g = hh // (n_head // n_head_kv)
        s = q[:, hh, :] @ k[:, g, :].T * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        s = np.where(see, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, hh, :] = (p / p.sum(-1, keepdims=True)) @ v[:, g, :]
    return out.reshape(t, n_head * head_dim)


def causal(t, window=None):
    """Which keys each of `t` queries sees: its own and the earlier ones, the last `window`."""
    pos = np.arange(t)
    see = pos[None, :] <= pos[:, None]
    if window is not None:
        see &= pos[:, None] - pos[None, :] < window
    return see


def golden(out, stem, arch, model, forward, extra):
    """Writes `out/{stem}.json`: the prompt, the greedy continuation of `forward` (token ids to
    logits after each), the top 5 of every step, and `extra`; and the full logits after the
    prompt. Returns those logits."""
    tokens = list(PROMPT)
    for _ in range(STEPS):
        tokens.append(int(np.argmax(forward(tokens)[-1])))
    logits = forward(tokens)[len(PROMPT) - 1 : -1]
    steps = []
    for row in logits:
        top = np.argsort(-row, kind="stable")[:5]
        steps.append({"top5": [[int(i), float(row[i])] for i in top], "margin": float(row[top[0]] - row[top[1]])})
    (out / "logits").mkdir(exist_ok=True)
    logits[0].astype("<f4").tofile(out / "logits" / "random.logits.f32")
    case = {"name": "random", "prompt": "", "prompt_tokens": PROMPT, "continuation": tokens[len(PROMPT) :], "steps": steps}
    (out / f"{stem}.json").write_text(json.dumps({
        "model_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        "architecture": arch,
        "reference": f"float64 numpy forward of tests/arch/{arch}.py",
        **extra,
        "cases": [case],
    }))
    return logits[0]


def rmse(a, b):
    return float(np.sqrt(((a - b) ** 2).mean()))
