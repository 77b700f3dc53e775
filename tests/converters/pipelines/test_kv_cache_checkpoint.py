"""kv_cache_scheme checkpoints: parsing, k_scale / v_scale read and written under compressed-tensors' names and
shapes, typed errors for what is not supported."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from flax import nnx
from safetensors.numpy import load_file, save_file

from converters.pipelines.causal_lm import load_causal_lm, save_causal_lm
from converters.formats.compressed_tensors.config import (kv_cache_scheme_from_args, kv_cache_scheme_to_args,
                                                           parse_quantization_config, serialize_quantization_config)
from qformats.errors import CheckpointError
from qformats.kv_cache import KVCacheScheme
from qformats.models.decoder import calibrate_kv_cache, kv_cache_scheme, kv_scale_tensors

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, eos_token_id=None,
             bos_token_id=None, pad_token_id=None)
IDS = np.random.RandomState(0).randint(0, 128, (2, 9))


def ct_dict(strategy="tensor", dynamic=False, **kw):
    """kv_cache_scheme as compressed-tensors 0.20 serializes it (QuantizationConfig.to_dict)."""
    args = QuantizationArgs(num_bits=kw.pop("num_bits", 8), type=kw.pop("type", "float"), strategy=strategy,
                            symmetric=kw.pop("symmetric", True), dynamic=dynamic, **kw)
    return QuantizationConfig(config_groups={}, kv_cache_scheme=args).to_dict()["kv_cache_scheme"]


@pytest.mark.parametrize("strategy,dynamic", [("tensor", False), ("attn_head", False), ("tensor", True)])
def test_scheme_args_round_trip_as_compressed_tensors_writes_them(strategy, dynamic):
    s = KVCacheScheme(strategy, dynamic)
    assert kv_cache_scheme_to_args(s) == ct_dict(strategy, dynamic)
    assert kv_cache_scheme_from_args(ct_dict(strategy, dynamic)) == s
    qc = serialize_quantization_config([], [], kv_cache=s)
    assert parse_quantization_config(qc).kv_cache == s


@pytest.mark.parametrize("args,match", [
    (dict(type="int"), "only FP8"),
    (dict(num_bits=4), "only FP8"),
    (dict(symmetric=False), "asymmetric"),
    (dict(strategy="channel"), "strategy 'channel' is not supported"),
    (dict(strategy="attn_head", dynamic=True), "dynamic scales exist for strategy 'tensor' only"),
    (dict(dynamic="local"), "dynamic 'local' is not supported"),
    (dict(strategy="group", group_size=16), "strategy 'group' is not supported"),
])
def test_unsupported_schemes_are_typed_errors(args, match):
    base = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    with pytest.raises(CheckpointError, match=match):
        parse_quantization_config({"quant_method": "compressed-tensors", "kv_cache_scheme": {**base, **args}})


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    d = tmp_path_factory.mktemp("dense")
    hf.save_pretrained(d)
    return d


forward = nnx.jit(lambda m, ids: m(ids)[0])


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_static_scales_round_trip(dense_dir, tmp_path, strategy):
    model, cfg, _ = load_causal_lm(dense_dir, tokenizer=False)
    scheme = KVCacheScheme(strategy)
    calibrate_kv_cache(model, [IDS], scheme)
    out = save_causal_lm(model, tmp_path / "kv", cfg)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == ct_dict(strategy) and qc["config_groups"] == {}
    tensors = load_file(str(out / "model.safetensors"))
    want = (1,) if strategy == "tensor" else (2, 1, 1)
    for name, value in kv_scale_tensors(model).items():
        assert tensors[name].shape == want and tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], np.asarray(value))
    again, _, _ = load_causal_lm(out, tokenizer=False)
    assert kv_cache_scheme(again) == scheme
    np.testing.assert_array_equal(np.asarray(forward(again, jnp.asarray(IDS))),
                                  np.asarray(forward(model, jnp.asarray(IDS))))
    assert again.init_cache(1, 4).keys[0].dtype == jnp.uint8


def _with_kv(dense_dir, dst, kv_args, drop=(), reshape=None):
    """A checkpoint laid out as compressed-tensors saves a KV-quantized model: the dense tensors, k_scale /
    v_scale under each attention module, quantization_config with only a kv_cache_scheme."""
    tensors = load_file(str(dense_dir / "model.safetensors"))
    for i in range(2):
        for n in "kv":
            name = f"model.layers.{i}.self_attn.{n}_scale"
            if name not in drop:
                tensors[name] = np.full(reshape or (1,), 0.02, np.float32)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dense_dir / "config.json").read_text())
    cfg["quantization_config"] = {**serialize_quantization_config([], []), "kv_cache_scheme": kv_args}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_reads_compressed_tensors_layout_and_refuses_bad_scales(dense_dir, tmp_path):
    model, _, _ = load_causal_lm(_with_kv(dense_dir, tmp_path / "ok", ct_dict()), tokenizer=False)
    assert kv_cache_scheme(model) == KVCacheScheme() and float(model.model.layers[1].self_attn.v_scale[0]) == \
        np.float32(0.02)
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.v_scale missing"):
        load_causal_lm(_with_kv(dense_dir, tmp_path / "miss", ct_dict(), drop=("model.layers.1.self_attn.v_scale",)),
                       tokenizer=False)
    with pytest.raises(CheckpointError, match=r"k_scale F32 \[2, 1, 1\] \(expected a float tensor of shape \[1\]\)"):
        load_causal_lm(_with_kv(dense_dir, tmp_path / "shape", ct_dict(), reshape=(2, 1, 1)), tokenizer=False)
    # scales without a kv_cache_scheme: tensors the model has no place for (never ignored)
    with pytest.raises(CheckpointError, match="no place for.*k_scale"):
        load_causal_lm(_with_kv(dense_dir, tmp_path / "noscheme", None), tokenizer=False)
    # a dynamic scheme takes no stored scales
    with pytest.raises(CheckpointError, match="no place for.*k_scale"):
        load_causal_lm(_with_kv(dense_dir, tmp_path / "dyn", ct_dict(dynamic=True)), tokenizer=False)
    with pytest.raises(CheckpointError, match="only FP8"):
        load_causal_lm(_with_kv(dense_dir, tmp_path / "int8", ct_dict(type="int")), tokenizer=False)


def _hf_kv_amax(hf, samples, per_head):
    """max |state| of the post-RoPE keys and the values transformers' float model puts into its cache, per layer
    (over every sample; per KV head when `per_head`)."""
    out = None
    with torch.no_grad():
        for s in samples:
            cache = hf(torch.tensor(s[None], dtype=torch.long), use_cache=True).past_key_values
            cur = []
            for i in range(len(hf.model.layers)):
                k, v = cache.layers[i].keys, cache.layers[i].values  # [1, G, T, D]
                red = (0, 2, 3) if per_head else (0, 1, 2, 3)
                cur.append(tuple(x.abs().amax(dim=red).reshape(-1) for x in (k, v)))
            out = cur if out is None else [(torch.maximum(a, c), torch.maximum(b, d)) for (a, b), (c, d) in zip(out, cur)]
    return out


@pytest.mark.parametrize("kv", ["fp8", "fp8:head"])
def test_calibrated_checkpoint_writes_kv_scales_of_the_calibration_data(dense_dir, tmp_path, kv):
    """quantize_calibrated_lm(kv_cache=...) with round-to-nearest weights: llm-compressor keeps the model float
    while it calibrates, so k_scale = max|post-RoPE keys| / 448 of the float model on the calibration samples
    (compared with transformers' cache states: equal up to float32 accumulation order, 2e-6 relative)."""
    from converters.pipelines.calibrate import quantize_calibrated_lm
    from converters.evaluation.calibration_data import load_calibration

    np.save(tmp_path / "calib.npy", np.random.RandomState(1).randint(0, 128, 60).astype(np.int32))
    out = tmp_path / "q"
    quantize_calibrated_lm(dense_dir, out, "W4A16:g16", tmp_path / "calib.npy", weight_search="rtn", seq_len=16,
                           kv_cache=kv)
    scheme = KVCacheScheme("tensor" if kv == "fp8" else "attn_head")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == ct_dict(scheme.strategy) and qc["format"] == "pack-quantized"
    samples = load_calibration(tmp_path / "calib.npy", None, seq_len=16, max_tokens=65536, seed=0, vocab_size=128)
    hf = transformers.LlamaForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    ref = _hf_kv_amax(hf, samples, scheme.strategy == "attn_head")
    model, _, _ = load_causal_lm(out, tokenizer=False)
    assert kv_cache_scheme(model) == scheme
    from converters.formats.safetensors_io import open_checkpoint
    with open_checkpoint(out) as ck:
        for i in range(2):
            for j, n in enumerate("kv"):
                name = f"model.layers.{i}.self_attn.{n}_scale"
                got = np.asarray(ck.get(name))
                assert got.shape == scheme.scale_shape(2) and got.dtype == np.float32
                np.testing.assert_allclose(got.reshape(-1), (ref[i][j] / 448).numpy(), rtol=2e-6, err_msg=name)
                np.testing.assert_array_equal(got, np.asarray(kv_scale_tensors(model)[name]))


def test_data_free_kv_cache_is_dynamic_only(dense_dir, tmp_path):
    from converters.cli import main
    from converters.pipelines.quantize_checkpoint import quantize_checkpoint

    quantize_checkpoint(dense_dir, tmp_path / "dyn", "W4A16:g16", kv_cache="fp8:dynamic", progress=False)
    qc = json.loads((tmp_path / "dyn" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == ct_dict(dynamic=True)
    model, _, _ = load_causal_lm(tmp_path / "dyn", tokenizer=False)
    assert kv_cache_scheme(model) == KVCacheScheme("tensor", dynamic=True) and not kv_scale_tensors(model)
    for kv in ("fp8", "fp8:head"):
        with pytest.raises(CheckpointError, match="static k_scale / v_scale, which need calibration data"):
            quantize_checkpoint(dense_dir, tmp_path / kv, "W4A16:g16", kv_cache=kv, progress=False)
        assert main(["quantize", str(dense_dir), str(tmp_path / kv), "--scheme", "W4A16:g16", "--kv-cache", kv,
                     "--quiet"]) == 2
        assert not (tmp_path / kv).exists()
    assert main(["quantize", str(dense_dir), str(tmp_path / "cli"), "--scheme", "W4A16:g16", "--kv-cache",
                 "fp8:dynamic", "--quiet"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == \
        ct_dict(dynamic=True)
