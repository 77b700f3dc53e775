"""quantize_checkpoint on HF mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss): every expert
quantized, routers dense and in `ignore`, the output byte-identical to compressed-tensors 0.20 compressing the same
torch modules the way llm-compressor 0.14's data-free oneshot does (its linearized experts, its TopKRouter not an
nn.Linear), and read back per expert bit-exactly by compressed-tensors' own decompression. (bench/oneshot_parity.py
runs llm-compressor's oneshot itself.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # the compressed-tensors oracle
from ct_oracle import bits_of, decompress_dir, save_compressed, weight_qparams  # noqa: E402

from converters.formats.compressed_tensors.read import dense_weight, read_compressed  # noqa: E402
from converters.formats.moe_layout import experts_text  # noqa: E402
from converters.formats.safetensors_io import open_checkpoint, save_file  # noqa: E402
from converters.pipelines.quantize_checkpoint import quantize_checkpoint  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402

H, I, E = 128, 128, 8
PROJS = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
         "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), "gate"),
         "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), "gate"),
         "gpt_oss": ("mlp", ("gate_proj", "up_proj", "down_proj"), "router")}


class TopKRouter(torch.nn.Module):
    """transformers 5's router: a module holding a [E, hidden] weight, not an nn.Linear."""

    def __init__(self, bias=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(E, H))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(E))


def _bf16(rng, *shape):
    return (rng.standard_normal(shape).astype(np.float32) * 0.05).astype(ml_dtypes.bfloat16)


def checkpoint(arch: str, rng):
    """(on-disk tensors as transformers 5 writes them, the torch module tree llm-compressor quantizes)."""
    block, projs, router = PROJS[arch]
    p = f"model.layers.0.{block}"
    disk = {"model.embed_tokens.weight": _bf16(rng, 64, H), "lm_head.weight": _bf16(rng, 64, H),
            "model.norm.weight": _bf16(rng, H), "model.layers.0.input_layernorm.weight": _bf16(rng, H),
            "model.layers.0.self_attn.q_proj.weight": _bf16(rng, H, H),
            "model.layers.0.self_attn.k_proj.weight": _bf16(rng, 64, H),
            f"{p}.{router}.weight": _bf16(rng, E, H)}
    modules = {}  # module path -> torch [out, in] weight (and bias) of the linearized model
    if arch == "gpt_oss":
        gu, gub = _bf16(rng, E, H, 2 * I), _bf16(rng, E, 2 * I)
        dn, dnb = _bf16(rng, E, I, H), _bf16(rng, E, H)
        disk.update({f"{p}.experts.gate_up_proj": gu, f"{p}.experts.gate_up_proj_bias": gub,
                     f"{p}.experts.down_proj": dn, f"{p}.experts.down_proj_bias": dnb,
                     f"{p}.{router}.bias": _bf16(rng, E)})
        for e in range(E):  # llm-compressor's GptOssExpertMLP.copy_from_experts_module
            modules[f"{p}.experts.{e}.gate_proj"] = (gu[e][:, 0::2].T, gub[e, 0::2])
            modules[f"{p}.experts.{e}.up_proj"] = (gu[e][:, 1::2].T, gub[e, 1::2])
            modules[f"{p}.experts.{e}.down_proj"] = (dn[e].T, dnb[e])
    else:
        for e in range(E):
            for proj in projs:
                w = _bf16(rng, H, I) if proj in ("down_proj", "w2") else _bf16(rng, I, H)
                disk[f"{p}.experts.{e}.{proj}.weight"] = w
                modules[f"{p}.experts.{e}.{proj}"] = (w, None)
    if arch == "qwen2_moe":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = _bf16(rng, H, I) if proj == "down_proj" else _bf16(rng, I, H)
            disk[f"{p}.shared_expert.{proj}.weight"] = w
            modules[f"{p}.shared_expert.{proj}"] = (w, None)
        disk[f"{p}.shared_expert_gate.weight"] = _bf16(rng, 1, H)  # an nn.Linear(hidden, 1)
        modules[f"{p}.shared_expert_gate"] = (disk[f"{p}.shared_expert_gate.weight"], None)
    for n in ("q_proj", "k_proj"):
        modules[f"model.layers.0.self_attn.{n}"] = (disk[f"model.layers.0.self_attn.{n}.weight"], None)
    modules["lm_head"] = (disk["lm_head.weight"], None)
    return disk, modules, f"{p}.{router}"


