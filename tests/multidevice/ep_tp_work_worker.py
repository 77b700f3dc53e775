"""Expert x tensor parallel work split on 4 forced CPU devices, run in a fresh interpreter by test_ep_tp_work.py:

    python tests/multidevice/ep_tp_work_worker.py

prints RESULT {json}: for a tiny random MoE block (float and W4A16:g16), per mesh (one device, 2 expert devices,
2 expert x 2 tensor devices) and per path (gathered decode rows, sorted + grouped prefill rows), the block's output
and how many expert rows each projection computed over the whole mesh (counted by a host callback inside the row
products: a row that a device skips is not counted).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from qformats.models.decoder.moe import MoEBlock, MoEConfig, set_dispatch, set_expert_parallel  # noqa: E402
from qformats.nn import Rule, quantize_model  # noqa: E402
from qformats.nn import experts as X  # noqa: E402

HIDDEN, INTER, E, K = 32, 16, 8, 2
COUNT = []


def _counted():
    """Wrap the row products of the expert stacks with a host callback adding the rows each call computed."""
    grouped = X._ExpertOps.grouped

    def counted(row):
        def counted_row(self, xm, e, dtype):
            jax.debug.callback(lambda: COUNT.append(1))
            return row(self, xm, e, dtype)
        return counted_row

    def counted_grouped(self, x, group_sizes, method="auto", tile=None):
        jax.debug.callback(lambda n: COUNT.append(int(n)), jnp.sum(group_sizes))
        return grouped(self, x, group_sizes, method, tile)

    # float stacks (`_ExpertOps._row`) and packed ones (`QExperts._row`, PTQ: it does not call the former)
    X._ExpertOps._row, X.QExperts._row = counted(X._ExpertOps._row), counted(X.QExperts._row)
    X._ExpertOps.grouped = counted_grouped


def main():
    _counted()
    devs = jax.devices()
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    meshes = {"ep2": Mesh(np.array(devs[:2]), ("ep",)), "ep2xtp2": Mesh(np.array(devs).reshape(2, 2), ("ep", "tp"))}

    def placed(st, mesh):  # expert stacks split by experts (leading axis E), the rest replicated
        if mesh is None:
            return st
        return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("ep") if a.ndim and a.shape[0] == E
                                                                       else P())), st)
    out = {}
    for scheme in ("float", "W4A16:g16"):
        block = MoEBlock(MoEConfig(E, K, INTER, norm_topk_prob=True), HIDDEN, dtype=jnp.float32,
                         param_dtype=jnp.float32, rngs=nnx.Rngs(0))
        if scheme != "float":
            quantize_model(block, [Rule(r"experts/(gate|up|down)_proj", scheme)])
        for path, tokens in (("gathered", 3), ("grouped", 12)):
            x = jax.random.normal(jax.random.key(1), (1, tokens, HIDDEN), jnp.float32)
            set_dispatch(block, path, "tiled")
            for mesh_name in ("one", "ep2", "ep2xtp2"):
                set_expert_parallel(block, meshes.get(mesh_name), None if mesh_name == "one" else "ep")
                g, st = nnx.split(block)
                st = placed(st, meshes.get(mesh_name))
                fn = jax.jit(lambda s, x: nnx.merge(g, s)(x))
                COUNT.clear()
                y = jax.block_until_ready(fn(st, x))
                jax.effects_barrier()
                out[f"{scheme}/{path}/{mesh_name}"] = dict(y=np.asarray(y).tolist(), rows=sum(COUNT),
                                                           expected=3 * tokens * K)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
