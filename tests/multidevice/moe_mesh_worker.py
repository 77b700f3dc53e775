"""Expert parallelism on 8 forced CPU devices, run in a fresh interpreter by test_expert_parallel_mesh.py:

    python tests/multidevice/moe_mesh_worker.py CASE[,CASE...] WORKDIR

prints RESULT {case: {json}} for the cases asked, run one after the other in the one interpreter. Cases: "hlo" (a
random qwen3_moe decoder, float / W4A16 / NVFP4A16, on an 8-way expert mesh and on 4 experts x 2 tensor devices:
greedy tokens against one device, the collectives of the compiled prefill and decode steps), "load" (2-layer
checkpoints written by transformers -- qwen3_moe dense and compressed-tensors, gpt_oss with fused expert tensors --
loaded straight onto the mesh: parameters and tokens against the one-device load, and the
host shard of every expert stack read).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DEVICES = 8
# one (sparse) layer: the layouts and the collectives are per layer (a second one adds compile time to each of the
# 16 programs of case_hlo, not a layout); the checkpoints of case_load keep 2 layers (sparse + dense, sliding + full
# attention)
CFG = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64,
           intermediate_size=128, moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-6)
OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "collective-broadcast")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(OPS) + r")(-start)?\(", re.M)
SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
ITEMSIZE = dict(pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8,
                f8e4m3fn=1, f8e5m2=1)


def collectives(hlo: str):
    """[(op, [[dtype, shape], ...], bytes)] of every collective of a compiled HLO module's text (tuple-typed ones
    -- XLA combines collectives -- with every element; async "-start" ops by their result type)."""
    out = []
    for m in INSTR.finditer(hlo):
        parts = [(d, [int(x) for x in s.split(",") if x]) for d, s in SHAPE.findall(m.group(1))]
        nbytes = sum(ITEMSIZE.get(d, 4) * _prod(s) for d, s in parts)
        out.append((m.group(2), parts, nbytes))
    return out


def _prod(s):
    n = 1
    for x in s:
        n *= x
    return n


def _meshes(jax):
    from converters.pipelines.mesh_load import parallel_setup

    jax.config.update("jax_num_cpu_devices", DEVICES)
    return {"ep8": parallel_setup(1, 8), "ep4xtp2": parallel_setup(2, 4)}


def _expert_leaves(model):
    """{path: [global shape, per-device shard shape, spec]} of every leaf of every expert stack."""
    import jax
    from flax import nnx

    from qformats.nn.experts import Experts, QExperts

    out = {}
    for p, m in nnx.iter_modules(model):
        if isinstance(m, (Experts, QExperts)):
            for i, leaf in enumerate(jax.tree.leaves(m.kernel.get_value())):
                out[f"{'/'.join(map(str, p))}#{i}"] = [list(leaf.shape), list(leaf.addressable_shards[0].data.shape),
                                                       str(leaf.sharding.spec)]
    return out


def case_hlo(workdir: str):
    import jax
    meshes = _meshes(jax)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules
    from qformats.models.decoder.scan import scan_layers
    from qformats.models.decoder.sharding import decoder_parallel_rules
    from qformats.models.generate import generate
    from qformats.nn import quantize_model
    from qformats.nn.sharding import shard_model

    cfg = DecoderConfig.from_hf(CFG)
    ids = jnp.array([[1, 5, 9, 33, 2], [7, 7, 100, 3, 4]], jnp.int32)
    res = {}
    for scheme in ("dense", "W4A16:g16", "NVFP4A16"):
        def build():
            m = CausalLM(cfg, rngs=nnx.Rngs(0))
            if scheme != "dense":
                quantize_model(m, quantization_rules(scheme))
            return m
        ref = np.asarray(generate(build(), ids, 6)).tolist()
        for name, mesh in meshes.items():
            model = shard_model(build(), mesh, decoder_parallel_rules(cfg, mesh))
            r = dict(ref=ref, out=np.asarray(generate(model, ids, 6)).tolist(), experts=_expert_leaves(model),
                     q_proj=str(model.model.layers[0].self_attn.q_proj.kernel.get_value().codes.sharding.spec
                                if scheme != "dense" else
                                model.model.layers[0].self_attn.q_proj.kernel.get_value().sharding.spec))
            if name == "ep4xtp2":
                gd, st = nnx.split(model)

                def prefill(s, i):
                    m = nnx.merge(gd, s)
                    return m(i, m.init_cache(2, 8))

                def decode(s, c, t):
                    return nnx.merge(gd, s)(t, c)

                compiled = jax.jit(prefill).lower(st, ids).compile()  # compiled once: run and read
                _, cache = compiled(st, ids)
                r["prefill"] = collectives(compiled.as_text())
                r["decode"] = collectives(jax.jit(decode).lower(st, cache, ids[:, :1]).compile().as_text())
                if scheme == "W4A16:g16":  # the same layout with the layers scanned
                    r["scanned"] = np.asarray(generate(scan_layers(model), ids, 6)).tolist()
            res[f"{scheme}/{name}"] = r
    res["config"] = dict(hidden=cfg.hidden_size, inter=cfg.moe.intermediate_size, experts=cfg.moe.num_experts,
                         top_k=cfg.moe.top_k, vocab=cfg.vocab_size, layers=cfg.num_layers)
    return res


def case_load(workdir: str):
    import jax
    meshes = _meshes(jax)
    import numpy as np
    from flax import nnx

    import converters.pipelines.mesh_load as mesh_load
    from converters.pipelines.causal_lm import load_causal_lm
    from converters.pipelines.quantize_checkpoint import quantize_checkpoint
    from qformats.models.generate import generate

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "qformats" / "models" / "decoder"))
    from moe_tiny import write_checkpoint

    wd = Path(workdir)
    write_checkpoint("qwen3_moe", wd / "qwen3_moe", num_hidden_layers=2)  # layer 0 sparse, layer 1 dense
    write_checkpoint("gpt_oss", wd / "gpt_oss", num_hidden_layers=2)  # a sliding and a full attention layer
    quantize_checkpoint(wd / "qwen3_moe", wd / "w4", "W4A16:g16", progress=False)
    quantize_checkpoint(wd / "qwen3_moe", wd / "nvfp4", "NVFP4A16", progress=False)
    placed = []  # (global shape, host shard shape) of every array placed shard by shard
    inner = mesh_load.place

    def recording_place(shape, dtype, sharding, read, stats=None):
        def rec(index):
            a = read(index)
            placed.append((list(shape), list(np.shape(a))))
            return a
        return inner(shape, dtype, sharding, rec, stats)

    mesh_load.place = recording_place
    ids = np.random.RandomState(0).randint(0, 256, (2, 5)).astype(np.int32)
    res = {}
    for name, tokens in (("qwen3_moe", False), ("w4", True), ("nvfp4", False), ("gpt_oss", True)):
        ref, _, _ = load_causal_lm(wd / name, tokenizer=False)
        want = jax.tree.leaves(nnx.state(ref))
        for mname in (("ep4xtp2",) if name != "w4" else ("ep8", "ep4xtp2")):
            placed.clear()
            model, _, _ = load_causal_lm(wd / name, tokenizer=False, mesh=meshes[mname])
            got = jax.tree.leaves(nnx.state(model))
            e = model.config.moe.num_experts
            stacks = sorted({json.dumps([s, h]) for s, h in placed if len(s) >= 2 and s[0] == e})
            r = dict(same=len(got) == len(want) and all(np.array_equal(np.asarray(a), np.asarray(b))
                                                        for a, b in zip(want, got)),
                     experts=_expert_leaves(model), stacks=[json.loads(x) for x in stacks], num_experts=e)
            if tokens:
                r["ref"] = np.asarray(generate(ref, ids, 6)).tolist()
                r["out"] = np.asarray(generate(model, ids, 6)).tolist()
            res[f"{name}/{mname}"] = r
    return res


if __name__ == "__main__":
    cases, wd = sys.argv[1].split(","), Path(sys.argv[2])
    res = {}
    for case in cases:  # one interpreter, one 8-device backend, for every case asked
        (wd / case).mkdir(parents=True, exist_ok=True)
        res[case] = {"hlo": case_hlo, "load": case_load}[case](str(wd / case))
    print("RESULT " + json.dumps(res))
