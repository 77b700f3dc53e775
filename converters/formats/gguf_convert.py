"""GGUF (llama.cpp) causal LMs read with the `gguf` package, written as dense HF checkpoints as transformers reads them.

What transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`, its legacy path for these
architectures: `modeling_gguf_pytorch_utils.load_gguf_checkpoint`) does, done without torch:

- the config is rebuilt from the metadata under llama.cpp's key names (`llama.block_count` ->
  `num_hidden_layers`, ...; the table below is transformers' `GGUF_CONFIG_MAPPING` for these architectures),
  plus qwen3's `head_dim` from `qwen3.attention.key_length` (transformers leaves Qwen3Config's default of
  128, right for every released Qwen3, wrong for a file stating another);
- every tensor is dequantized with gguf's own `gguf.quants.dequantize` (float32, whatever the block
  type: Q4_0/Q4_1/Q5_x/Q8_0, the K-quants, the IQ types, F16/BF16, ...), then renamed to its HF name
  (`GGUFModel.get_packed` gives a block-quantized matrix as a packed QArray instead, `gguf_packed`, with the
  same values bit for bit: what `load_causal_lm` runs);
- llama.cpp stores a `llama` model's Q and K projections with the rows of each head interleaved for its
  rotary embedding (`convert_hf_to_gguf.py`, `LlamaModel.permute`); they are un-permuted to HF's layout:
  `w.reshape(heads, rows_per_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)` (heads = the KV
  head count for K). qwen2/qwen3 files are stored unpermuted and are copied as they are;
- the tokenizer (a byte-level BPE, `tokenizer.ggml.model == "gpt2"`) becomes the tokenizer.json that
  transformers' `GPT2Tokenizer` built from the file's vocabulary and merges serializes.

Unlike transformers, nothing is dropped silently: a tensor the HF model has no place for, a missing one, a
shape that does not fit the config, rope scaling, experts or an unknown block type is a CheckpointError
naming the file and tensor/key and saying what is supported.

The file is untrusted: `check_gguf_header` reads the header first, every count and length checked against
the file size (so a 2^40-element array in a 49-byte file is refused at once), every tensor's data aligned,
in bounds, non-overlapping and exactly its type's size; the checked header is then the file's reader (metadata
decoded on demand, tensors memory-mapped as gguf's `GGUFReader` gives them, gguf's own reader not used: it took ~6 CPU
s to split SmolLM2's 49k-token vocabulary into numpy parts on every open). Metadata is
type-checked (integers in range, `rope.freq_base` and the RMS epsilon finite and positive) and the tokenizer
is built only from string tokens and merges whose pieces are in the vocabulary.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from converters.formats.safe_files import open_regular
from qformats.errors import CheckpointError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFModel",
    "open_gguf",
    "convert_gguf",
    "supported_tensor_types",
    "unpermute_rope_rows",
]

#: GGUF `general.architecture` values read, and the HF model class each becomes.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_CLASS_OF_MODEL_TYPE = {"mistral": "MistralForCausalLM", **SUPPORTED_ARCHITECTURES}

# `{architecture}.<key>` -> HF config key (transformers' GGUF_CONFIG_MAPPING for llama/mistral/qwen2/qwen3).
# `rope.dimension_count` is the head dim for llama/mistral only (transformers ignores it for qwen).
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_REQUIRED_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
_TOKEN_ID_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id",
}

# GGUF tensor name -> HF name (llama.cpp's `tensor_mapping.py` for these architectures).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")

# Pre-tokenizer splits transformers uses for these `tokenizer.ggml.pre` values (its
# GGUF_PRE_TOKENIZER_SPLITS); any other value keeps GPT-2's own byte-level regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
}
_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, ...)
# transformers' VERY_LARGE_INTEGER: the model_max_length of a tokenizer that states none.
_NO_MAX_LENGTH = int(1e30)


@functools.lru_cache(maxsize=None)
def supported_tensor_types() -> tuple[str, ...]:
    """Names of the GGML tensor types `gguf.quants.dequantize` (the installed gguf package) can dequantize."""
    import gguf

    names = []
    for qtype in gguf.GGMLQuantizationType:
        if qtype not in gguf.GGML_QUANT_SIZES:
            continue
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        try:  # one all-zero block: NotImplementedError (or any failure) means gguf cannot read this type
            gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
        except Exception:  # noqa: BLE001
            continue
        names.append(qtype.name)
    return tuple(names)


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's rotary row interleave of a Q or K projection (rows = heads · head_dim).

    llama.cpp stores, per head, rows `[0, 2, 4, ..., 1, 3, 5, ...]`-interleaved pairs; HF keeps the two
    rotary halves contiguous. Formula: `w.reshape(heads, d // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)`
    with `d = rows / heads` -- transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class GGUFModel:
    """An open GGUF causal LM: its HF config, tensors under HF names (dequantized on demand), tokenizer files.

    Built by `open_gguf`. The file is memory-mapped (`gguf_tensors`); `get(name)` dequantizes one tensor.
    Metadata is type-checked against the header (`check_gguf_header`): sizes and counts are integers in
    [1, 2^31) (`block_count` at most the file's tensor count), `rope.freq_base` and the RMS epsilon finite
    positive numbers, token ids inside the vocabulary.
    """

    def __init__(self, path: Path, data: np.ndarray, header: GGUFHeader):
        self.path = path
        self._data = data
        self._header = header
        self._fields = header.fields
        self._stored_tensors = gguf_tensors(data, header)
        arch = self._value("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{path}: general.architecture is {arch!r}; supported GGUF architectures: "
                                  f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        self.architecture: str = arch
        self.config: dict[str, Any] = self._build_config()
        self._tensors: dict[str, Any] = {}  # HF name -> GGUFTensor
        self._map_tensors()

    # -- metadata ---------------------------------------------------------------------------------------

    def _value(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            return default
        try:
            value = field_contents(self._data, self._header, key)
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected a readable value, found "
                                  f"{type(e).__name__}: {e}") from None
        return value

    def _stored(self, key: str) -> str:
        f = self._header.fields.get(key)
        return "nothing" if f is None else (f"{f.type}[{f.count}] of {f.element}" if f.element else f.type)

    def _int(self, key: str, low: int = 1, high: int = 2**31 - 1) -> int | None:
        """Metadata `key` as an int in [low, high] (None when absent)."""
        value = self._value(key)
        if value is None:
            return None
        f = self._header.fields[key]
        if f.type not in _INT_TYPES or isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected one integer, found "
                                  f"{self._stored(key)} {value!r:.80}")
        if not low <= int(value) <= high:
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected an integer in [{low}, {high}], "
                                  f"found {int(value)}")
        return int(value)

    def _positive_float(self, key: str) -> float | None:
        """Metadata `key` as a finite float > 0 (None when absent)."""
        value = self._value(key)
        if value is None:
            return None
        f = self._header.fields[key]
        if f.type not in _INT_TYPES | _FLOAT_TYPES or isinstance(value, bool):
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected a number, found {self._stored(key)} "
                                  f"{value!r:.80}")
        x = float(value)
        if not (math.isfinite(x) and x > 0):
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected a finite number > 0, found {x!r}")
        return x

    def _build_config(self) -> dict[str, Any]:
        arch, path = self.architecture, self.path
        missing = [f"{arch}.{k}" for k in _REQUIRED_KEYS if f"{arch}.{k}" not in self._fields]
        if missing:
            raise CheckpointError(f"{path}: expected the metadata keys {missing} of a {arch} model, found them missing")
        experts = self._value(f"{arch}.expert_count", 0)
        if experts:
            raise CheckpointError(f"{path}: {arch}.expert_count = {experts}: mixture-of-experts GGUF files are not "
                                  f"supported (supported: dense llama, mistral, qwen2, qwen3)")
        scaling = self._value(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise CheckpointError(f"{path}: {arch}.rope.scaling.type = {scaling!r}: rope scaling in GGUF files is not "
                                  f"supported (transformers' GGUF loader ignores it too); supported: none")
        name = self._value("general.name")
        # transformers: a llama-architecture file whose general.name is exactly "mistral" is a MistralConfig.
        model_type = "mistral" if arch == "llama" and name == "mistral" else arch
        config: dict[str, Any] = {"architectures": [_CLASS_OF_MODEL_TYPE[model_type]], "model_type": model_type}
        keys = dict(_CONFIG_KEYS)
        if arch == "llama":
            keys["rope.dimension_count"] = "head_dim"
        if arch == "qwen3":
            # transformers' GGUF mapping leaves head_dim to Qwen3Config's default (128, every released Qwen3);
            # the file states it (llama.cpp's default: hidden / heads), so it is written explicitly.
            keys["attention.key_length"] = "head_dim"
        for gguf_key, hf_key in keys.items():
            if f"{arch}.{gguf_key}" not in self._fields:
                continue
            if hf_key in ("rope_theta", "rms_norm_eps"):
                config[hf_key] = self._positive_float(f"{arch}.{gguf_key}")
            elif hf_key == "num_hidden_layers":  # each layer has tensors: no more layers than the file has tensors
                config[hf_key] = self._int(f"{arch}.{gguf_key}", 1, max(1, len(self._header.tensors)))
            else:
                config[hf_key] = self._int(f"{arch}.{gguf_key}")
        for gguf_key, hf_key in _TOKEN_ID_KEYS.items():
            value = self._int(f"tokenizer.ggml.{gguf_key}", 0)
            if value is not None:
                config[hf_key] = value
        if "vocab_size" not in config and "tokenizer.ggml.tokens" in self._fields:
            config["vocab_size"] = self._header.fields["tokenizer.ggml.tokens"].count
        if "vocab_size" not in config:
            raise CheckpointError(f"{path}: expected {arch}.vocab_size or tokenizer.ggml.tokens to give the "
                                  f"vocabulary size, found neither")
        config["tie_word_embeddings"] = all(t.name != "output.weight" for t in self._stored_tensors)
        if arch == "qwen3" and "head_dim" not in config:
            config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        theta = config.pop("rope_theta", None)
        if theta is not None:
            config["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
        config["dtype"] = "float32"
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
            if config[key] <= 0:
                raise CheckpointError(f"{path}: {key} = {config[key]}: expected a positive integer")
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads", heads)
        if kv <= 0 or heads % kv:
            raise CheckpointError(f"{path}: {arch}.attention.head_count_kv = {kv}: expected a positive divisor of "
                                  f"the {heads} attention heads")
        if "head_dim" not in config and config["hidden_size"] % heads:
            raise CheckpointError(f"{path}: hidden size {config['hidden_size']} is not a multiple of the {heads} "
                                  f"attention heads and the file states no head dimension")
        return config

    # -- tensors ----------------------------------------------------------------------------------------

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        kv = c.get("num_key_value_heads", heads)
        hd = c.get("head_dim", hidden // heads)
        inter, vocab = c["intermediate_size"], c["vocab_size"]
        out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
        if not c["tie_word_embeddings"]:
            out["lm_head.weight"] = (vocab, hidden)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            out.update({
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (heads * hd, hidden),
                p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * hd),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            })
            if c["model_type"] == "qwen2":
                out.update({p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                            p + "self_attn.v_proj.bias": (kv * hd,)})
            if c["model_type"] == "qwen3":
                out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        return out

    def _hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[gguf_name]
        m = _LAYER_RE.fullmatch(gguf_name)
        if m and m.group(2) in _LAYER_TENSORS:
            return f"model.layers.{int(m.group(1))}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
        return None

    def _map_tensors(self) -> None:
        expected = self._expected_shapes()
        supported = supported_tensor_types()
        model_type = self.config["model_type"]
        for t in self._stored_tensors:
            hf = self._hf_name(t.name)
            if hf is None or hf not in expected:
                raise CheckpointError(f"{self.path}: tensor {t.name!r}: a {model_type} model has no place for it "
                                      f"(expected the tensors {sorted(expected)[:3]} ... of "
                                      f"{self.config['num_hidden_layers']} layers, as transformers names them)")
            if hf in self._tensors:
                raise CheckpointError(f"{self.path}: tensor {t.name!r}: expected each tensor once, found it twice")
            if t.tensor_type.name not in supported:
                raise CheckpointError(f"{self.path}: tensor {t.name!r}: GGML type {t.tensor_type.name} cannot be "
                                      f"dequantized by the installed gguf package; supported: {', '.join(supported)}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if shape != expected[hf]:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} ({hf}): expected shape {list(expected[hf])} "
                                      f"from the metadata, found {list(shape)}")
            self._tensors[hf] = t
        missing = sorted(set(expected) - set(self._tensors))
        if missing:
            raise CheckpointError(f"{self.path}: expected every tensor of the {model_type} model, found "
                                  f"{len(missing)} missing: {missing[:6]}" + (" ..." if len(missing) > 6 else ""))

    def keys(self) -> list[str]:
        """HF tensor names, in the file's order."""
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """HF shape of tensor `name` (torch order: [out, in] for a Linear)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def tensor_type(self, name: str) -> str:
        """GGML storage type of tensor `name` (e.g. "Q4_1", "Q8_0", "F32")."""
        return self._tensors[name].tensor_type.name

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 under its HF layout: `gguf.quants.dequantize`, Q/K rows un-permuted for llama."""
        import gguf

        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: expected one of the model's tensors, found {name!r}")
        t = self._tensors[name]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} ({t.tensor_type.name}): cannot dequantize "
                                  f"({e})") from None
        w = np.asarray(w, np.float32).reshape(self.shape(name))
        heads = self._rope_heads(name)
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        return np.ascontiguousarray(w)

    def _rope_heads(self, name: str) -> int | None:
        """The head count whose rotary row interleave `get` undoes for tensor `name` (llama Q / K), else None."""
        if self.architecture != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = self.config["num_attention_heads"]
        return self.config.get("num_key_value_heads", heads) if ".k_proj." in name else heads

    def get_packed(self, name: str):
        """Tensor `name` (a 2-D matrix [out, in] stored in a block type of `gguf_packed.PACKED_TYPES`) as the packed
        QArray of its Flax kernel [in, out] (`gguf_packed.gguf_qarray`: the file's codes and exact float32 scales /
        offsets, nothing dequantized), Q/K rows un-permuted for llama like `get`: `dequantize(get_packed(n)).T`
        equals `get(n)` bit for bit.

        Raises CheckpointError naming the file, the tensor and its type when the type is not packed."""
        from converters.formats.gguf_packed import gguf_qarray

        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: expected one of the model's tensors, found {name!r}")
        t = self._tensors[name]
        shape = self.shape(name)
        if len(shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {t.name!r} ({name}): expected a 2-D matrix to pack, found "
                                  f"shape {list(shape)}")
        heads = self._rope_heads(name)
        rows = None if heads is None else (lambda a: unpermute_rope_rows(a, heads))
        return gguf_qarray(t.data, t.tensor_type.name, shape, f"{self.path}: tensor {t.name!r}", rows=rows)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """(stored data, GGML type name) of tensor `name`, memory-mapped, rows in the file's order: a block type
        as uint8 [rows, bytes per row], a float type as [rows, K] (or [K] for a vector) of its dtype. Reading a
        slice of it reads only those bytes (`converters.pipelines.mesh_load`'s GGUF placement)."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: expected one of the model's tensors, found {name!r}")
        t = self._tensors[name]
        return t.data, t.tensor_type.name

    def row_order(self, name: str) -> np.ndarray | None:
        """The stored row of each HF row of tensor `name` (HF row r = stored row order[r]): llama's Q / K rows
        un-permuted as `get` does (`unpermute_rope_rows` of the row indices); None when rows are stored in HF
        order."""
        heads = self._rope_heads(name)
        if heads is None:
            return None
        n = self.shape(name)[0]
        return unpermute_rope_rows(np.arange(n, dtype=np.int64).reshape(n, 1), heads)[:, 0]

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array) one tensor at a time, in the file's order."""
        for name in self._tensors:
            yield name, self.get(name)

    # -- tokenizer --------------------------------------------------------------------------------------

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json as transformers derives it from the config (its token ids)."""
        out: dict[str, Any] = {"_from_model_config": True}
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in self.config:
                out[key] = self.config[key]
        return out

    def tokenizer_files(self) -> dict[str, Any]:
        """{"tokenizer.json": dict, "tokenizer_config.json": dict, "chat_template.jinja"?: str} as transformers'
        GGUF tokenizer (a `GPT2Tokenizer` from the file's vocabulary and merges) saves them.

        Raises CheckpointError for a tokenizer other than byte-level BPE (`tokenizer.ggml.model == "gpt2"`).
        """
        kind = self._value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"{self.path}: tokenizer.ggml.model is {kind!r}; supported GGUF tokenizers: 'gpt2' "
                                  f"(byte-level BPE). Convert without the tokenizer (tokenizer=False) instead")
        for key, element in (("tokenizer.ggml.tokens", {"STRING"}), ("tokenizer.ggml.merges", {"STRING"}),
                             ("tokenizer.ggml.token_type", _INT_TYPES)):
            f = self._header.fields.get(key)
            if (f is None and key != "tokenizer.ggml.token_type") or (f is not None and f.element not in element):
                kind = "strings" if element == {"STRING"} else "integers"
                raise CheckpointError(f"{self.path}: metadata key {key!r}: expected an array of {kind}, found "
                                      f"{self._stored(key)}")
        tokens = self._value("tokenizer.ggml.tokens")
        merges = self._value("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise CheckpointError(f"{self.path}: expected tokenizer.ggml.tokens and tokenizer.ggml.merges string "
                                  f"arrays, found {type(tokens).__name__} and {type(merges).__name__}")
        types = self._value("tokenizer.ggml.token_type") or []
        if types and len(types) != len(tokens):
            raise CheckpointError(f"{self.path}: metadata key 'tokenizer.ggml.token_type': expected one type per "
                                  f"token ({len(tokens)}), found {len(types)}")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            spelled = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab[spelled] = i
        pairs = []
        for m in merges:
            pair = m.split(" ")
            if len(pair) != 2:
                raise CheckpointError(f"{self.path}: tokenizer.ggml.merges: expected 'left right' pairs, found {m!r}")
            for piece in (*pair, pair[0] + pair[1]):
                if piece not in vocab:
                    raise CheckpointError(f"{self.path}: tokenizer.ggml.merges: merge {m!r}: expected its pieces and "
                                          f"their merge in the vocabulary (tokenizer.ggml.tokens), found {piece!r} "
                                          f"missing")
            pairs.append(pair)
        added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True}
                 for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == _CONTROL and set(tok) <= alphabet]
        ids = {key: self.config.get(hf) for key, hf in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                                        ("unk", "unk_token_id"), ("pad", "pad_token_id"))}
        for key, i in ids.items():
            if i is not None and not 0 <= i < len(tokens):
                raise CheckpointError(f"{self.path}: the {key} token id {i} is outside the {len(tokens)}-token "
                                      f"vocabulary")
        special = {key: (tokens[i] if i is not None else None) for key, i in ids.items()}
        add_bos = bool(self._value("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(self._value("tokenizer.ggml.add_eos_token", False))
        single, pair, specials = [], [], {}

        def _special(key: str, type_id: int) -> dict:
            return {"SpecialToken": {"id": special[key], "type_id": type_id}}

        add_bos = add_bos and special["bos"] is not None
        add_eos = add_eos and special["eos"] is not None
        for type_id, seq, out in ((0, "A", single), (0, "A", pair), (1, "B", pair)):
            if add_bos:
                out.append(_special("bos", type_id))
            out.append({"Sequence": {"id": seq, "type_id": type_id}})
            if add_eos:
                out.append(_special("eos", type_id))
        for key, added_here in (("bos", add_bos), ("eos", add_eos)):
            if added_here:
                tok = special[key]
                specials[tok] = {"id": tok, "ids": [ids[key]], "tokens": [tok]}
        split = _PRE_TOKENIZER_SPLITS.get(self._value("tokenizer.ggml.pre"))
        if split is None:
            pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": pre,
            "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
                               "special_tokens": specials},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": pairs},
        }
        tok_config: dict[str, Any] = {"backend": "tokenizers", "model_max_length": _NO_MAX_LENGTH,
                                      "tokenizer_class": "TokenizersBackend"}
        for key, value in special.items():
            if value is not None:
                tok_config[f"{key}_token"] = value
        if add_bos:
            tok_config["add_bos_token"] = True
        if add_eos:
            tok_config["add_eos_token"] = True
        files: dict[str, Any] = {"tokenizer.json": tokenizer, "tokenizer_config.json": tok_config}
        template = self._value("tokenizer.chat_template")
        if isinstance(template, str):
            files["chat_template.jinja"] = template
        return files


# ---- the header, checked, then the file's reader ---------------------------------------------------------------------

#: Largest GGUF header (metadata and tensor infos) read: 1 GiB; a 256k-token vocabulary with its merges is ~20 MB.
MAX_GGUF_HEADER_BYTES = 1 << 30
#: Deepest nesting of GGUF arrays accepted (an array of arrays of scalars is depth 2).
MAX_GGUF_ARRAY_DEPTH = 2
_GGML_MAX_DIMS = 4
# GGUF value types: id -> (name, struct code or None for string / array)
_GGUF_TYPES = {0: ("UINT8", "B"), 1: ("INT8", "b"), 2: ("UINT16", "H"), 3: ("INT16", "h"), 4: ("UINT32", "I"),
               5: ("INT32", "i"), 6: ("FLOAT32", "f"), 7: ("BOOL", "?"), 8: ("STRING", None), 9: ("ARRAY", None),
               10: ("UINT64", "Q"), 11: ("INT64", "q"), 12: ("FLOAT64", "d")}
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_FLOAT_TYPES = {"FLOAT32", "FLOAT64"}


class _Field(NamedTuple):
    """One metadata value as stored: its type name, the array's element type (None for a scalar), the element
    count (1 for a scalar), for scalars the value, and for arrays where the array starts in the file (its element
    type id)."""

    type: str
    element: str | None
    count: int
    value: Any
    pos: int = -1


class _TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]  # GGUF order (fastest first)
    type: int
    offset: int  # from the start of the data section
    nbytes: int


class GGUFHeader(NamedTuple):
    """A GGUF file's header as `check_gguf_header` read it: metadata fields by key, tensor infos in file
    order, the data section's offset in the file, the alignment, the file size and the byte order ("<", ">")."""

    fields: dict
    tensors: list
    data_offset: int
    alignment: int
    size: int
    order: str = "<"


class _Cursor:
    """Reads little- or big-endian GGUF values from a buffer, every length checked against what is left."""

    def __init__(self, buf: Any, path: Path, order: str, limit: int):
        self.buf, self.path, self.order, self.pos, self.limit = buf, path, order, 0, limit

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: expected a GGUF file, found {what} (at byte {self.pos})")

    def left(self) -> int:
        return self.limit - self.pos

    def take(self, code: str) -> Any:
        n = struct.calcsize(code)
        if n > self.left():
            raise self.fail(f"the header cut short: {n} bytes needed, {self.left()} left")
        value = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += n
        return value

    def count(self, what: str, least: int) -> int:
        """A uint64 count of items of at least `least` bytes each, checked against the bytes left."""
        n = self.take("Q")
        if n * least > self.left():
            raise self.fail(f"{what} = {n}, more than the {self.left()} bytes left can hold")
        return n

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what}: invalid UTF-8 at byte {e.start}") from None

    def skip_string(self, what: str) -> None:
        n = self.count(f"the length of {what}", 1)
        self.pos += n


