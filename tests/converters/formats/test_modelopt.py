"""ModelOpt NVFP4 checkpoints (`converters.formats.modelopt`) against compressed-tensors 0.20's own converter
(`ModelOptNvfp4Converter`): a tiny random llama in ModelOpt's layout (written by hand following vLLM's / the
converter's reader: uint8 `weight`, float8_e4m3fn `weight_scale`, float32 `weight_scale_2` and `input_scale`, and the
config.json quantization_config ModelOpt's `convert_hf_quant_config_format` writes), read by us and converted by
compressed-tensors; the QArrays, tensors, dequantized weights and the loaded model's logits must be equal bit for bit.
"""

from __future__ import annotations

import json
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from converters.formats.compressed_tensors.read import dense_weight, read_compressed  # noqa: E402
from converters.formats.modelopt import read_modelopt  # noqa: E402
from converters.formats.quantized import read_quantized  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.presets import presets  # noqa: E402
from qformats.qarray import QArray  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")
# a module without input_scale reads as NVFP4A16 (compressed-tensors' converter requires input_scale everywhere, so the
# oracle checkpoint has it on every module; test_module_without_input_scale_is_weight_only covers the other case)
WEIGHT_ONLY = "model.layers.1.mlp.down_proj"


def _modelopt_qconfig(exclude=("lm_head",), algo="NVFP4", group_size=16):
    """config.json's quantization_config as ModelOpt (>= 0.29, convert_hf_quant_config_format) writes it."""
    return {"config_groups": {"group_0": {
                "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size},
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size},
                "targets": ["Linear"]}},
            "ignore": list(exclude), "quant_algo": algo,
            "producer": {"name": "modelopt", "version": "0.37.0"}, "quant_method": "modelopt"}


def _write_modelopt(d, seed=0, scalar=()):
    """A tiny llama with every decoder projection in ModelOpt NVFP4 (random codes, scales and global scales);
    `scalar`: the stored shape of weight_scale_2 / input_scale (ModelOpt's export writes 0-dim tensors)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(torch.bfloat16).eval()
    hf.save_pretrained(d)
    sd = load_file(str(d / "model.safetensors"))
    for i in range(TINY["num_hidden_layers"]):
        for rel in PROJ:
            m = f"model.layers.{i}.{rel}"
            n, k = sd.pop(f"{m}.weight").shape
            sd[f"{m}.weight"] = torch.from_numpy(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
            # positive finite e4m3 codes over ~2^-7 .. 2^7
            sc = rng.integers(0x18, 0x58, (n, k // 16), dtype=np.uint8)
            sd[f"{m}.weight_scale"] = torch.from_numpy(sc).view(torch.float8_e4m3fn)
            for local, (lo, hi) in (("weight_scale_2", (1e-4, 1e-2)), ("input_scale", (1e-3, 1e-1))):
                sd[f"{m}.{local}"] = torch.tensor(float(rng.uniform(lo, hi)), dtype=torch.float32).reshape(scalar)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = _modelopt_qconfig()
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def _ct_convert(src, dst):
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import ModelOptNvfp4Converter

    try:
        from loguru import logger
        logger.remove()
    except Exception:  # pragma: no cover
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_checkpoint(src, dst, ModelOptNvfp4Converter(ignore=["lm_head"], targets=["re:.*_proj$"]),
                           device="cpu", max_workers=1)
    return dst


@pytest.fixture(scope="module", params=[(), (1,)], ids=["scalar", "shape1"])
def ckpts(request, tmp_path_factory):
    """(ModelOpt checkpoint, compressed-tensors' conversion of it), global scales stored 0-dim or as [1]."""
    base = tmp_path_factory.mktemp("modelopt")
    src = _write_modelopt(base / "modelopt", scalar=request.param)
    return src, _ct_convert(src, base / "ct")


def _u(a):
    a = np.ascontiguousarray(np.asarray(a))
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def test_qarrays_equal_compressed_tensors_converter_output(ckpts):
    src, ct = ckpts
    ours, theirs = read_modelopt(src), read_compressed(ct)
    assert set(ours.modules) == set(theirs.modules)
    assert len(ours.qarrays()) == 2 * len(PROJ)
    for mod, tens in theirs.modules.items():
        assert set(ours.modules[mod]) == set(tens), mod
        for local, b in tens.items():
            a = ours.modules[mod][local]
            if isinstance(b, QArray):
                assert isinstance(a, QArray)
                assert (a.scheme, a.shape, a.dtype, a.axis) == (b.scheme, b.shape, b.dtype, b.axis), mod
                assert a.scheme == presets["NVFP4"].weights
                for x, y in ((a.codes, b.codes), (a.scale, b.scale), (a.global_scale, b.global_scale)):
                    assert np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).shape == np.asarray(y).shape
                    np.testing.assert_array_equal(_u(x), _u(y), err_msg=f"{mod}.{local}")
                assert a.zero_point is None and b.zero_point is None
            else:
                assert np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).shape == np.asarray(b).shape
                np.testing.assert_array_equal(_u(a), _u(b), err_msg=f"{mod}.{local}")
    # the global scales are the reciprocals of ModelOpt's weight_scale_2 / input_scale, rounded to float32 once
    raw = load_file(str(src / "model.safetensors"))
    m = "model.layers.0.self_attn.q_proj"
    assert ours.modules[m]["weight"].global_scale[0] == np.float32(1) / raw[f"{m}.weight_scale_2"].numpy()
    assert ours.modules[m]["input_global_scale"] == np.float32(1) / raw[f"{m}.input_scale"].numpy()
    # the equivalent compressed-tensors config: the same schemes per module as the converter's NVFP4 group
    ours_groups = {g.name: g for g in ours.quant.groups}
    ct_group = theirs.quant.groups[0]
    for mod, gname in ours.groups.items():
        g = ours_groups[gname]
        assert g.format == ct_group.format == "nvfp4-pack-quantized" and ours.formats[mod] == g.format
        assert g.weights == ct_group.weights
        assert g.input_activations == ct_group.input_activations
        assert g.matches_by_name(mod) and not ours.quant.is_ignored(mod)
    assert ours.quant.is_ignored("lm_head")


