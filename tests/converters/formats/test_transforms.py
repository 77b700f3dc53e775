"""transform_config checkpoints as compressed-tensors writes them (QuIP-style online / offline Hadamard rotations):
loaded into the Flax decoder with the rotations applied, against compressed-tensors' live model (transformers
with compressed-tensors' transform hooks: the reference, since transformers ignores the transforms on reload)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme, apply_transform_config
from flax import nnx
from safetensors.torch import save_file

from converters.pipelines.causal_lm import load_causal_lm
from converters.formats.compressed_tensors.config import parse_quantization_config, serialize_quantization_config
from converters.formats.compressed_tensors.transforms import parse_transform_config
from qformats.errors import CheckpointError
from qformats.models.decoder import HadamardRotation

SMALL = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, eos_token_id=None,
             bos_token_id=None, pad_token_id=None)
IDS = np.random.RandomState(0).randint(0, 128, (2, 9))
# float32 rotations (JAX without x64) against compressed-tensors' float64 ones (logits of magnitude ~1). Hadamard
# kinds are orthogonal: float32 rounding of the rotated activations only (measured in the test output).
# random-matrix is a uniform random matrix and its inverse (condition number in the hundreds), which amplifies
# float32 rounding: measured 3.0e-4.
ATOL = 2e-5
ATOL_RANDOM_MATRIX = 1e-3


def quip_like(kind: str, randomize: bool = False, head_dim=None) -> TransformConfig:
    ign = ["lm_head"]
    return TransformConfig(config_groups={
        "v": TransformScheme(type=kind, randomize=randomize, head_dim=head_dim, precision=torch.float64, apply=[
            TransformArgs(targets=["Linear"], location="input", ignore=ign),
            TransformArgs(targets=["Linear"], location="weight_input", inverse=True, ignore=ign)]),
        "u": TransformScheme(type=kind, randomize=randomize, head_dim=head_dim, precision=torch.float64, apply=[
            TransformArgs(targets=["Linear"], location="weight_output", ignore=ign),
            TransformArgs(targets=["Linear"], location="output", inverse=True, ignore=ign)]),
    })


def make_checkpoint(tmp_path, tc: TransformConfig, hidden=48, inter=96):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "hidden_size": hidden,
                                                                   "intermediate_size": inter})).eval()
    apply_transform_config(hf, tc)
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)).logits.numpy()
    d = tmp_path / "ck"
    d.mkdir()
    sd = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or
          not hf.config.tie_word_embeddings}
    save_file(sd, str(d / "model.safetensors"))
    cfg = hf.config.to_dict()
    qc = serialize_quantization_config([], [])
    qc["transform_config"] = json.loads(json.dumps(tc.model_dump(), default=str))
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg, default=str))
    return d, ref, sd


@pytest.mark.parametrize("kind,randomize,hidden", [("random-hadamard", True, 48), ("random-hadamard", False, 48),
                                                   ("hadamard", False, 64), ("random-matrix", False, 48)])
def test_online_and_offline_rotations_equal_compressed_tensors_live_model(tmp_path, kind, randomize, hidden):
    d, ref, sd = make_checkpoint(tmp_path, quip_like(kind, randomize), hidden, 2 * hidden)
    assert "model.layers.0.self_attn.q_proj.v_input.weight" in sd  # online rotations are stored
    model, _, _ = load_causal_lm(d, tokenizer=False)
    got = np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, jnp.asarray(IDS)))
    print(f"\n{kind}: max |logits - compressed-tensors live| {np.abs(got - ref).max():.2e}")
    # deterministic / random Hadamard without permutations run by the fast transform (Sylvester for 64; 48 from
    # compressed-tensors' stored base of order 48); transposed (inverse) non-Sylvester forms and matrices stay dense
    rots = model.model.layers[0].self_attn.rotations
    fast = {k: isinstance(v, HadamardRotation) for k, v in rots.items()}
    assert fast["q_proj/input"] == (kind != "random-matrix" and not randomize)
    assert fast["q_proj/output"] == (kind == "hadamard")
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL_RANDOM_MATRIX if kind == "random-matrix" else ATOL)
    # without the online rotations the stored weights give other logits
    assert np.abs(got - plain_logits(d)).max() > 0.05


def plain_logits(d):
    """The stored weights as transformers reloads them (the rotations ignored)."""
    from safetensors.numpy import load_file
    from qformats.models.decoder import CausalLM, DecoderConfig, load_hf_tensors
    cfg = json.loads((d / "config.json").read_text())
    tensors = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if "_input." not in k
               and "_output." not in k}
    m = nnx.eval_shape(lambda: CausalLM(DecoderConfig.from_hf(cfg), rngs=nnx.Rngs(0)))
    load_hf_tensors(m, tensors)
    return np.asarray(m(jnp.asarray(IDS))[0])


def test_missing_and_stray_transform_tensors_are_errors(tmp_path):
    d, _, sd = make_checkpoint(tmp_path, quip_like("random-hadamard"))
    # no u_output of order 96 (gate / up_proj outputs) left at all: nothing to share either
    sd2 = {k: v for k, v in sd.items() if not (k.endswith("u_output.weight") and v.shape[0] == 96)}
    save_file(sd2, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="expected tensor 'model.layers.0.mlp.gate_proj.u_output.weight'"):
        load_causal_lm(d, tokenizer=False)


def _saved_once(sd):
    """`sd` as save_pretrained writes tied transform weights: each shared (kind, size) tensor once, first module."""
    kept, seen = {}, set()
    order = [n for n, _ in transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).named_modules()]
    for k in sorted(sd, key=lambda k: (order.index(k.rsplit(".", 2)[0]) if k.rsplit(".", 2)[0] in order else -1, k)):
        parts = k.split(".")
        if len(parts) > 2 and parts[-2] in ("v_input", "u_output"):
            key = (parts[-2][0], tuple(sd[k.rsplit(".", 1)[0] + ".weight"].shape), parts[-1])
            if key in seen:
                continue
            seen.add(key)
        kept[k] = sd[k]
    return kept


def test_shared_transform_weights_of_packed_layers_are_sized_from_the_model(tmp_path):
    """A packed NVFP4 / MXFP4 weight stores no weight_shape: the shared rotation of a module without its own tensor
    is then sized by the model's (out, in) features; without them the choice is ambiguous and refused."""
    from converters.formats.compressed_tensors.transforms import online_rotations
    d, _, sd = make_checkpoint(tmp_path, quip_like("random-hadamard", False))
    kept = _saved_once(sd)
    tensors = {k: v for k, v in kept.items() if k.split(".")[-2] in ("v_input", "u_output")}  # no layer weights
    groups = parse_transform_config(json.loads((d / "config.json").read_text())["quantization_config"]
                                    ["transform_config"])
    cfg = transformers.LlamaConfig(**SMALL)
    h, f = cfg.hidden_size, cfg.intermediate_size
    modules, shapes = {}, {}
    for i in range(cfg.num_hidden_layers):
        kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
        for rel, shape in {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                           "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h),
                           "mlp.down_proj": (h, f)}.items():
            modules[f"model.layers.{i}.{rel}"] = "Linear"
            shapes[f"model.layers.{i}.{rel}"] = shape
    rots, _ = online_rotations(groups, tensors, modules, "ckpt", shapes)
    for r in rots:
        out, inp = shapes[r.module]
        assert r.weight.shape == ((inp, inp) if r.location == "input" else (out, out)), (r.module, r.location)
    with pytest.raises(CheckpointError, match="or the group's shared one of its size"):
        online_rotations(groups, tensors, modules, "ckpt")


