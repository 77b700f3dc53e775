"""A tiny random decoder checkpoint in Hugging Face layout with a word-level tokenizer, for the CLI tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_tiny_hf(dst: Path, cfg: dict, words: list, special: list) -> Path:
    """Write a random decoder of HF config `cfg` to the new folder `dst`: model.safetensors, config.json and a
    word-level tokenizer.json over `words` (token id = index; `special` added as special tokens).

    Every tensor `hf_tensor_names` names for the config, in HF layout (transposed where the slot says so, one
    tensor per expert): norms 1 + 0.1 N(0, 1), the rest 0.3 N(0, 1), float32, from RandomState(0) in name order.
    """
    from flax import nnx
    from tokenizers import Tokenizer, models, pre_tokenizers

    from converters.formats.safetensors_io import save_file
    from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensor_names

    dst.mkdir(parents=True)
    dc = DecoderConfig.from_hf(cfg)
    model = nnx.eval_shape(lambda: CausalLM(dc, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(0)
    tensors = {}
    for name, slot in hf_tensor_names(dc).items():
        node = model
        for p in slot.path:
            node = node[p] if isinstance(p, int) else getattr(node, p)
        shape = node.get_value().shape[(0 if slot.expert is None else 1):]  # an expert's slice of its stack
        shape = shape[::-1] if slot.transpose else shape
        tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                         else 0.3 * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    tok.save(str(dst / "tokenizer.json"))
    return dst
