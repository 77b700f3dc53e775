"""Native quantized formats loaded onto an N-device CPU mesh, in a fresh interpreter (the device count is set before
JAX starts):

    python tests/multidevice/native_worker.py DEVICES WORKDIR

prints one JSON line: for a GGUF file kept packed (mixed block types), an HF fine-grained FP8 checkpoint and a GPTQ
checkpoint, whether every parameter of the mesh load equals the one-device load, how many are split, and the greedy
tokens of both; and the typed error of a layout the mesh cannot split (FP8 blocks of 128 rows over 8 devices).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "converters" / "pipelines"))
sys.path.insert(0, str(HERE.parent / "converters" / "formats"))

# 16 heads of 16, 8 KV heads: q/k/v/gate/up split by whole heads / rows over 8 devices, o/down by 32 inputs each
CFG = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
           head_dim=16, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
GGUF_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_K", "attn_v": "Q5_0", "attn_output": "Q4_1", "ffn_gate": "Q6_K",
              "ffn_up": "Q3_K", "ffn_down": "Q5_K", "output": "Q8_0"}


def write_fp8(out: Path, block, seed=0) -> Path:
    """A tiny llama in the HF fine-grained FP8 layout (every decoder Linear: e4m3 codes + weight_scale_inv)."""
    import ml_dtypes
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    cfg = transformers.AutoConfig.for_model("llama", **CFG)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    bm, bn = block
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith(".weight") and p.ndim == 2 and ".layers." in name:
            n, k = p.shape
            codes = (rng.standard_normal((n, k)) * 40).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            tensors[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            s = rng.uniform(0.5, 1.5, size=(-(-n // bm), -(-k // bn))) * 2.0 ** -9
            tensors[name[: -len("weight")] + "weight_scale_inv"] = torch.from_numpy(s.astype(np.float32))
        else:
            tensors[name] = (1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.detach().clone()
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    conf = cfg.to_dict()
    conf["dtype"] = "float32"
    conf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(conf))
    return out


def write_gptq(out: Path) -> Path:
    """A tiny llama in the GPTQ layout (4 bits, groups of 32, asymmetric), packed by the AutoGPTQ port of
    tests/converters/formats/test_gptq_awq.py."""
    import torch
    import transformers

    from test_gptq_awq import make_gptq

    dense = out.parent / (out.name + "-dense")
    torch.manual_seed(1)
    cfg = transformers.AutoConfig.for_model("llama", **CFG)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(dense)
    make_gptq(out, dense, bits=4, gs=32)
    return out



def main(n: int, workdir: str):
    import jax

    jax.config.update("jax_num_cpu_devices", n)
    import numpy as np
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.pipelines.mesh_load import ReadStats, tensor_parallel_setup
    from gguf_mixed import mixed_gguf
    from qformats.errors import ModelError, QFormatsError
    from qformats.models.generate import generate

    mesh = tensor_parallel_setup(n)
    wd = Path(workdir)
    srcs = {"gguf": mixed_gguf(wd / "m.gguf", GGUF_TYPES, hidden=256, heads=16, kv_heads=8, inter=256, tied=False,
                               embed="Q8_0", vocab=264),
            "fp8": write_fp8(wd / "fp8", (16, 32)),
            "gptq": write_gptq(wd / "gptq")}
    ids = np.array([[1, 5, 17, 99, 200, 3]], np.int32)
    res = {}
    for name, src in srcs.items():
        ref, _, _ = load_causal_lm(src, tokenizer=False)
        st = ReadStats()
        got, _, _ = load_causal_lm(src, mesh=mesh, tokenizer=False, stats=st)
        a = jax.tree.leaves(nnx.state(ref, nnx.Param))  # a GGUF's packed embedding too (PackedEmbed on both)
        b = jax.tree.leaves(nnx.state(got, nnx.Param))
        same = len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape
                                        and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
        want = np.asarray(generate(ref, ids, 8)).tolist()
        out = np.asarray(generate(got, ids, 8)).tolist()
        packed = sum(1 for _, m in nnx.iter_modules(got) if type(m).__name__ == "QLinear")
        offsets = sum(1 for _, m in nnx.iter_modules(got) if getattr(getattr(m, "kernel", None), "offset", None)
                      is not None)
        res[name] = dict(same=same, leaves=len(b), sharded=sum(1 for y in b if not y.sharding.is_fully_replicated),
                         ref=want, out=out, packed=packed, reads=st.reads, bytes=st.bytes, largest=st.largest,
                         file_bytes=sum(f.stat().st_size for f in ([src] if src.is_file() else src.glob("*.safetensors"))))
        res[name]["offsets"] = offsets
        del ref, got, a, b
    try:
        load_causal_lm(write_fp8(wd / "fp8-128", (128, 128)), mesh=mesh, tokenizer=False)
        res["fp8_128"] = None
    except (ModelError, QFormatsError) as e:
        res["fp8_128"] = [type(e).__name__, str(e)]
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