def _read_value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> _Field:
    if vtype not in _GGUF_TYPES:
        raise c.fail(f"metadata key {key!r}: an unknown value type {vtype}")
    name, code = _GGUF_TYPES[vtype]
    if code is not None:
        return _Field(name, None, 1, c.take(code))
    if name == "STRING":
        return _Field(name, None, 1, c.string(f"the value of {key!r}"))
    if depth >= MAX_GGUF_ARRAY_DEPTH:
        raise c.fail(f"metadata key {key!r}: arrays nested deeper than {MAX_GGUF_ARRAY_DEPTH}")
    pos = c.pos
    etype = c.take("I")
    if etype not in _GGUF_TYPES:
        raise c.fail(f"metadata key {key!r}: an array of the unknown value type {etype}")
    ename, ecode = _GGUF_TYPES[etype]
    least = struct.calcsize(ecode) if ecode is not None else (8 if ename == "STRING" else 12)
    n = c.count(f"the element count of {key!r}", least)
    if ecode is not None:
        c.pos += n * least
    elif ename == "STRING":
        for i in range(n):
            c.skip_string(f"element {i} of {key!r}")
    else:
        for _ in range(n):
            _read_value(c, etype, key, depth + 1)
    return _Field("ARRAY", ename, n, None, pos)


