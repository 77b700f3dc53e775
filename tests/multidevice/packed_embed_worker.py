"""Worker (a fresh interpreter with N CPU devices): tiny GGUF models whose token embedding is block-quantized (tied
Q8_0, tied Q4_1, untied Q8_0 with a Q8_0 lm_head) loaded onto an N-device mesh and on one device; prints RESULT
<json> comparing the packed embeddings, their lookups, the logits and greedy tokens."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "converters" / "pipelines"))


def main(n: int, workdir: str):
    from converters.pipelines.mesh_load import tensor_parallel_setup

    mesh = tensor_parallel_setup(n)
    import jax
    import numpy as np
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from gguf_mixed import mixed_gguf
    from qformats.models.decoder import PackedEmbed
    from qformats.models.generate import generate

    wd = Path(workdir)
    types = {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_1", "ffn_down": "Q8_0", "output": "Q8_0"}
    cases = {"tied_q8_0": dict(embed="Q8_0", tied=True), "tied_q4_1": dict(embed="Q4_1", tied=True),
             "untied_q8_0": dict(embed="Q8_0", tied=False)}
    ids = np.array([[1, 5, 17, 99, 200, 3, 263, 0]], np.int32)
    res = {}
    for name, kw in cases.items():
        src = mixed_gguf(wd / f"{name}.gguf", types, hidden=128, heads=8, kv_heads=4, inter=256, layers=1, vocab=264,
                         **kw)
        ref, _, _ = load_causal_lm(src, tokenizer=False)
        got, _, _ = load_causal_lm(src, mesh=mesh, tokenizer=False)
        e_ref, e_got = ref.model.embed_tokens, got.model.embed_tokens
        r = dict(packed=isinstance(e_got, PackedEmbed) and isinstance(e_ref, PackedEmbed))
        if r["packed"]:
            q = e_got.kernel.get_value()
            r["embed_specs"] = {leaf: str(getattr(q, leaf).sharding.spec) for leaf in ("codes", "scale", "offset")
                                if getattr(q, leaf) is not None}
            r["embed_leaf_dtypes"] = [str(x.dtype) for x in jax.tree.leaves(q)]
        a = jax.tree.leaves(nnx.state(ref, nnx.Param))
        b = jax.tree.leaves(nnx.state(got, nnx.Param))
        r["params_equal"] = len(a) == len(b) and all(
            x.dtype == y.dtype and x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y))
            for x, y in zip(a, b))
        rows_ref = np.asarray(jax.jit(lambda m, i: m.model.embed_tokens(i))(ref, ids))
        rows_got = np.asarray(jax.jit(lambda m, i: m.model.embed_tokens(i))(got, ids))
        r["rows_bits_equal"] = bool(np.array_equal(rows_ref.view(np.uint32), rows_got.view(np.uint32)))
        lo_ref = np.asarray(nnx.jit(lambda m, i: m(i)[0])(ref, ids), np.float64)
        lo_got = np.asarray(nnx.jit(lambda m, i: m(i)[0])(got, ids), np.float64)
        r["logits_max_abs_diff"] = float(np.max(np.abs(lo_ref - lo_got)))
        r["logits_max_abs"] = float(np.max(np.abs(lo_ref)))
        r["tokens_ref"] = np.asarray(generate(ref, ids, 6)).tolist()
        r["tokens_got"] = np.asarray(generate(got, ids, 6)).tolist()
        res[name] = r
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
