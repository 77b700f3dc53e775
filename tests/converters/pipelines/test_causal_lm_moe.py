"""load_causal_lm on mixture-of-experts checkpoints: dense HF (per-expert names, gpt-oss fused stacks) and
compressed-tensors (compressed by compressed-tensors itself, every expert a quantized Linear): experts stacked into
one packed QArray per projection, each expert's weight exactly compressed-tensors' decompression; generate via the CLI."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))  # ct_oracle
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "qformats" / "models" / "decoder"))  # moe_tiny

import ct_oracle as O  # noqa: E402
from moe_tiny import ids, write_checkpoint  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm, save_causal_lm  # noqa: E402
from flax import nnx  # noqa: E402
from qformats.errors import CheckpointError  # noqa: E402
from qformats.models.decoder import quantization_rules  # noqa: E402
from qformats.nn import Experts, QExperts, quantize_model, quantized_layers  # noqa: E402
from qformats.quantize import dequantize  # noqa: E402

IDS = ids()
fwd = nnx.jit(lambda m, x: m(x)[0])


def disk_layout_module(state):
    """A torch module tree with one Linear per on-disk `*.weight` of a projection (routers included) and the
    other tensors as buffers, so compressed-tensors quantizes every expert as the Linear it is on disk."""
    root = torch.nn.Module()
    for name, t in state.items():
        *mods, local = name.split(".")
        node = root
        for p in mods[:-1]:
            if not hasattr(node, p):
                node.add_module(p, torch.nn.Module())
            node = getattr(node, p)
        leaf = mods[-1]
        is_linear = local == "weight" and t.ndim == 2 and not leaf.endswith("embed_tokens")
        bias = state.get(".".join(mods) + ".bias")
        if is_linear:
            lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=bias is not None)
            with torch.no_grad():
                lin.weight.copy_(t)
                if bias is not None:
                    lin.bias.copy_(bias)
            node.add_module(leaf, lin)
        elif local == "bias" and f"{'.'.join(mods)}.weight" in state and state[f"{'.'.join(mods)}.weight"].ndim == 2:
            continue  # the Linear's own bias
        else:
            if not hasattr(node, leaf):
                node.add_module(leaf, torch.nn.Module())
            getattr(node, leaf).register_buffer(local, t.clone())
    return root


@pytest.mark.parametrize("arch, preset", [("qwen3_moe", "W4A16"), ("mixtral", "NVFP4A16")])
def test_compressed_tensors_moe_checkpoint_loads_bit_exactly(arch, preset, tmp_path):
    dense = tmp_path / "dense"
    write_checkpoint(arch, dense, intermediate_size=128, moe_intermediate_size=64) if arch == "qwen3_moe" else \
        write_checkpoint(arch, dense, intermediate_size=64)
    hf_cfg = json.loads((dense / "config.json").read_text())
    state = load_file(str(dense / "model.safetensors"))
    tree = disk_layout_module(state)
    routers = r"re:.*(mlp\.gate|block_sparse_moe\.gate)$"
    group = 32 if preset == "W4A16" else None
    scheme = O.preset_name_to_scheme(preset, ["Linear"])
    if group:  # hidden 64: W4A16's group of 128 would not divide it
        scheme.weights.group_size = group
    cfg = O.QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", routers])
    O.apply_quantization_config(tree, cfg)
    for _, m in tree.named_modules():
        sch = getattr(m, "quantization_scheme", None)
        if sch is not None and sch.weights is not None:
            O.weight_qparams(m, sch.weights)
    out = tmp_path / "ct"
    O.save_compressed(tree, out, base_config=hf_cfg)
    written = load_file(str(out / "model.safetensors"))
    stem = "model.layers.0." + ("block_sparse_moe.experts.3.w1" if arch == "mixtral" else "mlp.experts.3.gate_proj")
    assert f"{stem}.weight_packed" in written and f"{stem}.weight_scale" in written

    model, _, _ = load_causal_lm(out, tokenizer=False)
    ref = O.decompress_dir(out)  # compressed-tensors' own decompression, module -> [out, in]
    stacks = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model) if isinstance(m, QExperts)}
    assert len(stacks) == 3 * (3 if arch == "mixtral" else 2)  # 3 projections x sparse layers (qwen3: 1 dense)
    assert not any(isinstance(m, Experts) for _, m in nnx.iter_modules(model))
    for path, q in stacks.items():
        for e in range(q.num_experts):
            proj = path.rsplit("/", 1)
            name = f"{proj[0].replace('/', '.')}.{e}.{proj[1]}"
            r = ref[name]  # compressed-tensors decompresses into its own dtype (bfloat16 for NVFP4): compare in it
            dt = {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16, torch.float32: jnp.float32}[r.dtype]
            w = np.asarray(dequantize(q.expert_weight(e), dt).astype(jnp.float32)).T
            np.testing.assert_array_equal(w, r.float().numpy(), err_msg=name)
    # the packed model runs; a dense model on the dequantized weights gives the same logits
    dense_model, _, _ = load_causal_lm(dense, tokenizer=False)
    for path, q in quantized_layers(model).items():
        node = dense_model
        for p in path.split("/"):
            node = node[int(p)] if p.isdigit() else getattr(node, p)
        if isinstance(q, QExperts):
            w = jnp.stack([dequantize(q.expert_weight(e), jnp.float32) for e in range(q.num_experts)])
        else:
            w = dequantize(q.kernel.get_value(), jnp.float32)
        node.kernel.set_value(w)
    np.testing.assert_allclose(np.asarray(fwd(model, jnp.asarray(IDS))), np.asarray(fwd(dense_model, jnp.asarray(IDS))),
                               rtol=0, atol=1e-5)


def test_dense_moe_checkpoints_load_and_round_trip_through_save(tmp_path):
    """Per-expert names stack on load; a packed MoE model saved by save_causal_lm writes per-expert compressed
    modules that load back to the same packed stacks."""
    src = tmp_path / "src"
    write_checkpoint("qwen2_moe", src)
    model, hf_cfg, _ = load_causal_lm(src, tokenizer=False)
    quantize_model(model, quantization_rules("W4A16:g16"))
    dst = save_causal_lm(model, tmp_path / "out", hf_cfg, ignore=["lm_head"])
    names = set(load_file(str(Path(dst) / "model.safetensors")))
    assert "model.layers.0.mlp.experts.9.down_proj.weight_packed" in names
    assert "model.layers.0.mlp.gate.weight" in names  # the router stays dense
    back, _, _ = load_causal_lm(dst, tokenizer=False)
    a = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model) if isinstance(m, QExperts)}
    b = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(back) if isinstance(m, QExperts)}
    assert set(a) == set(b) and a
    for p in a:
        for u, v in zip(jax.tree.leaves(a[p].kernel.get_value()), jax.tree.leaves(b[p].kernel.get_value())):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=p)
    np.testing.assert_array_equal(np.asarray(fwd(model, jnp.asarray(IDS))), np.asarray(fwd(back, jnp.asarray(IDS))))


def test_incomplete_expert_stack_is_refused(tmp_path):
    src = tmp_path / "src"
    write_checkpoint("mixtral", src)
    from safetensors.numpy import load_file as np_load, save_file as np_save

    t = np_load(str(src / "model.safetensors"))
    del t["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    np_save(t, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 missing: model.layers.1.block_sparse_moe.experts.5.w2.weight"):
        load_causal_lm(src, tokenizer=False)


def test_cli_generate_on_a_tiny_moe_checkpoint(tmp_path, capsys):
    """`qformats generate` (python -m converters.cli) on a gpt-oss checkpoint gives the library's greedy tokens."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from converters.cli import main
    from qformats.models.generate import generate

    src = tmp_path / "src"
    write_checkpoint("gpt_oss", src)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w255"}))
    rc = main(["generate", str(src), "--prompt", "w5 w6 w7", "--max-new-tokens", "6", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    model, _, _ = load_causal_lm(src, tokenizer=False)
    want = [int(t) for t in np.asarray(generate(model, np.asarray([5, 6, 7], np.int32), 6, eos_id=255))]
    got = json.loads(out)["tokens"]
    assert got == want[:len(got)] and got
