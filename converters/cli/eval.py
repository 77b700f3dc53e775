"""`qformats eval`: evaluates a model by what it is — a causal LM's perplexity on a text, or a sentence encoder's
embedding fidelity (the embedded all-MiniLM-L6-v2 and its quantized checkpoints) against the dense model.

The model decides which: a SRC that is a .gguf file, or a checkpoint whose config.json names a causal LM
(`architectures` *ForCausalLM, or model_type llama / mistral / qwen2 / qwen3) is measured by perplexity
(`converters.evaluation.perplexity`, --text FILE required); no SRC (the embedded all-MiniLM-L6-v2) or checkpoints
of a BERT sentence encoder (model_type bert) by embedding fidelity (`converters.evaluation.embedding_fidelity`).
SRCs of both kinds in one run, or a model of neither kind, are a usage error that says so.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Sequence

from converters.cli.common import (Parser, Usage, add_compile_cache_argument, add_parallel_arguments,
                                  check_parallel_usage, enable_compile_cache, parallel_mesh, parse_schemes, read_text,
                                  skipped_text)

__all__ = ["CAUSAL_LM", "SENTENCE_ENCODER", "add_parser", "model_kind", "perplexity_parser", "run"]

CAUSAL_LM = "causal LM"
SENTENCE_ENCODER = "sentence encoder"
_CAUSAL_LM_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the decoder family `qformats.models` loads
_ENCODER_TYPES = ("bert",)  # all-MiniLM-L6-v2 is a BERT

_PPL_PROTOCOL = ("Protocol: the whole text is tokenized once without special tokens; the ids are cut into consecutive "
                 "non-overlapping windows of --seq-len tokens; the last partial window is dropped; the first "
                 "--max-windows are kept; each window runs alone and ppl = exp(mean NLL of every token but the "
                 "first of each window). Per scheme: ppl, tokens (predicted tokens counted) and bytes (parameter "
                 "bytes in memory, packed layers at their stored size).")


def add_parser(sub) -> None:
    """Registers the subcommand on the `qformats` subparsers (for the command list; `run` parses its arguments)."""
    sub.add_parser("eval", help="evaluate a model by what it is: perplexity of a causal LM on --text FILE, or the "
                                "fidelity of quantized MiniLM models against the dense one (cosine of sentence "
                                "embeddings, weight bytes)", add_help=False)


def perplexity_parser() -> Parser:
    """The arguments of `qformats eval` for a causal LM."""
    p = Parser(prog="qformats eval", description="Perplexity of one causal-LM checkpoint (dense or "
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
    p.add_argument("--no-scan", action="store_true",
                   help="run the layers one by one in the compiled program instead of one lax.scan per run of "
                        "identical layers (the default, whose compile time does not grow with depth; same values)")
    add_parallel_arguments(p)
    add_compile_cache_argument(p)
    return p


def model_kind(src: str) -> str:
    """CAUSAL_LM or SENTENCE_ENCODER: what the model at `src` is, from its file type (.gguf: a causal LM) or its
    config.json (`architectures` *ForCausalLM or a decoder model_type: a causal LM; model_type bert: a sentence
    encoder). A Usage error naming `src` when it is missing or neither."""
    from converters.formats.safe_files import read_json

    p = Path(src)
    if p.suffix.lower() == ".gguf":
        return CAUSAL_LM
    if not p.exists():
        raise Usage(f"qformats eval: error: {src}: no such checkpoint")
    if not (p / "config.json").is_file():
        raise Usage(f"qformats eval: error: {src}: expected a checkpoint directory with a config.json or a .gguf "
                    f"file, found {'a file' if p.is_file() else 'no config.json'}")
    cfg = read_json(p / "config.json")
    cfg = cfg if isinstance(cfg, dict) else {}
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    if any(str(x).endswith("ForCausalLM") for x in archs) or model_type in _CAUSAL_LM_TYPES:
        return CAUSAL_LM
    if model_type in _ENCODER_TYPES:
        return SENTENCE_ENCODER
    raise Usage(f"qformats eval: error: {src}: cannot tell how to evaluate it: config.json has model_type "
                f"{model_type!r} and architectures {archs}; expected a causal LM (architectures *ForCausalLM, "
                f"model_type {' / '.join(_CAUSAL_LM_TYPES)}, or a .gguf file: perplexity on --text FILE) or a BERT "
                f"sentence encoder such as all-MiniLM-L6-v2 (model_type bert: embedding fidelity)")


def _sources(rest: Sequence[str]):
    """(the positional SRC arguments of `rest`, its parsed options), read with the options of both evaluations."""
    from converters.evaluation.embedding_fidelity import build_parser

    p = Parser(prog="qformats eval", add_help=False)
    p.add_argument("srcs", nargs="*")
    seen = set()
    for parser in (build_parser(), perplexity_parser()):
        for action in parser._actions:  # argparse keeps a parser's arguments there
            for opt in action.option_strings:
                if opt in seen or opt in ("-h", "--help"):
                    continue
                seen.add(opt)
                dest = "opt_" + opt.lstrip("-").replace("-", "_")
                if action.nargs == 0:
                    p.add_argument(opt, dest=dest, action="store_true")
                else:
                    p.add_argument(opt, dest=dest, nargs=action.nargs)
    ns, _ = p.parse_known_intermixed_args(list(rest))
    return list(ns.srcs), ns


def run(rest: List[str]) -> int:
    """`qformats eval ARGS`: picks the evaluation by the model (module docstring) and runs it; returns the exit
    status."""
    srcs, opts = _sources(rest)
    asks_help = "-h" in rest or "--help" in rest
    kinds = {src: model_kind(src) for src in srcs}
    if len(set(kinds.values())) > 1:
        by = {k: [s for s, v in kinds.items() if v == k] for k in (CAUSAL_LM, SENTENCE_ENCODER)}
        raise Usage(f"qformats eval: error: expected SRCs of one kind of model, found a {CAUSAL_LM} "
                    f"({', '.join(by[CAUSAL_LM])}: perplexity) and a {SENTENCE_ENCODER} "
                    f"({', '.join(by[SENTENCE_ENCODER])}: embedding fidelity); evaluate them in separate runs")
    if kinds and set(kinds.values()) == {CAUSAL_LM}:
        return _perplexity(perplexity_parser().parse_args(rest))
    if not srcs and getattr(opts, "opt_text", None) is not None and not asks_help:
        raise Usage("qformats eval: error: --text FILE measures the perplexity of a causal LM: give its SRC (a "
                    "checkpoint directory or a .gguf file); without SRC eval measures the embedding fidelity of the "
                    "embedded all-MiniLM-L6-v2")
    return _fidelity(rest, help_too=asks_help and not srcs)


def _fidelity(rest: List[str], help_too: bool) -> int:
    from converters.evaluation import embedding_fidelity
    if not help_too and not ("-h" in rest or "--help" in rest):
        enable_compile_cache("--no-compile-cache" not in rest)
    rest = [x for x in rest if x != "--no-compile-cache"]  # the CLI's option, not the evaluation's
    try:
        rc = embedding_fidelity.main(rest)
    except SystemExit as e:  # its argparse: --help (0) or a usage error (2)
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if rc == 0 and help_too:
            print("\nFor a causal LM SRC (a .gguf file, or a checkpoint whose config.json names a causal LM), eval "
                  "measures its perplexity on --text FILE instead:\n")
            print(perplexity_parser().format_help())
    return int(rc or 0)


def _perplexity(a) -> int:
    import json

    from converters.evaluation.perplexity import evaluate_text
    text = read_text("--text", a.text)
    schemes = parse_schemes(a.schemes)
    if a.seq_len < 2 or (a.max_windows is not None and a.max_windows < 1) or a.batch_size < 1:
        raise Usage("qformats eval: error: expected --seq-len >= 2, --max-windows >= 1, --batch-size >= 1")
    check_parallel_usage(a, "eval")
    mesh = parallel_mesh(a)  # before any other JAX operation
    enable_compile_cache(not a.no_compile_cache)
    log = None if a.json else (lambda m: print(m, file=sys.stderr))
    r = evaluate_text(a.src, text, schemes, seq_len=a.seq_len, max_windows=a.max_windows, batch_size=a.batch_size,
                      skip_indivisible=a.skip_indivisible, log=log, scan=not a.no_scan, mesh=mesh)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{'scheme':<20} {'ppl':>10} {'tokens':>8} {'MB':>9}")
        for k, v in r.items():
            print(f"{k:<20} {v['ppl']:10.4f} {v['tokens']:8d} {v['bytes'] / 1e6:9.2f}"
                  + (f"  (dense: {len(v['skipped'])} skipped)" if v.get("skipped") else ""))
    for k, v in r.items():
        if v.get("skipped"):
            print(skipped_text(f"qformats: {k}: ", v["skipped"]), file=sys.stderr)
    return 0
