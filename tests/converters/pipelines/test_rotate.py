"""SpinQuant rotations written (converters.pipelines.rotate, quantize_checkpoint(rotate=...)): against transformers on
the rotated float model, compressed-tensors' transform factories on the same matrices, and our reader of the online
ones."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.transform import TransformConfig, apply_transform_config
from compressed_tensors.transform.factory import random_hadamard as ct_random_hadamard
from compressed_tensors.transform.utils.hadamard import _matmul_hadU, deterministic_hadamard_matrix
from flax import nnx

from converters.pipelines.causal_lm import load_causal_lm
from converters.pipelines.quantize_checkpoint import quantize_checkpoint
from converters.pipelines.rotate import rotate_checkpoint, spinquant_transform_config
from converters.formats.safetensors_io import open_checkpoint
from converters.formats.compressed_tensors.transforms import ct_hadamard_bases, parse_transform_config
from qformats.errors import CheckpointError, ModelError
from qformats.rotation import random_signs, rotation_matrix

# power-of-two sizes, so that "hadamard" (Sylvester) exists: hidden 64, head_dim 16, intermediate 128
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, eos_token_id=None,
             bos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
IDS = np.random.RandomState(0).randint(0, 128, (2, 9))
# float32 models (logits of magnitude ~5): the rotated weights are rounded to float32 once per fused rotation and
# the rotated activations are summed in another order; orthogonal rotations do not amplify that (measured <= 4e-6)
ATOL = 2e-5
GROUPS = {"R1": 1, "R2": 2, "R3": 3, "R4": 4}


def make_src(tmp_path, bias=False, **over):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "attention_bias": bias, **over})).eval()
    with torch.no_grad():  # norm gains and biases away from their initial 1 / 0, so that folding them matters
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.rand_like(p))
            elif n.endswith("bias"):
                p.normal_()
    d = tmp_path / "src"
    hf.save_pretrained(d)
    return d, hf


def logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def ours(d):
    model, _, _ = load_causal_lm(d, tokenizer=False)
    return np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, jnp.asarray(IDS)))


def llm_compressor_prepared(hf):
    """llm-compressor 0.14's SpinQuantModifier.on_calibration_start before the transforms: untie, center the
    embedding, fold the norms (float64, cast back), as written in llmcompressor/modeling/fuse.py."""
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.model.embed_tokens.weight.detach().clone())
        hf.config.tie_word_embeddings = False
        e = hf.model.embed_tokens.weight
        e.copy_((e.double() - e.double().mean(-1, keepdim=True)).float())
        pairs = [(hf.model.norm, [hf.lm_head])]
        for layer in hf.model.layers:
            a, m = layer.self_attn, layer.mlp
            pairs += [(layer.input_layernorm, [a.q_proj, a.k_proj, a.v_proj]),
                      (layer.post_attention_layernorm, [m.up_proj, m.gate_proj])]
        for norm, linears in pairs:
            for lin in linears:
                lin.weight.copy_((lin.weight.double() * norm.weight.double()).float())
            norm.weight.copy_(torch.ones_like(norm.weight))
    return hf


@pytest.fixture
def ct_signs(monkeypatch):
    """compressed-tensors' RandomHadamardFactory drawing our signs (random_signs(n, 0, group)) instead of torch's:
    then its factories build exactly the matrices rotate_checkpoint uses, by its own construction (_matmul_hadU)."""
    by_size = {}

    def fake(size, dtype, device, gen):
        s = torch.tensor(random_signs(size, 0, by_size[size]), dtype=dtype)
        return _matmul_hadU(torch.diag(s))

    monkeypatch.setattr(ct_random_hadamard, "random_hadamard_matrix", fake)
    return by_size


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_r1_r2_keep_the_function(tmp_path, kind, bias):
    src, hf = make_src(tmp_path, bias)
    ref = logits(hf)
    dst = tmp_path / "rot"
    rec = rotate_checkpoint(src, dst, kind, center_embeddings=False)
    assert rec.online == {} and list(rec.transform_config["config_groups"]) == ["R1", "R2"]
    rot = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert rot.config.tie_word_embeddings is False
    with open_checkpoint(dst) as ck:
        assert not np.array_equal(ck.get("lm_head.weight"), ck.get("model.embed_tokens.weight"))
        assert np.all(ck.get("model.layers.0.input_layernorm.weight") == 1)
    got = logits(rot)
    print(f"\n{kind} bias={bias}: max |logits rotated - original| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(ours(dst), ref, rtol=0, atol=ATOL)  # and in the Flax decoder


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_rotated_weights_equal_compressed_tensors_factories(tmp_path, kind, ct_signs):
    """Every tensor equals llm-compressor's preparation + compressed-tensors' apply_transform_config of the
    recorded transform_config (same matrices, its float64 fusing and casts)."""
    src, hf = make_src(tmp_path, bias=True)
    rec = rotate_checkpoint(src, tmp_path / "rot", kind)
    ct_signs.update({64: GROUPS["R1"], 16: GROUPS["R2"]})
    ref = llm_compressor_prepared(hf)
    apply_transform_config(ref, TransformConfig.model_validate(rec.transform_config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    worst = 0.0
    with open_checkpoint(tmp_path / "rot") as ck:
        assert sorted(ck.keys()) == sorted(sd)
        for n in ck.keys():
            a, b = ck.get(n), sd[n]
            assert a.dtype == b.dtype and a.shape == b.shape, n
            d = np.abs(a.astype(np.float64) - b) / np.maximum(np.abs(b), 1e-30)
            worst = max(worst, float(d.max()))
            # float64 products summed in another order (numpy vs torch BLAS), then rounded to float32:
            # equal, or one float32 ulp apart where the float64 value sits on a rounding boundary
            np.testing.assert_allclose(a, b, rtol=2 ** -23, atol=0, err_msg=n)
    print(f"\n{kind}: max relative difference to compressed-tensors {worst:.1e}")
    # the logits too: the centered, folded model rotated by compressed-tensors
    np.testing.assert_allclose(ours(tmp_path / "rot"), logits(ref), rtol=0, atol=ATOL)


def test_torch_generator_signs_reproduce_llm_compressor_exactly(tmp_path):
    """compressed-tensors' factories draw their signs from a fresh torch.Generator() (default seed) per group: given
    those signs, rotate_checkpoint writes the tensors of SpinQuantModifier(transform_type="random-hadamard")'s model
    (its preparation + apply_transform_config, nothing patched) -- and the same quantized checkpoint, bit for bit
    (checked against llm-compressor 0.14's saved one by bench/rotation_ppl.py's companion run, BENCHMARKS.md)."""
    def torch_signs(n):
        return (torch.randint(0, 2, (n,), generator=torch.Generator(), dtype=torch.float64) * 2 - 1).numpy()

    src, hf = make_src(tmp_path, bias=True)
    rec = rotate_checkpoint(src, tmp_path / "rot", "random-hadamard", signs={"R1": torch_signs(64),
                                                                             "R2": torch_signs(16)})
    ref = llm_compressor_prepared(hf)
    apply_transform_config(ref, TransformConfig.model_validate(rec.transform_config))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    with open_checkpoint(tmp_path / "rot") as ck:
        for n in ck.keys():
            np.testing.assert_allclose(ck.get(n), sd[n], rtol=2 ** -23, atol=0, err_msg=n)
    with pytest.raises(ModelError, match="signs"):
        rotate_checkpoint(src, tmp_path / "x", "random-hadamard", signs={"R1": torch_signs(16)})
    with pytest.raises(ModelError, match="signs"):
        rotate_checkpoint(src, tmp_path / "x", "hadamard", signs={"R1": torch_signs(64)})


@pytest.mark.parametrize("kind,scheme", [("hadamard", "W4A16:g16"), ("random-hadamard", "W4A16:g16"),
                                         ("random-hadamard", "W8A16:g16")])
def test_quantized_rotated_checkpoint_loads_in_transformers_with_our_logits(tmp_path, kind, scheme):
    src, _ = make_src(tmp_path)
    dst = tmp_path / "q"
    s = quantize_checkpoint(src, dst, scheme, rotate=kind, progress=False)
    assert s.src == str(src) and s.quantized == 2 * 7 + 0  # lm_head untied but ignored, as llm-compressor does
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["transform_config"] == spinquant_transform_config(kind, 16, ("R1", "R2"))
    assert len(parse_transform_config(qc["transform_config"])) == 2
    assert cfg["tie_word_embeddings"] is False and "lm_head" in qc["ignore"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    ref = logits(theirs)
    got = ours(dst)
    print(f"\n{kind} {scheme}: max |ours - transformers + compressed-tensors| {np.abs(got - ref).max():.2e}")
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("kind", ["hadamard", "random-hadamard"])
def test_online_r3_r4_written_and_read_back(tmp_path, kind, ct_signs):
    """R3 (q_attn, k_cache) and R4 (down_proj input) stored as compressed-tensors saves them; our reader applies
    them. R4's reference: transformers loading the same checkpoint (which drops the online tensors) with
    compressed-tensors' input hook attached from the recorded transform_config (its factory, same matrix).
    R3 rotates queries and keys alike, so in float the scores (q M)(k M)^T / n = q k^T and the logits are the
    model's without R3. compressed-tensors' own R3 is no reference here: with transformers 5 its k_cache hook
    never runs in a plain forward (measured: its q_attn hook alone changes these logits by ~6.7)."""
    from qformats.models.decoder import HadamardRotation

    src, _ = make_src(tmp_path)
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, "W4A16:g16", rotate=kind, rotations=("R1", "R2", "R3", "R4"), progress=False)
    tc = json.loads((dst / "config.json").read_text())["quantization_config"]["transform_config"]
    assert list(tc["config_groups"]) == ["R1", "R2", "R3", "R4"]
    stored = {}
    with open_checkpoint(dst) as ck:
        for i in range(2):
            for name, n in ((f"model.layers.{i}.self_attn.R3_q_attn.weight", 16),
                            (f"model.layers.{i}.self_attn.R3_k_cache.weight", 16),
                            (f"model.layers.{i}.mlp.down_proj.R4_input.weight", 128)):
                stored[name] = np.array(ck.get(name))
                assert stored[name].dtype == np.float64  # the scheme's precision, as compressed-tensors saves it
                grp = GROUPS["R3" if "R3" in name else "R4"]
                want = (deterministic_hadamard_matrix(n, torch.float64) if kind == "hadamard" else
                        _matmul_hadU(torch.diag(torch.tensor(random_signs(n, 0, grp), dtype=torch.float64))))
                assert torch.equal(torch.from_numpy(stored[name]), want), name
    model, _, _ = load_causal_lm(dst, tokenizer=False)
    rots = model.model.layers[1].self_attn.rotations
    for loc in ("q_attn", "k_cache"):  # installed with the stored matrix: v -> v @ M / sqrt(16)
        r = rots[loc]
        eff = np.asarray(r(jnp.eye(16)) if isinstance(r, HadamardRotation) else r.get_value())
        np.testing.assert_allclose(eff, stored[f"model.layers.1.self_attn.R3_{loc}.weight"] / 4, rtol=0, atol=1e-7)
    got = np.asarray(nnx.jit(lambda m, x: m(x)[0])(model, jnp.asarray(IDS)))

    ref = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    plain = logits(ref)
    ct_signs.update({128: GROUPS["R4"]})
    r4 = tc["config_groups"]["R4"]
    apply_transform_config(ref, TransformConfig.model_validate(
        {"config_groups": {"R4": {**r4, "apply": [a for a in r4["apply"] if a["location"] == "input"]}}}))
    want = logits(ref)
    print(f"\n{kind}: max |ours - compressed-tensors R4 hook| {np.abs(got - want).max():.2e}; "
          f"without it {np.abs(got - plain).max():.2e}")
    assert np.abs(got - plain).max() > 100 * ATOL  # the online R4 matters (its fused half alone is wrong)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


def test_rotation_matrices_are_compressed_tensors_constructions():
    bases = ct_hadamard_bases()
    for n in (16, 64, 576):
        s = random_signs(n, 3, 1)
        want = _matmul_hadU(torch.diag(torch.tensor(s, dtype=torch.float64))).numpy()
        assert np.array_equal(rotation_matrix(n, "random-hadamard", 3, 1, bases=bases), want)
    assert np.array_equal(rotation_matrix(64, "hadamard", bases=bases),
                          deterministic_hadamard_matrix(64, torch.float64).numpy())
    assert not np.array_equal(random_signs(64, 0, 1), random_signs(64, 0, 2))  # one draw per group
    assert np.array_equal(random_signs(64, 5, 1), random_signs(64, 5, 1))


def test_unsupported_requests_are_typed_errors(tmp_path):
    src, _ = make_src(tmp_path, hidden_size=48, intermediate_size=96)  # 48 = 2^4 * 3, head_dim 12
    with pytest.raises(ModelError, match="Cannot construct deterministic hadamard of size != 2"):
        rotate_checkpoint(src, tmp_path / "a", "hadamard")
    with pytest.raises(ModelError, match="Cannot construct deterministic hadamard"):
        quantize_checkpoint(src, tmp_path / "b", "W8A16:g16", rotate="hadamard", progress=False)
    assert not (tmp_path / "b").exists()
    rotate_checkpoint(src, tmp_path / "c", "random-hadamard")  # 48 = 2^0 * 48, 12: stored bases
    with pytest.raises(ModelError, match="not supported"):
        rotate_checkpoint(src, tmp_path / "d", "random-matrix")
    with pytest.raises(ModelError, match="rotations"):
        rotate_checkpoint(src, tmp_path / "d", "random-hadamard", rotations=("R5",))
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma"}))
    with pytest.raises(ModelError, match="model_type 'gemma'"):
        rotate_checkpoint(src, tmp_path / "d", "random-hadamard")
    (src / "config.json").write_text(json.dumps(cfg))
    q = tmp_path / "q"
    quantize_checkpoint(src, q, "W8A16:g16", progress=False)
    with pytest.raises(CheckpointError, match="expected a dense checkpoint"):
        rotate_checkpoint(q, tmp_path / "d", "random-hadamard")
    with pytest.raises(CheckpointError, match="exists"):
        rotate_checkpoint(src, tmp_path / "c", "random-hadamard")


def test_a_tensor_outside_the_mappings_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    src, _ = make_src(tmp_path)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.0.extra_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match="extra_proj"):
        rotate_checkpoint(src, tmp_path / "d", "random-hadamard")


def test_cli_rotate_with_and_without_calibration(tmp_path, capsys):
    """qformats quantize SRC DST --rotate: data-free and calibrated (the rotated model is the one calibrated); both
    checkpoints record the transform_config and load in transformers + compressed-tensors with our logits."""
    from converters.cli import main

    src, _ = make_src(tmp_path)
    ids = tmp_path / "calib.npy"
    np.save(ids, np.random.RandomState(1).randint(0, 128, (4, 16)).astype(np.int32))
    runs = {"plain": ["--rotate", "hadamard"],
            "calibrated": ["--rotate", "random-hadamard", "--rotate-seed", "7", "--calibrate", str(ids),
                           "--weight-search", "rtn"]}
    for name, extra in runs.items():
        dst = tmp_path / name
        assert main(["quantize", str(src), str(dst), "--scheme", "W4A16:g16", "--quiet", *extra]) == 0
        qc = json.loads((dst / "config.json").read_text())["quantization_config"]
        kind = extra[1]
        assert qc["transform_config"] == spinquant_transform_config(kind, 16), name
        ref = logits(transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval())
        np.testing.assert_allclose(ours(dst), ref, rtol=0, atol=ATOL, err_msg=name)
    # the seed reaches the rotation: the calibrated run's weights are those of rotate_checkpoint(seed=7)
    rotate_checkpoint(src, tmp_path / "r7", "random-hadamard", seed=7)
    with open_checkpoint(tmp_path / "r7") as a, open_checkpoint(tmp_path / "calibrated") as b:
        assert np.array_equal(a.get("model.embed_tokens.weight"), b.get("model.embed_tokens.weight"))
    assert main(["quantize", str(tmp_path / "x"), "--scheme", "W4A16", "--calibrate", "--rotate", "hadamard"]) == 2
    assert "--rotate is for causal LMs" in capsys.readouterr().err
