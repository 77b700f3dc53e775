"""Expert parallelism (+ tensor parallelism of attention) on 8 CPU devices, in fresh interpreters
(moe_mesh_worker.py): greedy tokens equal one device's (float, W4A16, NVFP4A16; 8 expert devices, and 4 expert x 2
tensor devices); the compiled prefill and decode steps move activations, never expert weights; MoE checkpoints
(per-expert HF tensors, compressed-tensors experts, gpt-oss fused stacks) load straight onto the mesh, each host
read one device's experts. The refusals (experts not divisible, no experts) run here, fast."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from run_worker import ROOT, _env, _result

WORKER = Path(__file__).with_name("moe_mesh_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's cases in one fresh 8-device interpreter (one start, one backend): "hlo", and "load" when torch
    and transformers (which write its checkpoints) are installed."""
    cases = ["hlo"] + (["load"] if all(importlib.util.find_spec(m) for m in ("torch", "transformers")) else [])
    p = subprocess.run([sys.executable, str(WORKER), ",".join(cases), str(tmp_path_factory.mktemp("moe_mesh"))],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=1800)
    return _result(p.stdout, p.stderr, p.returncode, f"moe_mesh_worker {','.join(cases)} (8 devices)")


@pytest.fixture(scope="module")
def hlo(results):
    return results["hlo"]


@pytest.fixture(scope="module")
def loaded(results):
    if "load" not in results:
        pytest.skip("torch and transformers write the MoE checkpoints")
    return results["load"]


SCHEMES = ["dense", "W4A16:g16", "NVFP4A16"]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["ep8", "ep4xtp2"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_tokens_on_the_mesh_equal_one_device(hlo, scheme, mesh):
    r = hlo[f"{scheme}/{mesh}"]
    assert r["out"] == r["ref"] and len(r["out"][0]) == 6
    e = hlo["config"]["experts"]
    per = 8 if mesh == "ep8" else 4
    assert r["experts"]  # every leaf of every expert stack split by experts, E / n per device
    for path, (shape, shard, spec) in r["experts"].items():
        assert shape[0] == e and shard[0] == e // per and shard[1:] == shape[1:], (path, shape, shard, spec)
    # attention split over the tensor axis only when there is one
    assert ("'tp'" in r["q_proj"]) == (mesh == "ep4xtp2"), r["q_proj"]
    if "scanned" in r:
        assert r["scanned"] == r["ref"]


@pytest.mark.slow
@pytest.mark.parametrize("step", ["decode", "prefill"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_compiled_steps_move_activations_not_expert_weights(hlo, scheme, step):
    """Every collective of the compiled step (4 expert x 2 tensor devices) is activation-sized: none carries an
    array shaped like any expert-stack leaf (global, per device, or one expert's), each is smaller than one expert's
    float weight matrix, and the whole step communicates less than that; the expert outputs are combined by one
    all-reduce of [tokens x top_k, hidden] rows per sparse layer."""
    c = hlo["config"]
    r = hlo[f"{scheme}/ep4xtp2"]
    ops = r[step]
    assert ops, "expected collectives (attention over 2 tensor devices, experts over 4)"
    weight_shapes = set()
    for shape, shard, _ in r["experts"].values():
        weight_shapes.update({tuple(shape), tuple(shard), tuple(shape[1:]), tuple(shape[1:])[::-1]})
    one_expert = c["hidden"] * c["inter"] * 4
    tokens = 2 * (1 if step == "decode" else 5)
    for op, parts, nbytes in ops:
        assert op != "all-gather" or all(tuple(s) not in weight_shapes for _, s in parts), (op, parts)
        for _, s in parts:
            assert tuple(s) not in weight_shapes, (op, parts)
        assert nbytes < one_expert, (op, parts, nbytes)
    if step == "decode":
        assert sum(n for _, _, n in ops) < one_expert, ops
    rows = [p for op, parts, _ in ops if op == "all-reduce" for p in parts
            if p[1] == [tokens * c["top_k"], c["hidden"]]]
    assert len(rows) == c["layers"], ops


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe/ep4xtp2", "w4/ep8", "w4/ep4xtp2", "nvfp4/ep4xtp2", "gpt_oss/ep4xtp2"])
def test_moe_checkpoints_load_onto_the_mesh_by_experts(loaded, name):
    """load_causal_lm(src, mesh=): parameters equal the one-device load; every expert stack (dense per-expert HF
    tensors, gpt-oss's fused [E, in, out] stacks, compressed-tensors experts' codes and scales) was read host shard
    by host shard, each shard E / n experts (never the whole stack); greedy tokens equal one device's."""
    r = loaded[name]
    assert r["same"]
    e, n = r["num_experts"], 8 if name.endswith("ep8") else 4
    assert r["stacks"], "expected expert stacks placed shard by shard"
    for shape, host in r["stacks"]:
        assert host[0] == e // n and host[1:] == shape[1:], (shape, host)
    for path, (shape, shard, _) in r["experts"].items():
        assert shard[0] == e // n, (path, shape, shard)
    if "ref" in r:
        assert r["out"] == r["ref"]


# ---- refusals (no devices needed: an abstract mesh) ---------------------------------------------------------------
def _mesh(ep, tp):
    from jax.sharding import AbstractMesh

    return AbstractMesh((ep, tp), ("ep", "tp"))


def test_experts_not_divisible_by_the_expert_parallel_size_are_refused_with_the_numbers():
    from qformats.errors import ModelError
    from qformats.models.decoder import DecoderConfig
    from qformats.models.decoder.sharding import decoder_parallel_rules

    from moe_mesh_worker import CFG

    cfg = DecoderConfig.from_hf(dict(CFG, num_experts=10))
    with pytest.raises(ModelError, match=r"expert parallel 4: .*num_experts = 10.*\(10 mod 4 = 2\)"):
        decoder_parallel_rules(cfg, _mesh(4, 2))
    assert decoder_parallel_rules(cfg, _mesh(5, 1)) is not None


def test_expert_parallel_on_a_model_without_experts_is_refused():
    from qformats.errors import ModelError
    from qformats.models.decoder import DecoderConfig
    from qformats.models.decoder.sharding import decoder_parallel_rules

    cfg = DecoderConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ModelError, match=r"expert parallel 2: the llama model has no experts"):
        decoder_parallel_rules(cfg, _mesh(2, 1))


def test_set_expert_parallel_refuses_an_indivisible_axis():
    from flax import nnx

    from qformats.errors import ModelError
    from qformats.models.decoder import CausalLM, DecoderConfig
    from qformats.models.decoder.moe import set_expert_parallel

    from moe_mesh_worker import CFG

    model = nnx.eval_shape(lambda: CausalLM(DecoderConfig.from_hf(dict(CFG, num_experts=6)), rngs=nnx.Rngs(0)))
    with pytest.raises(ModelError, match=r"6 experts do not split over 4 devices of mesh axis 'ep'"):
        set_expert_parallel(model, _mesh(4, 2), "ep")


def test_parallel_setup_checks_its_sizes_and_the_devices():
    import jax

    from converters.pipelines.mesh_load import parallel_setup
    from qformats.errors import ModelError

    n = len(jax.devices())  # JAX started: the device count is fixed now
    with pytest.raises(ModelError, match=r"expert parallel: expected a positive device count, got 0"):
        parallel_setup(1, 0)
    with pytest.raises(ModelError, match=rf"expert parallel {n + 1} x tensor parallel 2: .*expected at least "
                                         rf"{2 * (n + 1)} cpu devices, found {n}"):
        parallel_setup(2, n + 1)
    assert parallel_setup(1, 1).axis_names == ("tp",)
