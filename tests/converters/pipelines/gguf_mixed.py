"""A tiny llama GGUF whose projections are stored in chosen GGML block types, written with gguf.GGUFWriter (random
weights: gguf's own quantizer where it has one, else random blocks with bounded float16 super-scales)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from gguf_tiny import byte_alphabet  # noqa: E402

# byte offsets of each block's float16 super-scales (d, dmin) in gguf's layouts (gguf.quants' readers)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}

PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_blocks(type_name: str, n: int, k: int, rng, scale=(2e-4, 2e-3)) -> np.ndarray:
    """Random bytes of an [n, k] tensor of `type_name` (every code and sub-scale bit pattern), its float16
    super-scales drawn from +-`scale` so that the weights stay of order one; MXFP4 exponents 120 .. 127."""
    import gguf

    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n * k // block, nbytes), dtype=np.uint8)
    if type_name == "MXFP4":
        raw[:, 0] = rng.integers(120, 128, raw.shape[0], dtype=np.uint8)
    for at in F16_FIELDS.get(type_name, ()):
        d = rng.uniform(*scale, raw.shape[0]) * rng.choice([-1.0, 1.0], raw.shape[0])
        raw[:, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def mixed_gguf(path: Path, types: dict, *, hidden=256, heads=4, kv_heads=2, inter=512, layers=2, embed="F32",
               tied=True, vocab=None, seed=0) -> Path:
    """Writes a llama GGUF at `path`: projection `p` of every layer (names in PROJ, "output" for an untied
    lm_head) stored as GGML type `types.get(p, "F32")`, the embedding as `embed`; `vocab` pads the 260 tokens of the
    byte-level vocabulary with unused ones."""
    import gguf

    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    tokens = ["<s>", "</s>"] + byte_alphabet() + ["he", "Ġt"]
    tokens += [f"<unused_{i}>" for i in range((vocab or 0) - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["h e", "Ġ t"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    hd = hidden // heads
    shapes = {"attn_q": (heads * hd, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, heads * hd), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}

    def add(name, shape, t):
        a = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if t == "F32":
            w.add_tensor(name, a)
            return
        try:
            raw = gguf.quants.quantize(a, q[t])
        except NotImplementedError:
            raw = random_blocks(t, shape[0], shape[1], rng)
        w.add_tensor(name, raw, raw_dtype=q[t])

    add("token_embd.weight", (len(tokens), hidden), embed)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    if not tied:
        add("output.weight", (len(tokens), hidden), types.get("output", "F32"))
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        for p in PROJ:
            add(f"blk.{i}.{p}.weight", shapes[p], types.get(p, "F32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