def torch_model(modules, router: str, disk):
    root = torch.nn.Module()

    def put(path, mod):
        node = root
        parts = path.split(".")
        for q in parts[:-1]:
            if not hasattr(node, q):
                node.add_module(q, torch.nn.Module())
            node = getattr(node, q)
        node.add_module(parts[-1], mod)
    for path, (w, b) in modules.items():
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(w).view(np.int16)).view(torch.bfloat16))
            if b is not None:
                lin.bias.copy_(torch.from_numpy(np.ascontiguousarray(b).view(np.int16)).view(torch.bfloat16))
        put(path, lin)
    r = TopKRouter(bias=f"{router}.bias" in disk).to(torch.bfloat16)
    with torch.no_grad():
        for local, prm in r.named_parameters():
            prm.copy_(torch.from_numpy(disk[f"{router}.{local}"].view(np.int16)).view(torch.bfloat16))
    put(router, r)
    return root


FUSED = (("gate_proj", "up_proj"), ("w1", "w3"), ("q_proj", "k_proj", "v_proj"))


def oracle(tmp_path, modules, router, disk, preset):
    """compressed-tensors 0.20 compressing the linearized torch modules with llm-compressor's data-free min-max
    weight qparams (tests.converters.formats.ct_oracle; NVFP4 global scales shared by fused siblings)."""
    model = torch_model(modules, router, disk)
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import generate_gparam
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]))
    shared = {}
    for _, parent in model.named_modules():
        for group in FUSED:
            kids = [getattr(parent, g, None) for g in group]
            if all(getattr(k, "quantization_scheme", None) is not None for k in kids) and \
                    str(kids[0].quantization_scheme.weights.strategy).endswith("tensor_group"):
                g = torch.min(torch.cat([generate_gparam(k.weight.min(), k.weight.max()) for k in kids]))
                shared.update((id(k), g.reshape([1])) for k in kids)
    for _, m in model.named_modules():
        sch = getattr(m, "quantization_scheme", None)
        if sch is not None and sch.weights is not None:
            weight_qparams(m, sch.weights, shared.get(id(m)))
    out = tmp_path / f"ct-{preset}"
    save_compressed(model, out)
    return out


def _load(d):
    with open_checkpoint(d) as ck:
        return {k: np.array(ck.get(k)) for k in ck.keys()}


@pytest.mark.parametrize("arch, preset", [("qwen3_moe", "W4A16"), ("mixtral", "NVFP4A16"), ("mixtral", "FP8_BLOCK"),
                                          ("qwen2_moe", "W4A16_ASYM"), ("gpt_oss", "MXFP4A16")])
