"""Expert-parallel MoE decoder on N forced CPU devices (run in a fresh interpreter by test_expert_parallel.py):
prints RESULT {json} with greedy tokens on the mesh and on one device, and each expert stack's layout."""

import json
import sys


def main(n: int, workdir: str):
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.decoder import expert_parallel_rules, quantization_rules
    from qformats.models.generate import generate
    from qformats.nn import QExperts, quantize_model
    from qformats.nn.sharding import shard_model

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "qformats" / "models" / "decoder"))
    from moe_tiny import write_checkpoint

    src = f"{workdir}/src"
    write_checkpoint("qwen3_moe", src)
    prompt = np.random.RandomState(0).randint(0, 256, (2, 5)).astype(np.int32)
    out = {}
    for scheme in ("dense", "W4A16:g16"):
        ref, _, _ = load_causal_lm(src, tokenizer=False)
        model, _, _ = load_causal_lm(src, tokenizer=False)
        if scheme != "dense":
            quantize_model(ref, quantization_rules(scheme))
            quantize_model(model, quantization_rules(scheme))
        mesh = Mesh(np.array(jax.devices()), ("ep",))
        shard_model(model, mesh, expert_parallel_rules(model.config, "ep"))
        stacks = {}
        for p, m in nnx.iter_modules(model):
            if isinstance(m, QExperts) or type(m).__name__ == "Experts":
                k = m.kernel.get_value()
                leaf = jax.tree.leaves(k)[0]
                stacks["/".join(map(str, p))] = [str(leaf.sharding.spec), len(leaf.addressable_shards),
                                                 list(leaf.addressable_shards[0].data.shape)]
        out[scheme] = dict(ref=np.asarray(generate(ref, prompt, 6)).tolist(),
                           out=np.asarray(generate(model, prompt, 6)).tolist(), stacks=stacks, devices=len(jax.devices()))
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
