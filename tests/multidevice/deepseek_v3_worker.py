"""Expert-parallel deepseek_v3 on N forced CPU devices (run in a fresh interpreter by
test_expert_parallel_deepseek_v3.py): prints RESULT {json} with greedy tokens on the mesh and on one device, and the
layout of a routed-expert stack."""

import json
import sys
from pathlib import Path


def main(n: int):
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from qformats.models.decoder import expert_parallel_rules, quantization_rules
    from qformats.models.generate import generate
    from qformats.nn import quantize_model
    from qformats.nn.sharding import shard_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "qformats" / "models" / "decoder"))
    import test_deepseek_v3 as ds

    hf = ds.hf_model(ds.TINY)
    prompt = jnp.asarray(ds.IDS[:, :5])
    out = {}
    for scheme in ("W4A16:g16",):  # packed stacks (the dense case is the moe worker's)
        ref, model = ds.flax_model(hf), ds.flax_model(hf)
        if scheme != "dense":
            quantize_model(ref, quantization_rules(scheme))
            quantize_model(model, quantization_rules(scheme))
        shard_model(model, Mesh(np.array(jax.devices()), ("ep",)), expert_parallel_rules(model.config, "ep"))
        leaf = jax.tree.leaves(model.model.layers[1].mlp.experts.gate_proj.kernel.get_value())[0]
        out[scheme] = dict(ref=np.asarray(generate(ref, prompt, 8)).tolist(),
                           out=np.asarray(generate(model, prompt, 8)).tolist(), devices=len(jax.devices()),
                           spec=str(leaf.sharding.spec), shard=list(leaf.addressable_shards[0].data.shape))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]))
