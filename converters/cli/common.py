"""What the `qformats` subcommands share: the usage error, the raising argument parser, text and scheme arguments."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import List, Optional

__all__ = ["MAX_SHARD_SIZE_HELP", "CompileWatch", "Usage", "Parser", "add_compile_cache_argument",
           "add_parallel_arguments", "check_parallel_usage", "parallel_mesh", "cli_spelling",
           "compile_cache_dir", "enable_compile_cache", "read_text", "parse_schemes", "say", "skipped_text"]

MAX_SHARD_SIZE_HELP = ("largest safetensors file written (default 5GB; units B, KB/MB/GB = powers of 1000, "
                       "KiB/MiB/GiB = powers of 1024); a bigger checkpoint is split into shards with a "
                       "model.safetensors.index.json")

# The library's errors name its Python arguments; on the command line the same way out is an option.
_CLI_SPELLING = (
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bskip_indivisible=True\b"), "--skip-indivisible"),
    (re.compile(r"\bignore=\[\.\.\.\]"), "--ignore PATTERN"),
    (re.compile(r"\bscheme='([^']*)'"), r"--scheme \1"),
    (re.compile(r"\bmax_new_tokens=([0-9]+)"), r"--max-new-tokens \1"),
    (re.compile(r"\bseq_len=([0-9]+)"), r"--seq-len \1"),
    (re.compile(r"\bbatch_size=([0-9]+)"), r"--batch-size \1"),
    (re.compile(r"\ba smaller seq_len or batch_size\b"), "a smaller --seq-len or --batch-size"),
    (re.compile(r",? or leave them dense with a rule \(Rule\(path, None\) before the quantizing rule\)"), ""),
)


class Usage(Exception):
    """A usage error: `main` prints its message on stderr and exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse that raises `Usage` instead of exiting, so `main` returns 2."""

    def error(self, message: str):
        raise Usage(f"{self.prog}: error: {message}")


def cli_spelling(message: str) -> str:
    """A library error message as the command line says it: `overwrite=True` -> `--overwrite`,
    `skip_indivisible=True` -> `--skip-indivisible`, `ignore=[...]` -> `--ignore PATTERN`, `scheme='X'` ->
    `--scheme X`, `max_new_tokens=N` / `seq_len=N` / `batch_size=N` -> `--max-new-tokens N` ...; a way out that only the Python API has (a `Rule`)
    is dropped."""
    for pattern, cli in _CLI_SPELLING:
        message = pattern.sub(cli, message)
    return message


def skipped_text(head: str, skipped: List[str], width: int = 100) -> str:
    """"<head>left dense by --skip-indivisible (N): <paths>", layer numbers folded (`qformats.plan.paths_text`) and
    wrapped to `width` (`qformats.plan.wrap_list`)."""
    from qformats.plan import paths_text, wrap_list
    sep = "/" if any("/" in p for p in skipped) else "."
    return wrap_list(f"{head}left dense by --skip-indivisible ({len(skipped)}): ", paths_text(skipped, sep), width)


def read_text(flag: str, name: str) -> str:
    """The UTF-8 text of the file given to `flag`; a Usage error when it is missing, a CheckpointError naming the
    file when it is over the size cap or not strict UTF-8 (`converters.evaluation.calibration_data.read_text_file`)."""
    path = Path(name)
    if not path.is_file():
        raise Usage(f"qformats: error: {flag} {path}: no such file")
    from converters.evaluation.calibration_data import read_text_file
    return read_text_file(path, f"{flag} text")


def parse_schemes(text: str) -> List[str]:
    """A comma-separated --schemes / --scheme value -> its scheme strings ("stored" and "dense" kept as they are),
    every other one checked by `qformats.presets.parse_scheme` before any load (SchemeError: exit 1)."""
    from qformats.presets import parse_scheme
    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise Usage(f"qformats: error: --schemes {text!r}: expected a comma-separated list of schemes")
    for s in out:
        if s.lower() not in ("stored", "dense"):
            parse_scheme(s)
    return out


def compile_cache_dir() -> Path:
    """Where the CLI keeps JAX's persistent compilation cache: $QFORMATS_COMPILE_CACHE when it names a directory,
    else $XDG_CACHE_HOME/qformats/jax, else ~/.cache/qformats/jax."""
    env = os.environ.get("QFORMATS_COMPILE_CACHE", "")
    if env not in ("", "0", "1"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qformats" / "jax"


def add_compile_cache_argument(p: argparse.ArgumentParser, when: str = "") -> None:
    """--no-compile-cache on a subcommand that compiles (generate, eval, quantize --calibrate); `when` prefixes its
    help ("with --calibrate: ")."""
    p.add_argument("--no-compile-cache", action="store_true",
                   help=f"{when}do not use JAX's persistent compilation cache (default: on, in {compile_cache_dir()} - "
                        f"$XDG_CACHE_HOME/qformats/jax or ~/.cache/qformats/jax, or $QFORMATS_COMPILE_CACHE; "
                        f"QFORMATS_COMPILE_CACHE=0 turns it off; a cache the caller configured, "
                        f"JAX_COMPILATION_CACHE_DIR, is kept), so a second run of the same command does not "
                        f"compile again")


def enable_compile_cache(enabled: bool = True) -> Optional[Path]:
    """Turns on JAX's persistent compilation cache in `compile_cache_dir()` and returns the directory in use, or
    None when it stays off. The caller's own setting wins: with JAX_COMPILATION_CACHE_DIR set or
    jax.config.jax_compilation_cache_dir already set, that directory is kept (returned); with `enabled` False or
    QFORMATS_COMPILE_CACHE=0 nothing changes. In the directory it turns on, every program is cached
    (jax_persistent_cache_min_compile_time_secs 0, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS is set; JAX's
    default, 1 s, leaves out the dozens of small programs a calibration compiles: ~2 CPU s a run). On CPU, XLA's GPU
    caches stay off (jax_persistent_cache_enable_xla_caches "none", unless JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES is
    set): they would put the directory's path into every cache key, and a cache moved or copied would never hit."""
    import jax

    current = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if current:
        return Path(current)
    if not enabled or os.environ.get("QFORMATS_COMPILE_CACHE") == "0":
        return None
    path = compile_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: run without the cache rather than fail
        import warnings
        warnings.warn(f"compilation cache {path}: {e}; compiling without it")
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ and jax.default_backend() == "cpu":
        # XLA's own caches are GPU ones; left on, they put this directory's path into every program's compile
        # options, so into every cache key: a cache moved or copied to another path would never hit
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return path


