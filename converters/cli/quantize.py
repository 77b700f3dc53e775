"""`qformats quantize [SRC] DST --scheme S [...]`: dense checkpoint -> compressed-tensors checkpoint, data-free or
calibrated (the embedded MiniLM with --calibrate [FILE]; a causal LM SRC DST with --calibrate FILE, layer by layer)."""

from __future__ import annotations

import math
import sys

from converters.cli.common import MAX_SHARD_SIZE_HELP, Usage, add_compile_cache_argument, enable_compile_cache

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    from qformats.kv_cache import KV_CACHE_CHOICES
    from qformats.algorithms.weight_search import WEIGHT_SEARCHES
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
                   help="calibrate before quantizing. A causal LM (SRC DST): FILE of text, .jsonl or .npy token ids, "
                        "run layer by layer (static activation and KV-cache scales, --weight-search, --awq or "
                        "--smooth). The embedded all-MiniLM-L6-v2 (DST alone): FILE of sentences, one a line "
                        "(default: the shipped set)")
    q.add_argument("--weight-search", choices=WEIGHT_SEARCHES, default=None,
                   help="with --calibrate: how the weights are chosen (default: mse+gptq, GPTQ on MSE-searched "
                        "scales: the best held-out fidelity measured, BENCHMARKS.md)")
    q.add_argument("--dampening", type=float, default=None, metavar="FRAC",
                   help="with --calibrate and a GPTQ search: H += FRAC * mean(diag H) * I (default: 0.1 for the "
                        "embedded MiniLM, chosen on held-out text; 0.01, llm-compressor's, for a causal LM SRC DST)")
    q.add_argument("--awq", action="store_true",
                   help="with --calibrate SRC DST (causal LM): AWQ scales (llm-compressor's AWQModifier arithmetic) "
                        "folded into each layer before the weight search (default then: rtn); not with --smooth")
    q.add_argument("--moe-statistics", choices=("all", "routed", "routed-or-all"), default=None,
                   help="with --calibrate SRC DST (mixture-of-experts LM): each expert's statistics over every token "
                        "(all: llm-compressor's moe_calibrate_all_experts default), only its routed tokens (routed: "
                        "an expert that gets none is an error) or routed with every token for empty experts")
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
    q.add_argument("--max-shard-size", default="5GB", help=MAX_SHARD_SIZE_HELP + " (data-free only)")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    q.add_argument("--quiet", action="store_true", help="no progress bar (the summary is still printed)")
    add_compile_cache_argument(q, when="with --calibrate: ")


def run(a) -> int:
    """Quantizes a.paths ([SRC] DST) with a.scheme: `converters.pipelines.quantize_checkpoint` data-free,
    `converters.pipelines.calibrate` with --calibrate; returns the exit status."""
    from converters.pipelines.quantize_checkpoint import quantize_checkpoint
    if len(a.paths) > 2:
        raise Usage(f"qformats quantize: error: expected [SRC] DST, found {len(a.paths)} paths")
    if a.weight_search is not None and a.calibrate is None:
        raise Usage("qformats quantize: error: --weight-search needs --calibrate")
    if a.dampening is not None and a.calibrate is None:
        raise Usage("qformats quantize: error: --dampening needs --calibrate")
    if a.dampening is not None and not (math.isfinite(a.dampening) and a.dampening >= 0):
        raise Usage(f"qformats quantize: error: --dampening must be a finite number >= 0, got {a.dampening}")
    if a.awq and a.calibrate is None:
        raise Usage("qformats quantize: error: --awq needs --calibrate FILE (AWQ scales come from calibration data)")
    if a.calibrate is not None:
        enable_compile_cache(not a.no_compile_cache)
        return _quantize_calibrated(a)
    if a.kv_cache is not None and a.kv_cache != "fp8:dynamic":
        raise Usage(f"qformats quantize: error: --kv-cache {a.kv_cache} has static k_scale / v_scale, calibrated from "
                    f"data: add --calibrate FILE (causal LM SRC DST), or use --kv-cache fp8:dynamic")
    if len(a.paths) == 1:
        from converters.evaluation.embedded import model_dir
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
    """`qformats quantize SRC DST --scheme S --calibrate FILE ...` for a causal LM (converters.pipelines.calibrate),
    run under the process tuning of `converters.process.lean_calibration`, in a process restarted with huge-page
    malloc (`converters.process.reexec_with_hugepage_malloc`) when the CLI owns it (`a.own_process`)."""
    if not a.calibrate:
        raise Usage("qformats quantize: error: --calibrate needs FILE (text, .jsonl or .npy token ids) for SRC DST")
    if a.ignore is not None or a.targets is not None or a.max_shard_size != "5GB" or a.skip_indivisible:
        raise Usage("qformats quantize: error: --ignore / --targets / --max-shard-size / --skip-indivisible are not "
                    "used with --calibrate")
    if a.awq and a.smooth is not None:
        raise Usage("qformats quantize: error: --awq and --smooth both fold per-channel scales into the same norms "
                    "(llm-compressor does not combine AWQ with SmoothQuant either): give one of them")
    from converters.process import lean_calibration, reexec_with_hugepage_malloc
    if getattr(a, "own_process", False):
        reexec_with_hugepage_malloc()  # before the (slow) imports and before any output; see its docstring
    from converters.pipelines.calibrate import DEFAULT_LM_WEIGHT_SEARCH, quantize_calibrated_lm
    search = a.weight_search or ("rtn" if a.awq else DEFAULT_LM_WEIGHT_SEARCH)
    _check_dampening(a, search)
    log = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr))
    kw = {}
    if a.calibration_tokens is not None:
        kw["calibration_tokens"] = a.calibration_tokens
    if a.seq_len is not None:
        from converters.evaluation.perplexity import check_context
        check_context(a.paths[0], a.seq_len)  # before the (slow) load and calibration
        kw["seq_len"] = a.seq_len
    if a.dampening is not None:
        kw["dampening_frac"] = a.dampening
    if a.moe_statistics is not None:
        kw["moe_statistics"] = a.moe_statistics
    with lean_calibration() as between_phases:
        r = quantize_calibrated_lm(a.paths[0], a.paths[1], a.scheme, a.calibrate, weight_search=search, awq=a.awq,
                                   smooth=a.smooth, overwrite=a.overwrite, kv_cache=a.kv_cache, rotate=a.rotate,
                                   rotate_seed=a.rotate_seed, between_phases=between_phases, log=log, **kw)
    if a.quiet:
        from qformats.algorithms.weight_search import search_text
        print(f"quantized {r['projections']} projections ({search_text(r['projections'], r['searched'], search)}) on "
              f"{r['tokens']} tokens -> "
              f"{r['path']}", file=sys.stderr)
    return 0