def test_moe_checkpoint_matches_compressed_tensors_per_expert(tmp_path, arch, preset):
    rng = np.random.default_rng(len(arch) * 7 + len(preset))
    disk, modules, router = checkpoint(arch, rng)
    src = tmp_path / "dense"
    src.mkdir()
    save_file(disk, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": arch, "hidden_size": H}))
    s = quantize_checkpoint(src, tmp_path / "q", preset, progress=False)
    n_proj = 3
    assert s.experts == f"1 layer × {E} experts × {n_proj} projections ({E * n_proj} expert weights)"
    assert s.routers == [router] and s.linearized == (arch == "gpt_oss")
    assert s.quantized == E * 3 + 2 + (4 if arch == "qwen2_moe" else 0)  # experts, q/k, shared expert + its gate
    ours, ref = _load(tmp_path / "q"), _load(oracle(tmp_path, modules, router, disk, preset))
    kept = {n for n in disk if n.rpartition(".")[0] not in modules and not n.rpartition(".")[0].endswith(".experts")}
    assert set(ours) == set(ref) | kept
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape and \
            ours[k].tobytes() == ref[k].tobytes(), k
    assert ours[f"{router}.weight"].tobytes() == disk[f"{router}.weight"].tobytes()
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    ref_qc = json.loads((tmp_path / f"ct-{preset}" / "config.json").read_text())["quantization_config"]
    assert sorted(qc["ignore"]) == sorted(ref_qc["ignore"]) == sorted([router, "lm_head"])
    # read back per expert: compressed-tensors' decompression == qformats' reader, bit for bit
    dec = decompress_dir(tmp_path / "q")
    cm = read_compressed(tmp_path / "q")
    experts = [m for m in modules if ".experts." in m]
    assert len(experts) == E * 3 and all(m in dec for m in experts)
    for m in experts:
        mine = np.asarray(dense_weight(cm.modules[m]["weight"])).T
        assert mine.shape == dec[m].shape
        assert np.array_equal(np.ascontiguousarray(mine).view(np.int16).astype(np.int64), bits_of(dec[m])), m


def test_experts_text_counts_layers_and_experts():
    mods = [f"model.layers.{n}.mlp.experts.{e}.{p}" for n in range(3) for e in range(4)
            for p in ("gate_proj", "up_proj", "down_proj")] + ["model.layers.0.self_attn.q_proj"]
    assert experts_text(mods) == "3 layers × 4 experts × 3 projections (36 expert weights)"
    assert experts_text(["model.layers.0.self_attn.q_proj"]) == ""


def test_recipe_ignore_of_routers_is_quiet(tmp_path):
    """llm-compressor's MoE recipes ignore the routers (`re:.*mlp.gate$`): the same output, and no warning that the
    entry matched nothing."""
    import warnings

    disk, _, router = checkpoint("qwen3_moe", np.random.default_rng(4))
    src = tmp_path / "dense"
    src.mkdir()
    save_file(disk, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = quantize_checkpoint(src, tmp_path / "q", "W8A16", ignore=["lm_head", r"re:.*mlp.gate$"], progress=False)
    assert s.routers == [router]
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert sorted(qc["ignore"]) == sorted(["lm_head", router])


def test_router_selected_by_an_explicit_regex_target(tmp_path):
    """A router is no nn.Linear ("Linear" leaves it dense) but a `re:` target naming it quantizes it, and it is
    then not in ignore."""
    disk, _, router = checkpoint("qwen3_moe", np.random.default_rng(3))
    src = tmp_path / "dense"
    src.mkdir()
    save_file(disk, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    s = quantize_checkpoint(src, tmp_path / "q", "FP8_DYNAMIC", targets=["Linear", r"re:.*mlp\.gate$"],
                            progress=False)
    assert s.routers == []
    out = _load(tmp_path / "q")
    assert f"{router}.weight_scale" in out
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]


@pytest.mark.parametrize("arch, edit, message", [
    ("gpt_oss", lambda d: d.pop("model.layers.0.mlp.experts.down_proj_bias"), "expected gpt-oss's fused expert"),
    ("gpt_oss", lambda d: d.__setitem__("model.layers.0.mlp.experts.down_proj",
                                        np.zeros((E, I, H + 1), ml_dtypes.bfloat16)), "fused expert shapes"),
    ("qwen3_moe", lambda d: d.__setitem__("model.layers.0.mlp.experts.gate_up_proj",
                                          np.zeros((E, H, 2 * I), ml_dtypes.bfloat16)),
     "fused 3-D expert tensors .*model_type 'qwen3_moe'"),
])
def test_fused_expert_tensors_never_quantized_as_2d(tmp_path, arch, edit, message):
    disk, _, _ = checkpoint(arch, np.random.default_rng(5))
    edit(disk)
    src = tmp_path / "dense"
    src.mkdir()
    save_file(disk, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": arch}))
    with pytest.raises(CheckpointError, match=message):
        quantize_checkpoint(src, tmp_path / "q", "W8A16", progress=False)
    assert not (tmp_path / "q").exists()
