"""A tiny GGUF causal LM (llama, F32/Q8_0 tensors, a byte-level BPE vocabulary) written with gguf.GGUFWriter, for
the hostile-input tests; no torch or transformers needed."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def byte_alphabet() -> list[str]:
    """GPT-2's 256 byte characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def tiny_gguf(path: Path, *, hidden=16, heads=2, kv_heads=1, inter=32, layers=1, weight_type=None, metadata=(),
              tokens=None, merges=None, block_count=None, freq_base=10000.0, rms_eps=1e-6, seed=0,
              embed_type=None) -> Path:
    """Writes a small random llama GGUF file at `path` (projections in `weight_type`, the token embedding in
    `embed_type`; both default F32)."""
    import gguf

    q = gguf.GGMLQuantizationType
    weight_type = q.F32 if weight_type is None else weight_type
    rng = np.random.default_rng(seed)
    if tokens is None:
        tokens = ["<s>", "</s>"] + byte_alphabet() + ["he", "Ġt"]
    if merges is None:
        merges = ["h e", "Ġ t"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers if block_count is None else block_count)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(freq_base)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens) if isinstance(tokens[0], str) else 258)
    for add in metadata:
        add(w)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def mat(r, c):
        return (0.5 * rng.standard_normal((r, c))).astype(np.float32)

    hd = hidden // heads
    vocab = len(tokens) if isinstance(tokens[0], str) else 258
    tensors = {"token_embd.weight": (mat(vocab, hidden), q.F32 if embed_type is None else embed_type), "output_norm.weight": (1 + mat(1, hidden)[0], q.F32)}
    for i in range(layers):
        p = f"blk.{i}."
        tensors.update({p + "attn_norm.weight": (1 + mat(1, hidden)[0], q.F32),
                        p + "ffn_norm.weight": (1 + mat(1, hidden)[0], q.F32),
                        p + "attn_q.weight": (mat(heads * hd, hidden), weight_type),
                        p + "attn_k.weight": (mat(kv_heads * hd, hidden), weight_type),
                        p + "attn_v.weight": (mat(kv_heads * hd, hidden), weight_type),
                        p + "attn_output.weight": (mat(hidden, heads * hd), weight_type),
                        p + "ffn_gate.weight": (mat(inter, hidden), weight_type),
                        p + "ffn_up.weight": (mat(inter, hidden), weight_type),
                        p + "ffn_down.weight": (mat(hidden, inter), weight_type)})
    return write_tensors(w, tensors, path)


def write_tensors(w, tensors, path: Path) -> Path:
    """Adds `tensors` (name -> (float array, GGML type)) to the GGUFWriter `w` — F32 / F16 / I32 / I8 as plain
    arrays, block types quantized by gguf's own numpy quantizer — then writes the file and closes it."""
    import gguf

    q = gguf.GGMLQuantizationType
    plain = {q.F32: np.float32, q.F16: np.float16, q.I32: np.int32, q.I8: np.int8}
    for name, (a, t) in tensors.items():
        if t in plain:
            w.add_tensor(name, np.asarray(a).astype(plain[t]))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensor_info_at(data: bytes, name: str) -> int:
    """Byte offset of tensor `name`'s info (its dims count, after the name) in GGUF file bytes `data`."""
    raw = name.encode()
    at = data.rindex(len(raw).to_bytes(8, "little") + raw)
    return at + 8 + len(raw)
