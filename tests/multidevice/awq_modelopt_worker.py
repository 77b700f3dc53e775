"""Worker (a fresh interpreter with N CPU devices): tiny AutoAWQ and ModelOpt NVFP4 checkpoints (the fixtures of
tests/converters/formats) loaded onto an N-device tensor-parallel mesh and on one device; prints RESULT <json>: whether
every parameter is equal, how many are split, how many projections are packed, and the greedy tokens of both."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "converters" / "formats"))


def main(n: int, workdir: str):
    from converters.pipelines.mesh_load import tensor_parallel_setup

    mesh = tensor_parallel_setup(n)
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    import test_gptq_awq as GA
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.generate import generate
    from test_modelopt import _write_modelopt

    wd = Path(workdir)
    dense = wd / "dense"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **GA.TINY)).to(
        torch.float32).save_pretrained(dense)
    GA.make_awq(wd / "awq", dense)
    srcs = {"awq": wd / "awq", "modelopt": _write_modelopt(wd / "modelopt")}
    ids = np.array([[1, 5, 17, 42, 3]], np.int32)
    res = {}
    for name, src in srcs.items():
        ref, _, _ = load_causal_lm(src, tokenizer=False)
        got, _, _ = load_causal_lm(src, mesh=mesh, tokenizer=False)
        a = jax.tree.leaves(nnx.state(ref, nnx.Param))
        b = jax.tree.leaves(nnx.state(got, nnx.Param))
        res[name] = dict(
            same=len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                          and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)),
            sharded=sum(1 for y in b if not y.sharding.is_fully_replicated),
            packed=sum(1 for _, m in nnx.iter_modules(got) if type(m).__name__ == "QLinear"),
            ref=np.asarray(generate(ref, ids, 6)).tolist(), out=np.asarray(generate(got, ids, 6)).tolist())
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