def say(message: str) -> None:
    """One progress line on stderr ("qformats: ..."), flushed: the process says what it is doing, also with --json
    (whose result alone goes to stdout)."""
    import sys
    print(f"qformats: {message}", file=sys.stderr, flush=True)


class CompileWatch:
    """While active, counts JAX's persistent compilation cache look-ups (`jax.monitoring` events): `hits` programs
    loaded from the cache, `misses` compiled afresh."""

    _HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"

    def __init__(self):
        self.hits = self.misses = 0

    def _listen(self, event: str, **kwargs) -> None:
        if event == self._HIT:
            self.hits += 1
        elif event == self._MISS:
            self.misses += 1

    def __enter__(self) -> "CompileWatch":
        import jax.monitoring
        jax.monitoring.register_event_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring
        jax.monitoring.unregister_event_listener(self._listen)

    def text(self, cache: Optional[Path]) -> str:
        """"persistent cache hit" / "miss" / "off" in words, for the compile line."""
        if cache is None:
            return "persistent compilation cache off"
        if self.hits and not self.misses:
            return f"persistent cache hit, {cache}"
        if self.misses and not self.hits:
            return f"persistent cache miss, {cache}"
        if self.misses:
            return f"persistent cache: {self.hits} of {self.hits + self.misses} programs loaded, {cache}"
        return "in-process cache hit"


def add_parallel_arguments(p) -> None:
    """--tensor-parallel N / --expert-parallel N on parser `p` (the decoder run on N x M devices)."""
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="run on N devices, Megatron-style (q/k/v/gate/up split by output channels, o/down by input "
                        "channels, embeddings by vocabulary, KV cache by heads); on a CPU-only host the CPU devices "
                        "are made before JAX starts. A shape N cannot divide is an error naming the layer")
    p.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                   help="mixture-of-experts models: split every expert stack by experts over N devices (E / N "
                        "experts each); only activations cross devices. With --tensor-parallel M: N x M devices. "
                        "num_experts not a multiple of N, or a model without experts, is an error")


def check_parallel_usage(a, command: str) -> None:
    """Usage error for a --tensor-parallel / --expert-parallel below 1."""
    for flag, n in (("--tensor-parallel", getattr(a, "tensor_parallel", None)),
                    ("--expert-parallel", getattr(a, "expert_parallel", None))):
        if n is not None and n < 1:
            raise Usage(f"qformats {command}: error: {flag} must be >= 1, got {n}")


def parallel_mesh(a):
    """The mesh of a.tensor_parallel x a.expert_parallel devices (`converters.pipelines.mesh_load.parallel_setup`),
    or None when neither is given. Call before any other JAX operation."""
    tp, ep = getattr(a, "tensor_parallel", None), getattr(a, "expert_parallel", None)
    if tp is None and ep is None:
        return None
    from converters.pipelines.mesh_load import parallel_setup
    return parallel_setup(tp or 1, ep or 1)