@pytest.mark.parametrize("randomize", [False, True])
def test_shared_transform_weights_saved_once_are_read(tmp_path, randomize):
    """compressed-tensors shares one weight (and perm) per group and size and save_pretrained keeps each tied
    tensor once, under the first module holding it (llm-compressor's QuIP checkpoints): the other modules use it."""
    d, ref, sd = make_checkpoint(tmp_path, quip_like("random-hadamard", randomize))
    kept = _saved_once(sd)
    assert len([k for k in kept if k.endswith("_input.weight")]) == 2  # orders 48 and 96, as their checkpoints
    save_file(kept, str(d / "model.safetensors"))
    model, _, _ = load_causal_lm(d, tokenizer=False)
    got = np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("tc,match", [
    ({"config_groups": {"r": {"type": "givens", "apply": []}}}, "transform type 'givens' is not supported"),
    ({"config_groups": {"r": {"type": "hadamard", "requires_grad": True}}}, "requires_grad"),
    ({"config_groups": {"r": {"type": "hadamard", "apply": [{"targets": ["Linear"], "location": "weights"}]}}},
     "location 'weights' is not supported"),
])
def test_unsupported_transform_configs_are_typed_errors(tc, match):
    with pytest.raises(CheckpointError, match=match):
        parse_transform_config(tc)


def test_online_rotations_are_refused_where_they_would_be_ignored(tmp_path):
    """Outside load_causal_lm (which applies them) a config with online rotations is refused; offline-only ones
    that cancel within their group (already fused into the weights) are read; a lone offline one is refused."""
    tc = json.loads(json.dumps(quip_like("hadamard").model_dump(), default=str))
    qc = {**serialize_quantization_config([], []), "transform_config": tc}
    with pytest.raises(CheckpointError, match="online rotations .* must be applied at run time"):
        parse_quantization_config(qc)
    offline = {"config_groups": {"r": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "weight_output"},
        {"targets": ["Linear"], "location": "weight_input", "inverse": True}]}}}
    parse_quantization_config({**qc, "transform_config": offline})
    lone = {"config_groups": {"r": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "weight_input"}]}}}
    with pytest.raises(CheckpointError, match="nothing in the group to undo it"):
        parse_quantization_config({**qc, "transform_config": lone})
