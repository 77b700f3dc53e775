"""qformats.sharding: partition specs of packed leaves, logical rules, typed errors (one device; the multi-device
runs are in tests/multidevice)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qformats.errors import ModelError
from qformats.formats import IntFormat
from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules, tensor_parallel_rules
from qformats.nn import quantize_model
from qformats.presets import parse_scheme
from qformats.quantize import quantize
from qformats.schemes import QuantScheme
from qformats.sharding import ShardingRules, logical_spec, qarray_specs, spec_for
from qformats.nn.sharding import param_bytes_per_device, param_shardings, shard_model

MESH8 = AbstractMesh((8,), ("tp",))
COL, ROW = P(None, "tp"), P("tp", None)  # a Flax kernel [K, N]: output channels / contraction axis split


def _q(preset, k=256, n=64):
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32)
    return quantize(w, parse_scheme(preset).weights, 0)


def _specs(q):
    return (q.codes, q.scale, q.zero_point, q.global_scale)


@pytest.mark.parametrize("preset, col, row", [
    # W4A16 g16: codes [N, K/2], scale [N, K/16]
    ("W4A16:g16", (P("tp", None), P("tp", None), None, None), (P(None, "tp"), P(None, "tp"), None, None)),
    # NVFP4: + global scale [1], replicated
    ("NVFP4A16", (P("tp", None), P("tp", None), None, P(None)), (P(None, "tp"), P(None, "tp"), None, P(None))),
    # asymmetric int4 groups: the zero point lies like the scale
    ("W4A16_ASYM:g32", (P("tp", None), P("tp", None), P("tp", None), None),
     (P(None, "tp"), P(None, "tp"), P(None, "tp"), None)),
    # channel scales [N, 1]: split with the output channels, whole along K
    ("FP8_DYNAMIC", (P("tp", None), P("tp", None), None, None), (P(None, "tp"), P(None, None), None, None)),
    # MX: E8M0 scales per 32 along K
    ("MXFP4A16", (P("tp", None), P("tp", None), None, None), (P(None, "tp"), P(None, "tp"), None, None)),
])
def test_qarray_specs_column_and_row_parallel(preset, col, row):
    q = _q(preset)
    assert _specs(qarray_specs(q, COL, MESH8)) == col
    assert _specs(qarray_specs(q, ROW, MESH8)) == row
    assert _specs(qarray_specs(q, P(), MESH8)) == tuple(
        None if a is None else P(*(None,) * a.ndim) for a in _specs(q))


def test_qarray_specs_block_scales_follow_blocks():
    q = _q("FP8_BLOCK", k=2048, n=1024)  # scale [N/128, K/128] = [8, 16]
    assert _specs(qarray_specs(q, COL, MESH8)) == (P("tp", None), P("tp", None), None, None)
    assert _specs(qarray_specs(q, ROW, MESH8)) == (P(None, "tp"), P(None, "tp"), None, None)
    with pytest.raises(ModelError, match=r"layer/x: .*blocks of 128.*split 8 ways"):
        qarray_specs(_q("FP8_BLOCK", k=1024, n=512), COL, MESH8, "layer/x")  # 512 / 8 = 64 rows: part of a block


def test_row_split_that_cuts_a_group_is_a_typed_error_naming_the_layer():
    q = _q("W4A16:g64", k=256)  # 256 / 8 = 32 columns per device: half a group
    with pytest.raises(ModelError, match=r"^model/layers/0/mlp/down_proj/kernel: .*32 elements per device, not a "
                                         r"whole number of groups of 64"):
        qarray_specs(q, ROW, MESH8, "model/layers/0/mlp/down_proj/kernel")


def test_row_split_that_cuts_a_packed_byte_is_a_typed_error():
    w = jax.random.normal(jax.random.key(1), (24, 16), jnp.float32)
    scheme = QuantScheme(IntFormat(3, True), "channel")
    q = quantize(w, scheme, 0)  # 3-bit codes: 24 / 8 = 3 codes = 9 bits per device
    with pytest.raises(ModelError, match=r"proj: .*3 codes of 3 bits per device, which is not a whole number of "
                                         r"packed bytes"):
        qarray_specs(q, ROW, MESH8, "proj")
    assert _specs(qarray_specs(q, ROW, AbstractMesh((3,), ("tp",)))) == (P(None, "tp"), P(None, None), None, None)


def test_uneven_output_split_is_a_typed_error():
    with pytest.raises(ModelError, match=r"lm_head/kernel: output dimension 0 of \(256, 60\) of size 60 cannot "
                                         r"be split 8 ways"):
        qarray_specs(_q("W4A16:g16", n=60), COL, MESH8, "lm_head/kernel")


def _cfg(heads=16, kv=8, **kw):
    return DecoderConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=heads, num_kv_heads=kv, head_dim=16, **kw)


def test_decoder_rules_are_the_megatron_layout():
    rules = tensor_parallel_rules(_cfg())
    lp = "model/layers/1"
    want = {f"{lp}/self_attn/q_proj/kernel": COL, f"{lp}/self_attn/k_proj/kernel": COL,
            f"{lp}/self_attn/v_proj/kernel": COL, f"{lp}/mlp/gate_proj/kernel": COL, f"{lp}/mlp/up_proj/kernel": COL,
            f"{lp}/self_attn/o_proj/kernel": ROW, f"{lp}/mlp/down_proj/kernel": ROW,
            "model/embed_tokens/embedding": ROW, "lm_head/kernel": COL,
            f"{lp}/input_layernorm/weight": P(None), "model/norm/weight": P(None)}
    for path, spec in want.items():
        assert spec_for(path, (256, 256) if spec != P(None) else (64,), MESH8, rules) == spec, path
    assert logical_spec(("embed", "mlp"), rules) == COL
    assert spec_for("something/else", (3, 5), MESH8, rules) == P()  # no rule: replicated


def test_heads_that_the_mesh_cannot_divide_name_the_layer():
    cfg = _cfg(heads=16, kv=4)  # 4 KV heads on 8 devices: half a head each
    model = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(ModelError, match=r"^model/layers/0/self_attn/k_proj/kernel: dimension 1 \('kv_heads'\) of "
                                         r"size 64 cannot be split 8 ways into whole units of 16"):
        param_shardings(model, MESH8, tensor_parallel_rules(cfg))


def test_rules_validate_their_data():
    with pytest.raises(ModelError, match=r"pattern '\(' is not a valid regex"):
        ShardingRules((("(", ("embed",)),), ())
    rules = ShardingRules(((r"w", ("a", "b")),), (("a", "tp"),))
    with pytest.raises(ModelError, match=r"^w: sharding rule gives 2 logical axes \('a', 'b'\) for a parameter of "
                                         r"shape \(4,\)"):
        spec_for("w", (4,), MESH8, rules)
    with pytest.raises(ModelError, match=re.escape("mesh axes ['tp'] are not axes of the mesh")):
        spec_for("w", (8, 8), AbstractMesh((8,), ("dp",)), rules)


@pytest.mark.slow
def test_shard_model_on_one_device_keeps_outputs_and_places_every_param():
    cfg = _cfg()
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    quantize_model(model, quantization_rules(parse_scheme("W4A16:g16")))
    ids = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    forward = nnx.jit(lambda m, x: m(x)[0])  # one program (jitted, not dispatched op by op), before and after
    ref = forward(model, ids)
    shard_model(model, mesh, tensor_parallel_rules(cfg))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh for a in leaves)
    np.testing.assert_array_equal(np.asarray(forward(model, ids)), np.asarray(ref))
    (dev, nbytes), = param_bytes_per_device(model).items()
    assert nbytes == sum(a.nbytes for a in leaves)


@pytest.mark.parametrize("axes, rules", [
    (("batch", "length", "heads", "features"), (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"))),
    (("embed", "mlp"), (("mlp", "tp"), ("embed", None))),
    (("embed", None, "kv_heads"), (("kv_heads", ("tp", "dp")), ("embed", "dp"))),
    ((None, "vocab"), (("vocab", "tp"), ("vocab", "dp"))),
    (("a", "b"), ()),
])
def test_logical_spec_is_flax_priority_rule(axes, rules):
    from flax.linen import logical_to_mesh_axes

    assert logical_spec(axes, ShardingRules((), rules)) == logical_to_mesh_axes(axes, rules)