def _ct_bf16_scalar_rule(q):
    """compressed-tensors' NVFP4 decompression when weight_global_scale is a 0-dim tensor (what its converter makes of
    ModelOpt's 0-dim weight_scale_2): torch promotes bf16 / 0-dim f32 to bfloat16, so it computes
    bf16(code * bf16(bf16(scale) / global_scale)) -- two bfloat16 roundings -- where a [1] global scale gives one."""
    from qformats.codec import decode

    codes = torch.from_numpy(np.array(decode(unpack_codes(q), "fp4_e2m1"), np.float32)).to(torch.bfloat16)
    scale = torch.from_numpy(np.asarray(q.scale).view(np.uint8).copy()).view(torch.float8_e4m3fn).to(torch.bfloat16)
    s = scale / torch.tensor(float(np.asarray(q.global_scale)[0]), dtype=torch.float32)
    assert s.dtype == torch.bfloat16
    return (codes * s.repeat_interleave(16, dim=1)).to(torch.bfloat16)


def unpack_codes(q):
    from qformats.packing import unpack

    n, k = q.tshape
    return np.asarray(unpack(np.asarray(q.codes), 4, k))


def test_dequantized_weights_equal_compressed_tensors_decompression(ckpts):
    """transformers + compressed-tensors (dequantize=True) on the converter's output against `dense_weight` of our
    QArrays. Global scales stored as [1]: equal bit for bit. Stored 0-dim (ModelOpt's export): compressed-tensors
    rounds scale / global_scale to bfloat16 first (`_ct_bf16_scalar_rule`, a torch type-promotion effect of the
    tensor's rank); ours keeps it in float32 as for every compressed-tensors NVFP4 checkpoint -- equal values but for
    at most one bfloat16 ulp, on the weights where that extra rounding shows."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    src, ct = ckpts
    scalar = load_file(str(src / "model.safetensors"))[f"{Q}.weight_scale_2"].dim() == 0
    qs = read_modelopt(src).qarrays()
    differ = 0
    for dtype, tdt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sd = transformers.LlamaForCausalLM.from_pretrained(
                ct, quantization_config=CompressedTensorsConfig(dequantize=True), torch_dtype=tdt).state_dict()
        for mod, q in qs.items():
            ours = np.asarray(dense_weight(q, jnp.dtype(dtype))).T
            t = sd[f"{mod}.weight"].detach().contiguous()
            theirs = t.view(torch.int16).numpy() if tdt == torch.bfloat16 else t.numpy()
            if not scalar:
                np.testing.assert_array_equal(_u(ours), _u(theirs), err_msg=f"{mod} ({dtype})")
                continue
            rule = _ct_bf16_scalar_rule(q).to(tdt)
            rule = rule.view(torch.int16).numpy() if tdt == torch.bfloat16 else rule.numpy()
            np.testing.assert_array_equal(_u(rule), _u(theirs), err_msg=f"{mod} ({dtype})")
            ob, tb = np.asarray(ours, np.float32), np.asarray(t.to(torch.float32).numpy())
            assert (np.abs(ob - tb) <= np.abs(tb) * 2.0 ** -7).all(), mod  # one bfloat16 ulp (8 significant bits)
            differ += int((_u(ours) != _u(theirs)).sum())
    assert (differ > 0) == scalar


def _packed(model):
    from flax import nnx

    from qformats.nn import QLinear

    return {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model) if isinstance(m, QLinear)}


def test_load_causal_lm_runs_packed_like_the_converted_checkpoint(ckpts):
    from qformats.quantize import dequantize

    from converters.pipelines.causal_lm import load_causal_lm

    src, ct = ckpts
    ours, _, _ = load_causal_lm(src, tokenizer=False)
    theirs, _, _ = load_causal_lm(ct, tokenizer=False)
    po, pt = _packed(ours), _packed(theirs)
    assert set(po) == set(pt) and len(po) == 2 * len(PROJ)
    qs = read_modelopt(src).qarrays()
    for path, lin in po.items():
        k = lin.kernel.get_value()
        np.testing.assert_array_equal(_u(dequantize(k, jnp.float32)), _u(dequantize(pt[path].kernel.get_value(),
                                                                                    jnp.float32)), err_msg=path)
        (mod,) = [m for m in qs if m.replace(".", "/").endswith(path.split("model/", 1)[-1])]
        np.testing.assert_array_equal(_u(dequantize(k, jnp.bfloat16)), _u(dense_weight(qs[mod])), err_msg=path)
        gs_o, gs_t = lin.input_global_scale, pt[path].input_global_scale
        np.testing.assert_array_equal(_u(gs_o.get_value()), _u(gs_t.get_value()), err_msg=path)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, TINY["vocab_size"], (1, 9)), jnp.int32)
    np.testing.assert_array_equal(_u(ours(ids)[0]), _u(theirs(ids)[0]))


def test_read_quantized_dispatches_on_quant_method(ckpts):
    src, _ = ckpts
    cm = read_quantized(src)
    assert set(cm.qarrays()) == set(read_modelopt(src).qarrays())


# ---- malformed inputs: typed errors naming the tensor / field and what is supported ------------------------------
@pytest.fixture()
def broken(ckpts, tmp_path):
    src, _ = ckpts

    def make(qconfig=None, edit=None):
        d = tmp_path / "broken"
        shutil.copytree(src, d)
        if qconfig is not None:
            cfg = json.loads((d / "config.json").read_text())
            cfg["quantization_config"] = qconfig
            (d / "config.json").write_text(json.dumps(cfg))
        if edit is not None:
            sd = load_file(str(d / "model.safetensors"))
            edit(sd)
            save_file(sd, str(d / "model.safetensors"))
        make.last = d
        return d
    return make


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("qconfig, match", [
    (_modelopt_qconfig(algo="FP8"), r"quant_algo 'FP8' is not read.*supported ModelOpt algorithms: NVFP4"),
    (_modelopt_qconfig(algo="W4A8_AWQ"), r"quant_algo 'W4A8_AWQ' is not read"),
    (_modelopt_qconfig(group_size=32), r"group_size 32.*groups of 16"),
    ({**_modelopt_qconfig(), "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}},
     r"KV-cache quantization"),
    (_modelopt_qconfig(exclude=["lm_head", "model.layers.0.self_attn*"]),
     r"module 'model.layers.0.self_attn.[qkvo]_proj'.*excludes it \('model.layers.0.self_attn\*'\)"),
    ({"quant_method": "modelopt"}, r"expected quant_algo"),
    ({**_modelopt_qconfig(), "activation_scheme": "dynamic"}, r"activation_scheme 'dynamic'"),
    (_modelopt_qconfig(algo="MIXED_PRECISION"), r"quant_algo 'MIXED_PRECISION' is not read"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 64}},
     r"quantization: group_size 64"),
])
def test_unsupported_configs_are_typed_errors(broken, qconfig, match):
    with pytest.raises(CheckpointError, match=match):
        read_quantized(broken(qconfig=qconfig))


def _pop(name):
    return lambda sd: sd.pop(name)


def _set(name, value):
    def edit(sd):
        sd[name] = value
    return edit


@pytest.mark.parametrize("edit, match", [
    (_pop(f"{Q}.weight_scale_2"), rf"lacks \['{Q}.weight_scale_2'\]"),
    (_pop(f"{Q}.weight_scale"), rf"lacks \['{Q}.weight_scale'\]"),
    (_set(f"{Q}.weight", torch.zeros(64, 64, dtype=torch.float8_e4m3fn)),
     rf"tensor '{Q}.weight': expected uint8 \[out, in/2\].*found F8_E4M3"),
    (_set(f"{Q}.weight_scale", torch.ones(64, 8, dtype=torch.bfloat16)),
     rf"tensor '{Q}.weight_scale': expected float8_e4m3fn \[64, 4\].*found BF16 shape \[64, 8\]"),
    (_set(f"{Q}.weight_scale", torch.ones(64, 2).to(torch.float8_e4m3fn)), r"expected float8_e4m3fn \[64, 4\]"),
    (_set(f"{Q}.weight_scale_2", torch.ones(2)), rf"'{Q}.weight_scale_2': expected one float32"),
    (_set(f"{Q}.weight_scale_2", torch.tensor(0.0)), r"expected a finite positive scale, found 0.0"),
    (_set(f"{Q}.input_scale", torch.tensor(float("inf"))), rf"'{Q}.input_scale'.*finite positive"),
    (_set(f"{Q}.pre_quant_scale", torch.ones(64)), r"pre_quant_scale.*NVFP4_AWQ"),
    (_set("model.layers.0.self_attn.k_proj.k_scale", torch.tensor(1.0)), r"KV-cache scales are not supported"),
    (_set(f"{Q}.weight", torch.zeros(64, 36, dtype=torch.uint8)), r"in_features 72 is not a multiple"),
])
def test_malformed_tensors_are_typed_errors(broken, edit, match):
    with pytest.raises(CheckpointError, match=match):
        read_quantized(broken(edit=edit))


def test_module_without_input_scale_is_weight_only(ckpts, broken):
    """A module without input_scale gets NVFP4A16's schemes (its own config group); the others stay NVFP4."""
    src, _ = ckpts
    full, cm = read_modelopt(src), read_quantized(broken(edit=_pop(f"{WEIGHT_ONLY}.input_scale")))
    assert "input_global_scale" not in cm.modules[WEIGHT_ONLY]
    groups = {g.name: g for g in cm.quant.groups}
    assert groups[cm.groups[WEIGHT_ONLY]].scheme_set.input_activations is None
    assert groups[cm.groups[WEIGHT_ONLY]].weights == presets["NVFP4A16"].weights
    assert groups[cm.groups[Q]].input_activations == presets["NVFP4"].input_activations
    a, b = cm.modules[WEIGHT_ONLY]["weight"], full.modules[WEIGHT_ONLY]["weight"]
    for x, y in ((a.codes, b.codes), (a.scale, b.scale), (a.global_scale, b.global_scale)):
        np.testing.assert_array_equal(_u(x), _u(y))
    from converters.pipelines.causal_lm import load_causal_lm

    model, _, _ = load_causal_lm(broken.last, tokenizer=False)
    packed = _packed(model)
    assert sum(lin.input_global_scale is None for lin in packed.values()) == 1


