"""Greedy decode throughput (tokens/s) of a random Qwen3-MoE-shaped model in the library decoder: gathered experts
(the decode path), sorted rows with grouped matmuls (tiled / ragged_dot), packed expert stacks (W4A16, NVFP4A16),
beside transformers on the same checkpoint and our dense decoder with the same *active* parameter count
(intermediate_size = top_k x moe_intermediate_size), all float32, in the same run.

Usage: python bench/moe_decode.py [--layers 8] [--hidden 1024] [--experts 64] [--moe-inter 512] [--top-k 8]
                                  [--prompt 16] [--new 32] [--schemes W4A16,NVFP4A16] [--no-transformers] [--ragged]
(defaults: the issue's shape; --ragged adds the sorted + ragged_dot row, which XLA:CPU runs as a dense product per
expert: minutes per step at this shape.)

Timing: one decode step = batch 1, one token, KV cache holding the prompt; ours a jit call of the model (the dense
counterparts quantized with the same scheme), transformers' a forward with its cache (a deepcopy of the prompt's cache
each step, timed with it; small beside the step). On a shared machine the load changes within a run, so each MoE
decoder's step is timed interleaved with the dense decoder's of the same scheme (--new rounds of one dense step, then one
MoE step): the ratio compares steps taken under the same load. Each figure is the fastest call (the least disturbed),
as wall ms and as this process's CPU ms (time.process_time: all its threads; XLA runs single-threaded with
XLA_FLAGS=--xla_cpu_multi_thread_eigen=false, torch on its own threads, so CPU ms is the robust figure for ours and wall
ms for transformers). tokens/s = 1000 / wall step ms. Prefill: the fastest of 3 calls on the whole prompt; each packed
MoE is also prefilled with kernels off (`set_kernels_enabled(False)`: each tile of the tiled grouped matmul
dequantizes its expert, then dots -- the path before `packed_matmul`), for a before / after in one run. The load
average is printed with each row. Prints the markdown table of BENCHMARKS.md's section
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
from qformats.dispatch import set_kernels_enabled  # noqa: E402
from qformats.models.decoder import quantization_rules  # noqa: E402
from qformats.models.decoder.moe import set_dispatch  # noqa: E402
from qformats.nn import param_bytes, quantize_model  # noqa: E402


def _best_ms(step, n):
    """The fastest of n timed calls after a warm-up (the minimum: the figure least disturbed by other load)."""
    return _interleaved([step], n)[0][0]


def _interleaved(steps, n):
    """[(best wall ms, best CPU ms)] of each step, timed in n rounds of one call of each (after a warm-up call of
    each), so that every step sees the same load."""
    for step in steps:
        step()  # warm-up (compiles)
    wall, cpu = [[] for _ in steps], [[] for _ in steps]
    for _ in range(n):
        for i, step in enumerate(steps):
            t, c = time.perf_counter(), time.process_time()
            step()
            wall[i].append(time.perf_counter() - t)
            cpu[i].append(time.process_time() - c)
    return [(1e3 * min(w), 1e3 * min(c)) for w, c in zip(wall, cpu)]


def _load() -> float:
    return os.getloadavg()[0]


def decode_step(model, prompt, steps):
    """(one jit decode step of `model` as a callable: one token, batch 1, KV cache after the prompt; best ms of the
    prefill of the prompt). The model's state is split once and passed to jax.jit (as `generate` does): nnx.jit
    would hand every parameter back as an output, copying the weights on each call."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, ids, c: nnx.merge(graphdef, st)(ids, c, last_only=True))
    empty = model.init_cache(prompt.shape[0], prompt.shape[1] + steps + 2)
    prefill = _best_ms(lambda: jax.block_until_ready(fn(state, prompt, empty)[0]), 3)
    _, cache = fn(state, prompt, empty)
    tok = prompt[:, -1:]
    return (lambda: jax.block_until_ready(fn(state, tok, cache)[0])), prefill


