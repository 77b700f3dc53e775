"""`qformats generate SRC --prompt TEXT | --prompts FILE.jsonl [...]`: jit-compiled text generation with a causal
LM, on one device or N, saying on stderr what it does (loading, compiling, prefill, decode tokens/s), streaming with
--stream, through the checkpoint's chat template with --chat."""

from __future__ import annotations

import sys

from converters.cli.common import (Usage, add_compile_cache_argument, add_parallel_arguments, check_parallel_usage,
                                  parallel_mesh, parse_schemes, say, skipped_text)
from converters.units import size_text

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    g = sub.add_parser("generate", help="generate text with a causal LM (dense or compressed-tensors checkpoint "
                                        "directory, or .gguf), jit-compiled; progress and tokens/s on stderr")
    g.add_argument("src", metavar="SRC", help="dense HF or compressed-tensors checkpoint directory, or a .gguf file")
    g.add_argument("--prompt", default=None, help="the prompt text (tokenized as the tokenizer does by default; with "
                                                  "--chat, the user message)")
    g.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help='one request a line: {"prompt": TEXT} with an optional "max_new_tokens": N; prints one JSON '
                        'line {"tokens", "text"} per request, in input order, run --batch-size at a time')
    g.add_argument("--batch-size", type=int, default=1, metavar="N",
                   help="with --prompts: decode N requests together, each row at its own position and cache length; "
                        "a row whose request is done (end token or its max_new_tokens) takes the next request "
                        "(continuous batching), so each request gets the tokens it gets alone when greedy; "
                        "default 1)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32; fewer when an "
                                                                  "end-of-sequence token comes first); prompt + "
                                                                  "new tokens must fit max_position_embeddings")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the checkpoint's chat template (chat_template.jinja, "
                        "as `qformats convert` writes it, or tokenizer_config.json's chat_template), rendered "
                        "with jinja2 in a sandbox as transformers renders it, with the generation prompt")
    g.add_argument("--stream", action="store_true", help="print the text on stdout as the tokens are produced "
                                                         "(not with --json or --prompts)")
    g.add_argument("--scheme", default=None, help="quantize a dense SRC round-to-nearest first (lm_head stays "
                                                  "dense), e.g. W4A16:g64; an error on a quantized SRC")
    g.add_argument("--skip-indivisible", action="store_true",
                   help="with --scheme: leave dense the projections the group size does not divide (listed on stderr)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample in the smallest set of probability >= p")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    add_parallel_arguments(g)
    g.add_argument("--no-scan", action="store_true",
                   help="run the layers one by one in the compiled program instead of one lax.scan per run of "
                        "identically built layers (the default: compile time does not grow with depth; the same "
                        "tokens up to float32 summation order)")
    g.add_argument("--no-buckets", action="store_true",
                   help="compile for the exact prompt length and cache size instead of padding both to the next "
                        "power of two (>= 16; the default, so other prompt lengths and --max-new-tokens in the same "
                        "bucket reuse the compiled programs)")
    add_compile_cache_argument(g)
    g.add_argument("--json", action="store_true", help='print {"tokens": [new token ids], "text": ...} (with '
                                                       '--tensor-parallel / --expert-parallel also '
                                                       '"param_bytes_per_device")')


def _check_usage(a) -> None:
    if (a.prompt is None) == (a.prompts is None):
        raise Usage("qformats generate: error: expected one of --prompt TEXT or --prompts FILE.jsonl")
    if a.max_new_tokens < 1:
        raise Usage("qformats generate: error: --max-new-tokens must be >= 1")
    if a.stream and (a.json or a.prompts is not None):
        raise Usage("qformats generate: error: --stream prints text as it comes; --json and --prompts print JSON "
                    "when a request is done: give one of them")
    if a.scheme is not None:
        parse_schemes(a.scheme)
    elif a.skip_indivisible:
        raise Usage("qformats generate: error: --skip-indivisible needs --scheme")
    if a.batch_size < 1:
        raise Usage("qformats generate: error: --batch-size must be >= 1")
    if a.batch_size > 1 and a.prompts is None:
        raise Usage("qformats generate: error: --batch-size batches the requests of --prompts FILE.jsonl")
    check_parallel_usage(a, "generate")