def _check_dampening(a, search: str) -> None:
    """--dampening only where a GPTQ search runs: it would otherwise be ignored."""
    from qformats.algorithms.weight_search import NEEDS_HESSIAN
    if a.dampening is not None and search not in NEEDS_HESSIAN:
        raise Usage(f"qformats quantize: error: --dampening is GPTQ's, and the weight search is {search!r}: use "
                    f"--weight-search {' or '.join(NEEDS_HESSIAN)}, or drop --dampening")


def _quantize_calibrated(a) -> int:
    if len(a.paths) == 2:
        return _quantize_calibrated_lm(a)
    if a.awq or a.smooth is not None or a.calibration_tokens is not None or a.seq_len is not None:
        raise Usage("qformats quantize: error: --awq / --smooth / --calibration-tokens / --seq-len are for causal "
                    "LMs (SRC DST)")
    if len(a.paths) != 1:
        raise Usage("qformats quantize: error: --calibrate works on the embedded all-MiniLM-L6-v2 only (it needs "
                    "a Flax model of the checkpoint): give DST alone")
    if a.kv_cache is not None:
        raise Usage("qformats quantize: error: --kv-cache is for causal LMs (SRC DST); all-MiniLM-L6-v2 is an "
                    "encoder and keeps no KV cache")
    if a.rotate is not None:
        raise Usage("qformats quantize: error: --rotate is for causal LMs (SRC DST): SpinQuant's rotations are "
                    "defined for the llama / mistral / qwen decoder family")
    if a.ignore is not None or a.targets is not None or a.max_shard_size != "5GB" or a.skip_indivisible:
        raise Usage("qformats quantize: error: --ignore / --targets / --max-shard-size / --skip-indivisible are not "
                    "used with --calibrate")
    sentences = None
    if a.calibrate:
        from pathlib import Path
        path = Path(a.calibrate)
        if not path.is_file():
            raise Usage(f"qformats quantize: error: --calibrate {path}: no such file")
        from converters.evaluation.calibration_data import read_text_file
        sentences = [s.strip() for s in read_text_file(path, "--calibrate sentences").splitlines() if s.strip()]
        if not sentences:
            raise Usage(f"qformats quantize: error: --calibrate {path}: the file holds no sentences")
    from converters.pipelines.calibrate import DEFAULT_WEIGHT_SEARCH, quantize_calibrated
    search = a.weight_search or DEFAULT_WEIGHT_SEARCH
    _check_dampening(a, search)
    log = (lambda m: None) if a.quiet else (lambda m: print(m, file=sys.stderr))
    kw = {} if a.dampening is None else {"dampening_frac": a.dampening}
    r = quantize_calibrated(a.paths[0], a.scheme, sentences=sentences, weight_search=search,
                            overwrite=a.overwrite, log=log, **kw)
    if a.quiet:  # otherwise the log lines said it already
        from qformats.algorithms.weight_search import search_text
        print(f"quantized {r['layers']} Linear layers ({search_text(r['layers'], r['searched'], search)}) -> "
              f"{r['path']} in {r['seconds']:.1f} s", file=sys.stderr)
    return 0