def _type_name(gguf: Any, ttype: int) -> str:
    return gguf.GGMLQuantizationType(ttype).name


def check_gguf_header(path: str | os.PathLike, max_header_bytes: int = MAX_GGUF_HEADER_BYTES) -> GGUFHeader:
    """Reads and checks a GGUF file's header without trusting it; returns it (`GGUFHeader`).

    Every count and length (key-value count, string lengths, array element counts, tensor count, dimensions)
    is checked against the bytes left before anything is allocated or iterated, so the work is bounded by
    the file size (and at most `max_header_bytes` of header are read). Each tensor must have 1-4 positive
    dimensions, a known GGML type whose block divides its first dimension, an offset aligned to
    `general.alignment` (a power of two; default 32), and occupy exactly `nbytes = elements / block_size *
    block_bytes` bytes: tensors sorted by offset follow each other with only the alignment padding between
    them, and the last ends within the file, followed by less than one alignment of padding. Keys and tensor
    names are unique UTF-8.

    Raises:
      CheckpointError naming the file, the key or tensor, and what was expected.
    """
    import gguf

    p = Path(path)
    fd, st = open_regular(p, None, "a GGUF file")
    try:
        size = st.st_size
        if size < 24:
            raise CheckpointError(f"{p}: expected a GGUF file, found {size} bytes (a GGUF header has at least 24)")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            return _parse_header(mm, p, size, max_header_bytes, gguf)
    except (OSError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{p}: expected a readable GGUF file, found {type(e).__name__}: {e}") from None
    finally:
        os.close(fd)


def _parse_header(mm: Any, p: Path, size: int, max_header_bytes: int, gguf: Any) -> GGUFHeader:
    if mm[:4] != b"GGUF":
        raise CheckpointError(f"{p}: expected a GGUF file (magic 'GGUF'), found {bytes(mm[:4])!r}")
    order = "<"
    version = struct.unpack_from("<I", mm, 4)[0]
    if version & 0xFFFF == 0:
        order, version = ">", struct.unpack_from(">I", mm, 4)[0]
    if version not in (2, 3):
        raise CheckpointError(f"{p}: expected GGUF version 2 or 3, found {version}")
    c = _Cursor(mm, p, order, min(size, max_header_bytes))
    c.pos = 8
    n_tensors = c.count("the tensor count", 24)  # name length, dims count, type, offset
    n_kv = c.count("the key-value count", 12)  # key length, value type
    fields: dict[str, _Field] = {}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        if key in fields:
            raise c.fail(f"metadata key {key!r} twice")
        fields[key] = _read_value(c, c.take("I"), key)
    align = fields.get("general.alignment")
    alignment = 32
    if align is not None:
        if align.type != "UINT32" or align.value <= 0 or align.value & (align.value - 1) or align.value > 1 << 24:
            raise CheckpointError(f"{p}: metadata key 'general.alignment': expected a UINT32 power of two up to "
                                  f"2^24, found {align.type} {align.value!r}")
        alignment = align.value
    if n_tensors * 24 > c.left():
        raise c.fail(f"the tensor count = {n_tensors}, more than the {c.left()} bytes left can hold")
    infos: list[_TensorInfo] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        if name in names:
            raise CheckpointError(f"{p}: tensor {name!r}: expected each tensor once, found it twice")
        names.add(name)
        n_dims = c.take("I")
        if not 1 <= n_dims <= _GGML_MAX_DIMS:
            raise CheckpointError(f"{p}: tensor {name!r}: expected 1 to {_GGML_MAX_DIMS} dimensions, found {n_dims}")
        dims = tuple(c.take("Q") for _ in range(n_dims))
        ttype, offset = c.take("I"), c.take("Q")
        if any(d <= 0 for d in dims):
            raise CheckpointError(f"{p}: tensor {name!r}: expected positive dimensions, found {list(dims)}")
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise CheckpointError(f"{p}: tensor {name!r}: expected a known GGML type, found type id {ttype}"
                                  ) from None
        if dims[0] % block:
            raise CheckpointError(f"{p}: tensor {name!r}: GGML type {qtype.name} stores blocks of {block} values; "
                                  f"expected a first dimension divisible by {block}, found {dims[0]}")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * block_bytes
        if nbytes > size:
            raise CheckpointError(f"{p}: tensor {name!r}: {qtype.name} {list(dims)} needs {nbytes} bytes, more "
                                  f"than the whole file ({size})")
        if offset % alignment:
            raise CheckpointError(f"{p}: tensor {name!r}: expected a data offset aligned to {alignment} bytes, "
                                  f"found {offset}")
        infos.append(_TensorInfo(name, dims, ttype, offset, nbytes))
    data_offset = -(-c.pos // alignment) * alignment
    at, prev = 0, None  # where the next tensor must start (relative to the data section), the tensor before
    for t in sorted(infos, key=lambda t: t.offset):
        if t.offset != at:
            after = "the data section's start" if prev is None else (
                f"tensor {prev.name!r} ({_type_name(gguf, prev.type)} {list(prev.dims)}: {prev.nbytes} bytes, "
                f"padded to {alignment})")
            found = "overlapping it" if t.offset < at else f"{t.offset - at} bytes later"
            raise CheckpointError(f"{p}: tensor {t.name!r}: expected its data at offset {at}, right after {after}, "
                                  f"found it at {t.offset}, {found} (a type, shape or offset that does not match "
                                  f"the bytes stored)")
        at, prev = t.offset + -(-t.nbytes // alignment) * alignment, t
    if infos:
        last = max(infos, key=lambda t: t.offset)
        end, padded = data_offset + last.offset + last.nbytes, data_offset + at
        if not end <= size <= padded:
            raise CheckpointError(f"{p}: tensor {last.name!r} ({_type_name(gguf, last.type)} {list(last.dims)}: "
                                  f"{last.nbytes} bytes), the last: expected the tensor data to end the file at "
                                  f"byte {end} (up to {padded} with padding), found a {size}-byte file")
    return GGUFHeader(fields, infos, data_offset, alignment, size, order)


def field_contents(buf: Any, header: GGUFHeader, key: str) -> Any:
    """Metadata `key` of a file whose header is `header` (`buf`: the file's bytes, mapped) as gguf's
    `ReaderField.contents()` gives it: a scalar as a Python int / float / bool, a string as str, an array of numbers
    as a list of Python numbers, an array of strings as a list of str (UTF-8). None when the key is absent.

    Raises:
      UnicodeDecodeError: a string that is not UTF-8.
      ValueError: an array of arrays (no metadata read here has one).
    """
    f = header.fields.get(key)
    if f is None:
        return None
    if f.type != "ARRAY":
        return f.value
    c = _Cursor(buf, Path("?"), header.order, header.size)
    c.pos = f.pos
    ename, code = _GGUF_TYPES[c.take("I")]
    n = c.take("Q")
    if code is not None:
        return np.frombuffer(buf, np.dtype(header.order + code), n, c.pos).tolist()
    if ename != "STRING":
        raise ValueError(f"metadata key {key!r}: an array of arrays")
    out, mv, at = [], memoryview(buf), c.pos
    length = struct.Struct(header.order + "Q")
    for _ in range(n):  # the lengths were checked against the file by check_gguf_header
        (m,) = length.unpack_from(buf, at)
        out.append(str(mv[at + 8:at + 8 + m], "utf-8"))
        at += 8 + m
    return out


class GGUFTensor(NamedTuple):
    """One tensor of a checked GGUF file, as gguf's `ReaderTensor` has it: its GGUF name, `gguf.GGMLQuantizationType`,
    dimensions (GGUF order, fastest first, uint64) and data, memory-mapped: a float / integer type as an array of its
    dtype shaped by the reversed dimensions, a block type as uint8 [..., bytes per row]."""

    name: str
    tensor_type: Any
    shape: np.ndarray
    data: np.ndarray


_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


def gguf_tensors(data: np.ndarray, header: GGUFHeader) -> list[GGUFTensor]:
    """The tensors of a checked header (`check_gguf_header`) over `data`, the whole file mapped as uint8 (np.memmap):
    views, nothing read. Offsets and sizes were checked against the file by the header check."""
    import gguf

    out = []
    for t in header.tensors:
        qtype = gguf.GGMLQuantizationType(t.type)
        dims = tuple(reversed(t.dims))
        start = header.data_offset + t.offset
        raw = data[start:start + t.nbytes]
        if qtype.name in _TYPED:
            arr = raw.view(np.dtype(_TYPED[qtype.name]).newbyteorder(header.order)).reshape(dims)
        else:
            arr = raw.reshape(gguf.quants.quant_shape_to_byte_shape(dims, qtype))
        out.append(GGUFTensor(t.name, qtype, np.array(t.dims, np.uint64), arr))
    return out


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Opens a GGUF causal LM, memory-mapped after `check_gguf_header`; its config and tensor names are checked here.

    Raises:
      CheckpointError: not a readable GGUF file, an unsupported architecture / tensor type / tensor, or a
        shape that does not fit the metadata.
    """
    import importlib.util

    if importlib.util.find_spec("gguf") is None:  # its block types and dequantization
        raise CheckpointError(f"{path}: reading GGUF files needs the 'gguf' package (llama.cpp's reader); found it "
                              f"not installed. Install it with `pip install gguf`") from None
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: expected a GGUF file, found no such file")
    header = check_gguf_header(p)  # bounded by the file size; every count and offset checked
    try:
        data = np.memmap(p, mode="r")
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{p}: expected a readable GGUF file, found {type(e).__name__}: {e}") from None
    return GGUFModel(p, data, header)


def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "float32", tokenizer: bool = True,
                 max_shard_size: int | str = "5GB", overwrite: bool = False) -> Path:
    """Writes a GGUF causal LM as a dense HF checkpoint directory `dst`; returns `dst`.

    Files: config.json, model.safetensors (or shards + index), generation_config.json and, with `tokenizer`,
    tokenizer.json, tokenizer_config.json and chat_template.jinja (when the file has one). Tensors are
    `GGUFModel.get` (gguf's dequantize, Q/K un-permuted for llama) cast to `dtype` (float32, the default,
    is what transformers' GGUF loader gives, bit for bit; bfloat16/float16 round to nearest even).
    The tied embedding is written once (no lm_head.weight), as transformers saves it. Written into a temp
    directory renamed into place at the end, one tensor in memory at a time.
    """
    import ml_dtypes

    from converters.formats.shard_writer import ShardedWriter, TensorSpec

    target = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
              "float16": np.dtype(np.float16)}.get(str(dtype))
    if target is None:
        raise CheckpointError(f"{dst}: dtype {dtype!r}: expected one of float32, bfloat16, float16")
    model = open_gguf(src)
    files = model.tokenizer_files() if tokenizer else {}
    config = dict(model.config, dtype=target.name)
    plan = [TensorSpec(name, target, model.shape(name)) for name in model.keys()]
    with ShardedWriter(dst, max_shard_size, overwrite=overwrite, plan=plan, metadata={"format": "pt"},
                       sources=(src,)) as w:
        for name, array in model.items():
            w.add(name, array.astype(target, copy=False))
        w.add_json("config.json", config)
        w.add_json("generation_config.json", model.generation_config())
        for filename, content in files.items():
            if isinstance(content, str):
                w.add_file(filename, content)
            else:
                w.add_file(filename, json.dumps(content, indent=2, ensure_ascii=False))
    return Path(dst)
