"""compressed-tensors as the oracle: build, quantize, compress, save and decompress small torch models.

Weight qparams are computed the way llm-compressor's min-max observer does for weights (per strategy
min/max -> `calculate_qparams`, NVFP4 global scale by `generate_gparam`), then compressed by
`ModelCompressor.compress_model` and saved with safetensors + `ModelCompressor.update_config`.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Dict, Iterable, Tuple

import torch
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")

from compressed_tensors.compressors import BaseCompressor, ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig, QuantizationScheme, apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils.helpers import (  # noqa: E402
    calculate_qparams, generate_gparam, maybe_pad_tensor_for_block_quant)

try:  # quiet the per-call progress bars / logs
    from loguru import logger as _lg
    _lg.remove()
except Exception:  # pragma: no cover
    pass

LAYERS = {"model.layers.0.attn.q_proj": (64, 128), "model.layers.0.mlp.up_proj": (192, 256),
          "lm_head": (32, 64)}


def make_model(layers: Dict[str, Tuple[int, int]], dtype=torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    root = torch.nn.Module()
    for name, (out, inp) in layers.items():
        node = root
        parts = name.split(".")
        for p in parts[:-1]:
            if not hasattr(node, p):
                node.add_module(p, torch.nn.Module())
            node = getattr(node, p)
        lin = torch.nn.Linear(inp, out, bias=True)
        with torch.no_grad():  # realistic spread with a few outliers
            lin.weight.mul_(torch.rand(out, 1) * 2 + 0.1)
            lin.weight[0, :4] *= 20
        node.add_module(parts[-1], lin)
    return root.to(dtype)


def weight_qparams(module: torch.nn.Linear, args, gs=None) -> None:
    w = module.weight.data
    st = args.strategy
    st = st.value if hasattr(st, "value") else st
    if st == "tensor_group":
        if gs is None:
            gs = generate_gparam(w.min(), w.max())
        module.weight_global_scale.data.copy_(gs)
    if st == "tensor":
        mn, mx = torch.aminmax(w)
    elif st == "channel":
        mn, mx = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    elif st in ("group", "tensor_group"):
        v = w.unflatten(-1, (math.ceil(w.shape[-1] / args.group_size), args.group_size))
        mn, mx = v.amin(dim=-1), v.amax(dim=-1)
    elif st == "block":
        bh, bw = args.block_structure
        v = maybe_pad_tensor_for_block_quant(w, (bh, bw))
        v = v.reshape(v.shape[0] // bh, bh, v.shape[1] // bw, bw)
        mn, mx = v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
    else:
        raise ValueError(st)
    scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_model(model: torch.nn.Module, preset: str, ignore: Iterable[str] = ("lm_head",)) -> None:
    """Apply the preset and compute weight qparams; NVFP4 global scales of q/k/v and gate/up siblings are
    shared (the minimum), as llm-compressor's update_fused_layer_weight_global_scales does."""
    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                             ignore=list(ignore))
    apply_quantization_config(model, cfg)
    shared = {}
    for _, parent in model.named_modules():
        for group in FUSED:
            kids = [getattr(parent, g, None) for g in group]
            if all(getattr(k, "quantization_scheme", None) is not None for k in kids):
                if str(kids[0].quantization_scheme.weights.strategy).endswith("tensor_group"):
                    g = torch.min(torch.cat([generate_gparam(k.weight.min(), k.weight.max()) for k in kids]))
                    shared.update((id(k), g.reshape([1])) for k in kids)
    for _, m in model.named_modules():
        sch = getattr(m, "quantization_scheme", None)
        if sch is not None and sch.weights is not None:
            weight_qparams(m, sch.weights, shared.get(id(m)))


def save_compressed(model: torch.nn.Module, out: Path, base_config=None) -> Dict[str, torch.Tensor]:
    """Compress in place and write model.safetensors + config.json as llm-compressor's save does."""
    out.mkdir(parents=True, exist_ok=True)
    mc = ModelCompressor.from_pretrained_model(model)
    mc.compress_model(model)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(base_config or {"model_type": "tiny"}))
    mc.update_config(str(out))
    return sd


def decompress_dir(path: Path) -> Dict[str, torch.Tensor]:
    """compressed-tensors' own decompression of every quantized module of a checkpoint directory:
    module path -> dense weight (torch layout), via each format's compressor `decompress`."""
    sd = load_file(str(path / "model.safetensors"))
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    groups = qc["config_groups"]
    mods: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        m, _, local = k.rpartition(".")
        mods.setdefault(m, {})[local] = v
    out = {}
    import re
    for m, t in mods.items():
        if "weight_packed" not in t and "weight_scale" not in t:
            continue
        g = None
        for gd in groups.values():
            if any((x.startswith("re:") and re.match(x[3:], m)) or x == m or x == "Linear" for x in gd["targets"]):
                g = gd
                break
        scheme = QuantizationScheme.model_validate(g)
        comp = BaseCompressor.get_value_from_registry(g.get("format") or qc["format"])
        out[m] = comp.decompress(dict(t), scheme)["weight"]
    return out


def bits_of(t: torch.Tensor):
    """Raw bits of a float tensor as a numpy integer array (for bit-exact comparison)."""
    import numpy as np
    ity = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype]
    return t.contiguous().view(ity).numpy().astype(np.int64)