def _source_bytes(src: str) -> int:
    """Bytes of the weights at `src`: its *.safetensors files, or the .gguf file."""
    from pathlib import Path
    p = Path(src)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.glob("*.safetensors") if f.is_file())
    return p.stat().st_size if p.is_file() else 0


def _load(a, mesh):
    """(model, hf config, tokenizer, skipped) of a.src, with a.scheme, on one device or `mesh`."""
    from converters.evaluation.perplexity import load_for_scheme
    if mesh is not None and a.scheme is None:
        from converters.pipelines.causal_lm import load_causal_lm
        model, cfg, tok = load_causal_lm(a.src, mesh=mesh)  # each device's slice read straight from the file
        return model, cfg, tok, []
    model, cfg, tok, skipped = load_for_scheme(a.src, a.scheme or "stored", skip_indivisible=a.skip_indivisible)
    if mesh is not None:  # quantized in memory on one device, then laid out on the mesh
        from qformats.models.decoder.sharding import decoder_parallel_rules
        from qformats.nn.sharding import shard_model
        model = shard_model(model, mesh, decoder_parallel_rules(model.config, mesh))
    return model, cfg, tok, skipped


def _prompt_ids(tok, chat, prompt: str, where: str):
    """The token ids of one prompt: as the tokenizer encodes it by default, or (with --chat) the rendered chat
    template, encoded without special tokens as transformers' apply_chat_template does."""
    if chat is not None:
        from converters.pipelines.chat_template import render_chat
        template, special, origin = chat
        text = render_chat(template, [{"role": "user", "content": prompt}], where=origin, **special)
        ids = tok.encode(text, add_special_tokens=False).ids
    else:
        ids = tok.encode(prompt).ids
    if not ids:
        raise Usage(f"qformats generate: error: {where} gives no tokens")
    return ids