def test_weight_only_algo_refuses_input_scale(broken):
    with pytest.raises(CheckpointError, match=r"quant_algo W4A16_NVFP4 is weight-only, expected no input_scale"):
        read_quantized(broken(qconfig=_modelopt_qconfig(algo="W4A16_NVFP4")))


def test_legacy_hf_quant_config_layout(broken):
    """The hf_quant_config.json layout (nested `quantization`, `exclude_modules`) reads the same."""
    d = broken(qconfig={"quant_method": "modelopt"})
    (d / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.19.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]}}))
    a, b = read_quantized(d), read_modelopt(d)
    assert set(a.qarrays()) == set(b.qarrays()) and len(a.qarrays()) == 2 * len(PROJ)


# ---- writing: the CompressedModel as a compressed-tensors checkpoint ---------------------------------------------
def test_written_compressed_tensors_checkpoint_matches_the_converter(ckpts, tmp_path):
    """`write_compressed` of what `read_modelopt` gives, against compressed-tensors' converter output.

    Global scales stored as [1]: model.safetensors is byte-identical. Stored 0-dim (ModelOpt's export): our writer
    stores every weight_global_scale as [1] (as compressed-tensors' own NVFP4 checkpoints have it), the converter
    keeps 0-dim; every other byte of every tensor is the same. config.json: the same quantization_config up to
    naming (group name, version string, empty sparsity / transform records); the converter also writes
    model.safetensors.index.json for a single file, which we do not."""
    from safetensors import safe_open

    from converters.formats.compressed_tensors.config import parse_quantization_config
    from converters.formats.compressed_tensors.write import write_compressed

    src, ct = ckpts
    cm = read_modelopt(src)
    groups = {g.name: g for g in cm.quant.groups}
    tensors = {f"{mod}.{local}": a for mod, t in cm.modules.items() for local, a in t.items()}
    schemes = {mod: groups[g].scheme_set for mod, g in cm.groups.items()}
    cfg = {k: v for k, v in cm.config.items() if k != "quantization_config"}
    ours = write_compressed(tmp_path / "ours", tensors, schemes, ignore=["lm_head"], targets=["re:.*_proj$"],
                            config=cfg, copy_from=src)
    scalar = load_file(str(src / "model.safetensors"))[f"{Q}.weight_scale_2"].dim() == 0
    a, b = (ct / "model.safetensors").read_bytes(), (ours / "model.safetensors").read_bytes()
    assert (a == b) != scalar
    with safe_open(str(ct / "model.safetensors"), "pt") as fa, safe_open(str(ours / "model.safetensors"), "pt") as fb:
        assert sorted(fa.keys()) == sorted(fb.keys())
        for name in fa.keys():
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            assert x.dtype == y.dtype, name
            if scalar and name.endswith(".weight_global_scale"):
                assert (tuple(x.shape), tuple(y.shape)) == ((), (1,)), name
                y = y.reshape(())
            assert x.shape == y.shape and x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8)), name
    qa = parse_quantization_config(json.loads((ct / "config.json").read_text())["quantization_config"])
    qb = parse_quantization_config(json.loads((ours / "config.json").read_text())["quantization_config"])
    assert (qa.format, qa.ignore, qa.kv_cache_scheme, qa.quantization_status) == \
        (qb.format, qb.ignore, qb.kv_cache_scheme, qb.quantization_status)
    assert [(g.targets, g.format, g.weights, g.input_activations, g.output_activations) for g in qa.groups] == \
        [(g.targets, g.format, g.weights, g.input_activations, g.output_activations) for g in qb.groups]
    assert read_compressed(ours).qarrays().keys() == cm.qarrays().keys()