def prefill_ms(model, prompt):
    """Best ms of the jit prefill of the prompt (3 calls)."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, ids, c: nnx.merge(graphdef, st)(ids, c, last_only=True))
    empty = model.init_cache(prompt.shape[0], prompt.shape[1] + 2)
    return _best_ms(lambda: jax.block_until_ready(fn(state, prompt, empty)[0]), 3)


def theirs(hf, prompt, steps):
    """(best (wall, CPU) ms of one transformers forward of one token with its KV cache after the prompt, best
    prefill ms)."""
    import copy

    import torch

    with torch.no_grad():
        full = torch.tensor(prompt, dtype=torch.long)
        prefill = _best_ms(lambda: hf(full, use_cache=True), 3)
        past = hf(full, use_cache=True).past_key_values
        tok = torch.tensor(prompt[:, -1:], dtype=torch.long)

        def step():
            hf(tok, past_key_values=copy.deepcopy(past), use_cache=True)

        return _interleaved([step], steps)[0], prefill


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--schemes", default="W4A16,NVFP4A16")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--ragged", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()

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
    rows = []  # (label, (wall, cpu) step ms or None, prefill ms, bytes, scheme, (dense wall, cpu) or None, load)
    with tempfile.TemporaryDirectory() as tmp:
        hf = transformers.AutoModelForCausalLM.from_config(moe_cfg).eval()
        hf.save_pretrained(f"{tmp}/moe")
        transformers.AutoModelForCausalLM.from_config(dense_cfg).eval().save_pretrained(f"{tmp}/dense")
        ref = None
        if not a.no_transformers:
            ref, pre = theirs(hf, prompt, a.new)
            rows.append((f"transformers {transformers.__version__} (MoE, float32)", ref, pre,
                         sum(p.numel() * 4 for p in hf.parameters()), None, None, _load()))
        del hf
        dense_pre = {}
        for scheme in [""] + [s for s in a.schemes.split(",") if s]:
            tag = " " + scheme if scheme else ""
            dense, _, _ = load_causal_lm(f"{tmp}/dense", tokenizer=False)
            moe, _, _ = load_causal_lm(f"{tmp}/moe", tokenizer=False)
            if scheme:
                quantize_model(dense, quantization_rules(scheme))
                quantize_model(moe, quantization_rules(scheme))
            dense_step, dense_pre[scheme] = decode_step(dense, prompt, a.new)
            methods = [(f"ours MoE{tag} (auto: gathered decode, tiled prefill)", "auto", "auto")]
            if not scheme:
                methods.append(("ours MoE, sorted + tiled grouped matmul", "grouped", "tiled"))
                if a.ragged:
                    methods.append(("ours MoE, sorted + ragged_dot", "grouped", "ragged"))
            for i, (label, d, m) in enumerate(methods):
                set_dispatch(moe, d, m)
                moe_step, pre = decode_step(moe, prompt, a.new)
                dense_t, moe_t = _interleaved([dense_step, moe_step], a.new)
                if i == 0:
                    rows.append((f"ours, dense decoder of the same active params{tag}", dense_t, dense_pre[scheme],
                                 param_bytes(dense), scheme, None, _load()))
                rows.append((label, moe_t, pre, param_bytes(moe), scheme, dense_t, _load()))
            if scheme:
                set_kernels_enabled(False)  # the tiles dequantize their expert, then dot (the path before packed_matmul)
                pre = prefill_ms(moe, prompt)
                set_kernels_enabled(True)
                rows.append((f"ours MoE{tag}, prefill tiles dequantize-then-dot (kernels off)", None, pre,
                             param_bytes(moe), scheme, None, _load()))
            del dense, moe, dense_step
    print(f"\n{a.layers} layers, hidden {a.hidden}, {a.experts} experts x {a.moe_inter}, top-{a.top_k}; batch 1, "
          f"prompt {a.prompt}, {a.new} timed steps; {platform.machine()} {os.cpu_count()} CPUs, jax "
          f"{jax.__version__} {jax.default_backend()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
          f"{time.process_time():.0f} CPU s in {time.perf_counter() - t0:.0f} s\n")
    print(f"| model | decode step ms (wall / CPU) | decode tokens/s | vs transformers (wall) | step vs dense active "
          f"(wall / CPU, interleaved) | prefill {a.prompt} tokens ms | prefill vs dense active | params MB | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, t, pre, nbytes, scheme, dense_t, load in rows:
        step = f"{t[0]:.2f} / {t[1]:.2f} | {1e3 / t[0]:.1f}" if t else "- | -"
        vs_ref = f"{ref[0] / t[0]:.1f}x" if ref and t else "-"
        vs_dense = f"{t[0] / dense_t[0]:.2f}x / {t[1] / dense_t[1]:.2f}x" if t and dense_t else "-"
        pre_dense = f"{pre / dense_pre[scheme]:.2f}x" if scheme in dense_pre else "-"
        print(f"| {label} | {step} | {vs_ref} | {vs_dense} | {pre:.1f} | {pre_dense} | {nbytes / 2**20:.0f} | "
              f"{load:.1f} |")

if __name__ == "__main__":
    main()