def run(a) -> int:
    """Generates up to a.max_new_tokens after a.prompt, or after each request of a.prompts
    (`qformats.models.generate.TokenStream`: greedy, or sampled with a.temperature / a.top_k / a.top_p and a.seed) and
    prints the text (streamed with a.stream), or JSON; says on stderr what it does. Returns the exit status."""
    import json
    import time

    import jax
    import numpy as np

    from converters.cli.common import CompileWatch, enable_compile_cache
    from qformats.models.generate import TokenStream, check_context, supports_ragged
    _check_usage(a)
    requests = [(a.prompt, a.max_new_tokens)] if a.prompts is None else read_requests(a.prompts, a.max_new_tokens)
    mesh = parallel_mesh(a)  # before any other JAX operation
    cache = enable_compile_cache(not a.no_compile_cache)
    nbytes = _source_bytes(a.src)
    say(f"loading {a.src} ({size_text(nbytes)}) ...")
    t0 = time.perf_counter()
    model, cfg, tok, skipped = _load(a, mesh)
    dt = max(time.perf_counter() - t0, 1e-9)
    say(f"loaded {size_text(nbytes)} in {dt:.1f} s ({size_text(nbytes / dt)}/s)")
    if skipped:
        print(skipped_text("qformats: ", skipped), file=sys.stderr)
    if tok is None:
        raise Usage(f"qformats generate: error: {a.src}: expected a tokenizer.json beside the checkpoint, found none")
    if not a.no_scan:
        from qformats.models.decoder.scan import scan_layers
        t0 = time.perf_counter()
        # RowLinear (one-row float products reading the stack in place) only where every decode step has one row:
        # its transposed stack makes several-row products slower on XLA:CPU (BENCHMARKS.md)
        scan_layers(model, row_linear=None if a.prompts is None or a.batch_size == 1 else False)
        runs = model.model.layers.runs
        say(f"layers: {model.model.layers.num_layers} in {len(runs)} scanned run(s) "
            f"({', '.join(f'{r.first}-{r.first + r.count - 1}' for r in runs)}), stacked in "
            f"{time.perf_counter() - t0:.1f} s")
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else [e for e in (eos or []) if isinstance(e, int)]
    chat = None
    if a.chat:
        from converters.pipelines.chat_template import load_chat_template
        template, special, origin = load_chat_template(a.src)
        if template is None:
            raise Usage(f"qformats generate: error: --chat: {a.src} has no chat template (expected "
                        f"chat_template.jinja or a chat_template in tokenizer_config.json)")
        chat = (template, special, origin)
        end = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if end is not None and end not in eos:  # the template's end of turn ends the answer
            eos.append(end)
    where = "--prompt" if a.prompts is None else a.prompts
    todo = [(_prompt_ids(tok, chat, p, where if a.prompts is None else f"{where}: request {i + 1}"), n)
            for i, (p, n) in enumerate(requests)]
    for ids, n in todo:  # every request checked before any compute
        check_context(model, len(ids), n)
    key = jax.random.key(a.seed) if a.temperature > 0 else None
    per_device = None
    if mesh is not None and a.prompts is None:
        from qformats.nn.sharding import param_bytes_per_device
        per = param_bytes_per_device(model)
        per_device = [int(per[d]) for d in mesh.devices.flat]
    if a.prompts is not None and supports_ragged(model):
        _run_requests(a, model, tok, todo, key, eos, cache)
        return 0
    for first in range(0, len(todo), a.batch_size):
        batch = todo[first:first + a.batch_size]
        stream = TokenStream(model, [np.asarray(ids, np.int32) for ids, _ in batch], [n for _, n in batch], key=key,
                             temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, eos_id=eos or None,
                             buckets=not a.no_buckets)
        b, t, s = stream.shapes
        with CompileWatch() as watch:
            stream.compile()
        say(f"compiled prefill [{b} x {t} tokens] and decode (cache of {s} positions) in "
            f"{stream.compile_seconds:.1f} s ({watch.text(cache)})")
        rows = [[] for _ in batch]
        done = [False] * len(batch)
        printed = ""
        for step, toks in enumerate(stream):
            if step == 0:
                n_prompt = sum(len(ids) for ids, _ in batch)
                say(f"prefill: {n_prompt} tokens in {stream.prefill_seconds:.2f} s "
                    f"({n_prompt / max(stream.prefill_seconds, 1e-9):.0f} tokens/s)")
            for r, (tokens, (_, n)) in enumerate(zip(rows, batch)):
                if not done[r]:
                    tokens.append(int(toks[r]))
                    done[r] = int(toks[r]) in eos or len(tokens) >= n
            if a.stream:
                printed = _print_new(tok.decode(rows[0], skip_special_tokens=True), printed)
            if all(done):
                break
        decoded = sum(len(tokens) - 1 for tokens in rows)
        if decoded:
            say(f"decode: {decoded} tokens in {stream.decode_seconds:.2f} s "
                f"({decoded / max(stream.decode_seconds, 1e-9):.1f} tokens/s)")
        for tokens in rows:
            text = tok.decode(tokens, skip_special_tokens=True)
            if a.stream:
                _print_new(text, printed, final=True)
                print(flush=True)
                continue
            out = {"tokens": tokens, "text": text}
            if per_device is not None:
                out["param_bytes_per_device"] = per_device
            print(json.dumps(out) if a.json or a.prompts is not None else text, flush=True)
    return 0