def test_weight_only_algo_reads_as_nvfp4a16(broken):
    def drop_input_scales(sd):
        for name in [n for n in sd if n.endswith(".input_scale")]:
            del sd[name]
    cm = read_quantized(broken(qconfig=_modelopt_qconfig(algo="w4a16_nvfp4"), edit=drop_input_scales))
    assert [(g.weights, g.input_activations) for g in cm.quant.groups] == \
        [(presets["NVFP4A16"].weights, None)]
    assert len(cm.qarrays()) == 2 * len(PROJ)
    assert not any("input_global_scale" in t for t in cm.modules.values())
    from converters.pipelines.causal_lm import load_causal_lm

    model, _, _ = load_causal_lm(broken.last, tokenizer=False)
    assert all(lin.input_global_scale is None for lin in _packed(model).values())


def test_exclude_wildcards_become_compressed_tensors_ignore_entries(broken):
    """ModelOpt's exclude_modules are fnmatch wildcards; the QuantConfig's ignore list matches the same names."""
    pats = ["lm_head", "*.mlp.gate", "model.visual*", "a[!b]c", "x?y"]
    cm = read_quantized(broken(qconfig=_modelopt_qconfig(exclude=pats)))
    import fnmatch

    for name in ["lm_head", "model.layers.3.mlp.gate", "model.visual.blocks.0.attn", "axc", "abc", "xzy", "xy",
                 "model.layers.3.mlp.gate_proj", "lm_head2", "model.layers.0.self_attn.q_proj"]:
        want = any(fnmatch.fnmatchcase(name, p) for p in pats)
        assert cm.quant.is_ignored(name) == want, name
