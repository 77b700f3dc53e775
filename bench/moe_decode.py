"""Greedy decode throughput (tokens/s) of a random Qwen3-MoE-shaped model in the library decoder: gathered experts
(the decode path), sorted rows with grouped matmuls (tiled / ragged_dot), packed expert stacks (W4A16, NVFP4A16),
beside transformers on the same checkpoint and our dense decoder with the same *active* parameter count
(intermediate_size = top_k x moe_intermediate_size), all float32, in the same run.

Usage: python bench/moe_decode.py [--layers 4] [--hidden 512] [--experts 64] [--moe-inter 256] [--top-k 8]
                                  [--prompt 16] [--new 32] [--schemes W4A16:g64,NVFP4A16] [--no-transformers]

Timing: the fastest of --new timed calls of one decode step (batch 1, one token, KV cache holding the prompt), ours a
jit call of the model, transformers' a forward with its cache (a deepcopy of the prompt's cache each step, timed
with it; small beside the step). tokens/s = 1000 / step ms. Prefill: the fastest of 3 calls on the whole prompt.
Prints the markdown table of BENCHMARKS.md's section
"MoE decode (random Qwen3-MoE shape)".
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from converters.pipelines.causal_lm import load_causal_lm  # noqa: E402
from qformats.models.decoder import quantization_rules  # noqa: E402
from qformats.models.decoder.moe import set_dispatch  # noqa: E402
from qformats.nn import param_bytes, quantize_model  # noqa: E402


def _best_ms(step, n):
    """The fastest of n timed calls after a warm-up (the minimum: the figure least disturbed by other load)."""
    step()  # warm-up (compiles)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.min(times))


def ours(model, prompt, steps):
    """Best ms of one jit decode step (one token, batch 1, KV cache after the prompt). The model's state is split
    once and passed to jax.jit (as `generate` does): nnx.jit would hand every parameter back as an output, copying
    the weights on each call."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, ids, c: nnx.merge(graphdef, st)(ids, c, last_only=True))
    empty = model.init_cache(prompt.shape[0], prompt.shape[1] + steps + 2)
    prefill = _best_ms(lambda: jax.block_until_ready(fn(state, prompt, empty)[0]), 3)
    _, cache = fn(state, prompt, empty)
    tok = prompt[:, -1:]
    return _best_ms(lambda: jax.block_until_ready(fn(state, tok, cache)[0]), steps), prefill


def theirs(hf, prompt, steps):
    """Best ms of one transformers forward of one token with its KV cache after the prompt."""
    import copy

    import torch

    with torch.no_grad():
        full = torch.tensor(prompt, dtype=torch.long)
        prefill = _best_ms(lambda: hf(full, use_cache=True), 3)
        past = hf(full, use_cache=True).past_key_values
        tok = torch.tensor(prompt[:, -1:], dtype=torch.long)

        def step():
            hf(tok, past_key_values=copy.deepcopy(past), use_cache=True)

        return _best_ms(step, steps), prefill


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--schemes", default="W4A16:g64,NVFP4A16")
    ap.add_argument("--no-transformers", action="store_true")
    a = ap.parse_args(argv)

    import torch
    import transformers

    base = dict(vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=8,
                num_key_value_heads=2, head_dim=a.hidden // 8, max_position_embeddings=1024, tie_word_embeddings=False,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    moe_cfg = transformers.Qwen3MoeConfig(**base, intermediate_size=a.top_k * a.moe_inter,
                                          moe_intermediate_size=a.moe_inter, num_experts=a.experts,
                                          num_experts_per_tok=a.top_k, norm_topk_prob=True)
    dense_cfg = transformers.Qwen3Config(**base, intermediate_size=a.top_k * a.moe_inter)
    prompt = np.random.RandomState(0).randint(0, 4096, (1, a.prompt)).astype(np.int32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = transformers.AutoModelForCausalLM.from_config(moe_cfg).eval()
        hf.save_pretrained(f"{tmp}/moe")
        transformers.AutoModelForCausalLM.from_config(dense_cfg).eval().save_pretrained(f"{tmp}/dense")
        ref_tps = None
        if not a.no_transformers:
            ms, pre = theirs(hf, prompt, a.new)
            ref_tps = 1e3 / ms
            rows.append(("transformers (MoE, float32)", ref_tps, pre, sum(p.numel() * 4 for p in hf.parameters())))
        del hf
        dense, _, _ = load_causal_lm(f"{tmp}/dense", tokenizer=False)
        ms, pre = ours(dense, prompt, a.new)
        dense_tps = 1e3 / ms
        rows.append(("ours, dense decoder of the same active params", dense_tps, pre, param_bytes(dense)))
        del dense
        model, _, _ = load_causal_lm(f"{tmp}/moe", tokenizer=False)
        for label, d, m in (("ours MoE (auto: gathered decode, tiled prefill)", "auto", "auto"),
                            ("ours MoE, sorted + tiled grouped matmul", "grouped", "tiled"),
                            ("ours MoE, sorted + ragged_dot", "grouped", "ragged")):
            set_dispatch(model, d, m)
            ms, pre = ours(model, prompt, a.new)
            rows.append((label, 1e3 / ms, pre, param_bytes(model)))
        set_dispatch(model, "auto", "auto")
        for scheme in [s for s in a.schemes.split(",") if s]:
            q, _, _ = load_causal_lm(f"{tmp}/moe", tokenizer=False)
            quantize_model(q, quantization_rules(scheme))
            ms, pre = ours(q, prompt, a.new)
            rows.append((f"ours MoE {scheme} (auto: gathered decode, tiled prefill)", 1e3 / ms, pre, param_bytes(q)))
            del q
    print(f"\n{a.layers} layers, hidden {a.hidden}, {a.experts} experts x {a.moe_inter}, top-{a.top_k}; batch 1, "
          f"prompt {a.prompt}, {a.new} new tokens; {platform.machine()} {os.cpu_count()} CPUs, jax "
          f"{jax.__version__} {jax.default_backend()}\n")
    print(f"| model | decode step ms | decode tokens/s | vs transformers | step vs dense active | prefill {a.prompt} "
          "tokens ms | params MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, tps, pre, nbytes in rows:
        vs_ref = f"{tps / ref_tps:.2f}x" if ref_tps else "-"
        print(f"| {label} | {1e3 / tps:.2f} | {tps:.1f} | {vs_ref} | {dense_tps / tps:.2f}x | {pre:.1f} | "
              f"{nbytes / 2**20:.0f} |")


if __name__ == "__main__":
    main()