def _run_requests(a, model, tok, todo, key, eos, cache) -> None:
    """The requests of a --prompts file through `qformats.models.generate.ContinuousBatch` (a.batch_size rows, a
    finished row refilled with the next request); one JSON line per request, in input order, as soon as it and
    every request before it are done; progress on stderr."""
    import json
    import time

    import numpy as np

    from converters.cli.common import CompileWatch
    from qformats.models.generate import ContinuousBatch
    batch = ContinuousBatch(model, [np.asarray(ids, np.int32) for ids, _ in todo], [n for _, n in todo],
                            batch_size=a.batch_size, key=key, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            eos_id=eos or None, buckets=not a.no_buckets)
    b, s = batch.shapes
    with CompileWatch() as watch:
        batch.compile()
    widths = sorted(set(batch.widths))
    say(f"compiled prefill [1 x {', '.join(map(str, widths))} tokens] and decode [{b} rows] (cache of {s} "
        f"positions) in {batch.compile_seconds:.1f} s ({watch.text(cache)})")
    done, printed, t0 = {}, 0, time.perf_counter()
    for r, tokens in batch:
        tokens = [int(t) for t in tokens]
        done[r] = {"tokens": tokens, "text": tok.decode(tokens, skip_special_tokens=True)}
        say(f"request {r + 1}/{len(todo)}: {len(todo[r][0])} prompt + {len(tokens)} new tokens "
            f"({time.perf_counter() - t0:.1f} s)")
        while printed in done:
            print(json.dumps(done.pop(printed)), flush=True)
            printed += 1
    say(f"prefill: {batch.prefill_tokens} tokens in {batch.prefill_seconds:.2f} s "
        f"({batch.prefill_tokens / max(batch.prefill_seconds, 1e-9):.0f} tokens/s); decode: {batch.decode_tokens} "
        f"tokens in {batch.decode_seconds:.2f} s ({batch.decode_tokens / max(batch.decode_seconds, 1e-9):.1f} "
        f"tokens/s, {b} rows, finished rows refilled)")


def _print_new(text: str, printed: str, final: bool = False) -> str:
    """Prints the part of `text` past `printed` (what is already on stdout) and returns what is printed now. An
    unfinished character (a token that ends inside a UTF-8 sequence decodes to U+FFFD) waits for the next token
    unless `final`; a text that no longer starts with `printed` (a tokenizer that rewrites earlier text) waits."""
    if not text.startswith(printed) or (text.endswith("\ufffd") and not final):
        return printed
    print(text[len(printed):], end="", flush=True)
    return text


def read_requests(path: str, default_max_new_tokens: int):
    """[(prompt, max_new_tokens)] of a --prompts FILE.jsonl: one JSON object a line, {"prompt": str} with an
    optional positive integer "max_new_tokens" (default `default_max_new_tokens`); blank lines skipped. Read under
    the bounds of `converters.evaluation.calibration_data.json_lines` (file and line size, JSON depth). A Usage
    error for a missing file; a CheckpointError naming the file and line for anything else."""
    from pathlib import Path

    from converters.evaluation.calibration_data import json_lines
    from qformats.errors import CheckpointError
    if not Path(path).is_file():
        raise Usage(f"qformats generate: error: --prompts {path}: no such file")
    out = []
    for n, obj in json_lines(path, "a --prompts file"):
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CheckpointError(f"{path}: line {n}: expected a JSON object with a string \"prompt\", found "
                                  f"{type(obj).__name__}" + (f" with keys {sorted(obj)[:5]}" if isinstance(obj, dict)
                                                              else ""))
        extra = sorted(set(obj) - {"prompt", "max_new_tokens"})
        if extra:
            raise CheckpointError(f"{path}: line {n}: unknown keys {extra[:5]}; expected \"prompt\" and an optional "
                                  f"\"max_new_tokens\"")
        m = obj.get("max_new_tokens", default_max_new_tokens)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise CheckpointError(f"{path}: line {n}: \"max_new_tokens\": expected a positive integer, found {m!r}")
        out.append((obj["prompt"], m))
    if not out:
        raise CheckpointError(f"{path}: expected at least one request, found none")
    return out
