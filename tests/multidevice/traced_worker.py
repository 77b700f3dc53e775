"""Traced (any-layer) matmul weights on an 8-device CPU mesh, in a fresh interpreter (the device count is set by
XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts).

    python tests/multidevice/traced_worker.py

Quantizes the third-party-style models of tests/qformats/nn/gemma_style.py through the traced path (NNX
`NnxCustom`: nnx.scan stack, custom ParallelLinear / einsum layers; linen `Gemma`), computes the jitted forward
on one device, places every packed leaf of every MatmulWeight on a mesh of 8 devices with a NamedSharding (the
N axis of its codes and scales split 8 ways, stacked layer axes whole; everything else replicated), runs the
same jitted forward there and prints one JSON line "RESULT {...}" for tests/multidevice/test_traced_sharded.py.
"""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "qformats", "nn"))


NNX_SCHEMES = ("W4A16", "FP8_DYNAMIC")  # FP8_DYNAMIC: activations quantized per token inside the sharded forward
LINEN_SCHEMES = ("NVFP4A16", "FP8_E4M3")  # weight-only: gemma's attn_vec einsum contracts two axes


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gemma_style import Gemma, NnxCustom
    from qformats.nn import Rule, quantize_linen, quantize_model
    from qformats.nn.traced import MatmulWeight

    def rel(a, b) -> float:
        a = np.asarray(a, np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    mesh = Mesh(np.array(jax.devices()), ("tp",))
    is_mw = lambda v: isinstance(v, MatmulWeight)  # noqa: E731

    def place(tree):
        """MatmulWeights' leaves split along their N axis (axis -2 of codes and scales), the rest replicated."""
        shards = []

        def one(v):
            if is_mw(v):
                def leaf(a):
                    if a.ndim >= 2 and a.shape[-2] % 8 == 0:
                        spec = P(*([None] * (a.ndim - 2) + ["tp", None]))
                        shards.append([list(a.shape), list(a.sharding.shard_shape(a.shape))
                                       if hasattr(a, "sharding") else None])
                    else:
                        spec = P()
                    out = jax.device_put(a, NamedSharding(mesh, spec))
                    if spec != P():
                        shards[-1][1] = list(out.sharding.shard_shape(out.shape))
                    return out
                return jax.tree.map(leaf, v)
            return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), v)

        return jax.tree.map(one, tree, is_leaf=is_mw), shards

    out = {"devices": len(jax.devices())}
    tokens = jnp.arange(16).reshape(2, 8) % 64
    for scheme in NNX_SCHEMES:
        # NNX: nnx.scan stack of custom layers; the tied embedding stays float
        model = NnxCustom(vocab=64, d=128, hidden=256, layers=2)
        quantize_model(model, [Rule("embed", None), Rule(".*", scheme)], example=tokens)
        fwd = nnx.jit(lambda m, t: m(t))
        ref = np.asarray(fwd(model, tokens))
        graphdef, state = nnx.split(model)
        state, shards = place(state)
        sharded = nnx.merge(graphdef, state)
        got = fwd(sharded, tokens)
        n_mw = sum(1 for v in jax.tree.leaves(state, is_leaf=is_mw) if is_mw(v))
        out[f"nnx {scheme}"] = {"equal": bool(np.array_equal(np.asarray(got), ref)), "rel": rel(got, ref),
                                "out_devices": len(got.sharding.device_set), "matmul_weights": n_mw,
                                "shards": shards}
    for scheme in LINEN_SCHEMES:
        # linen: Gemma-style einsum modules, blocks in a list
        g = Gemma(vocab_size=64, embed_dim=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                  hidden_dim=256)
        params = g.init(jax.random.key(0), tokens)
        qmod, qparams = quantize_linen(g, params, [Rule("embedder/.*", None), Rule(".*", scheme)], tokens)
        apply = jax.jit(qmod.apply)
        ref = np.asarray(apply(qparams, tokens))
        qs, shards = place(qparams)
        got = apply(qs, tokens)
        n_mw = sum(1 for v in jax.tree.leaves(qs, is_leaf=is_mw) if is_mw(v))
        out[f"linen {scheme}"] = {"equal": bool(np.array_equal(np.asarray(got), ref)), "rel": rel(got, ref),
                                  "out_devices": len(got.sharding.device_set), "matmul_weights": n_mw,
                                  "shards": shards}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
