"""GGUF (llama.cpp) causal LMs read with the `gguf` package, written as dense HF checkpoints as transformers reads them.

What transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`, its legacy path for these
architectures: `modeling_gguf_pytorch_utils.load_gguf_checkpoint`) does, done without torch:

- the config is rebuilt from the metadata under llama.cpp's key names (`llama.block_count` ->
  `num_hidden_layers`, ...; the table below is transformers' `GGUF_CONFIG_MAPPING` for these architectures),
  plus qwen3's `head_dim` from `qwen3.attention.key_length` (transformers leaves Qwen3Config's default of
  128, right for every released Qwen3, wrong for a file stating another);
- every tensor is dequantized with gguf's own `gguf.quants.dequantize` (float32, whatever the block
  type: Q4_0/Q4_1/Q5_x/Q8_0, the K-quants, the IQ types, F16/BF16, ...), then renamed to its HF name;
- llama.cpp stores a `llama` model's Q and K projections with the rows of each head interleaved for its
  rotary embedding (`convert_hf_to_gguf.py`, `LlamaModel.permute`); they are un-permuted to HF's layout:
  `w.reshape(heads, rows_per_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)` (heads = the KV
  head count for K). qwen2/qwen3 files are stored unpermuted and are copied as they are;
- the tokenizer (a byte-level BPE, `tokenizer.ggml.model == "gpt2"`) becomes the tokenizer.json that
  transformers' `GPT2Tokenizer` built from the file's vocabulary and merges serializes.

Unlike transformers, nothing is dropped silently: a tensor the HF model has no place for, a missing one, a
shape that does not fit the config, rope scaling, experts or an unknown block type is a CheckpointError
naming the file and tensor/key and saying what is supported.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

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

    Built by `open_gguf`. The file is memory-mapped by gguf's reader; `get(name)` dequantizes one tensor.
    """

    def __init__(self, path: Path, reader: Any):
        self.path = path
        self._reader = reader
        self._fields = reader.fields
        arch = self._value("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(f"{path}: general.architecture is {arch!r}; supported GGUF architectures: "
                                  f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        self.architecture: str = arch
        self.config: dict[str, Any] = self._build_config()
        self._tensors: dict[str, Any] = {}  # HF name -> gguf ReaderTensor
        self._map_tensors()

    # -- metadata ---------------------------------------------------------------------------------------

    def _value(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected a readable value, found "
                                  f"{type(e).__name__}: {e}") from None
        return value

    def _int(self, key: str) -> int | None:
        value = self._value(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise CheckpointError(f"{self.path}: metadata key {key!r}: expected one integer, found {value!r:.80}")
        return int(value)

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
            value = self._value(f"{arch}.{gguf_key}")
            if value is None:
                continue
            if hf_key in ("rope_theta", "rms_norm_eps"):
                if not isinstance(value, (float, int, np.floating, np.integer)) or isinstance(value, bool):
                    raise CheckpointError(f"{path}: metadata key '{arch}.{gguf_key}': expected a number, found "
                                          f"{value!r:.80}")
                config[hf_key] = float(value)
            else:
                config[hf_key] = self._int(f"{arch}.{gguf_key}")
        for gguf_key, hf_key in _TOKEN_ID_KEYS.items():
            value = self._int(f"tokenizer.ggml.{gguf_key}")
            if value is not None:
                config[hf_key] = value
        if "vocab_size" not in config and "tokenizer.ggml.tokens" in self._fields:
            config["vocab_size"] = len(self._fields["tokenizer.ggml.tokens"].data)
        if "vocab_size" not in config:
            raise CheckpointError(f"{path}: expected {arch}.vocab_size or tokenizer.ggml.tokens to give the "
                                  f"vocabulary size, found neither")
        config["tie_word_embeddings"] = all(t.name != "output.weight" for t in self._reader.tensors)
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
        for t in self._reader.tensors:
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
        if self.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = self.config["num_attention_heads"]
            if ".k_proj." in name:
                heads = self.config.get("num_key_value_heads", heads)
            w = unpermute_rope_rows(w, heads)
        return np.ascontiguousarray(w)

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
        tokens = self._value("tokenizer.ggml.tokens")
        merges = self._value("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise CheckpointError(f"{self.path}: expected tokenizer.ggml.tokens and tokenizer.ggml.merges string "
                                  f"arrays, found {type(tokens).__name__} and {type(merges).__name__}")
        types = self._value("tokenizer.ggml.token_type") or []
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


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Opens a GGUF causal LM (memory-mapped) with gguf's reader; its config and tensor names are checked here.

    Raises:
      CheckpointError: not a readable GGUF file, an unsupported architecture / tensor type / tensor, or a
        shape that does not fit the metadata.
    """
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the 'gguf' package (llama.cpp's reader); found it "
                              f"not installed. Install it with `pip install gguf`") from None
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{p}: expected a GGUF file, found no such file")
    try:
        reader = gguf.GGUFReader(p)
    except (ValueError, OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p}: expected a GGUF file, found {type(e).__name__}: {e}") from None
    return GGUFModel(p, reader)


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
    with ShardedWriter(dst, max_shard_size, overwrite=overwrite, plan=plan, metadata={"format": "pt"}) as w:
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
