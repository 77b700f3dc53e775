"""Process tuning for long calibration runs: glibc's malloc settings, transparent huge pages and XLA:CPU's compile
flags.

These change how this process allocates and compiles, never what it computes (checkpoints written with and without
them are byte-identical). Library functions do not apply them; the `qformats` CLI starts a calibration by restarting
itself with huge-page malloc (`reexec_with_hugepage_malloc`) and wraps the calibration call in `lean_calibration()`;
a script may do the same. The memory they save: BENCHMARKS.md, "Calibration (GPTQ, AWQ,
SmoothQuant) vs llm-compressor".
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from typing import Callable, Iterator, Mapping, Optional

__all__ = ["lean_malloc", "trim_malloc", "lean_compile", "lean_calibration", "HUGEPAGE_TUNABLE", "hugepage_malloc_env",
           "reexec_with_hugepage_malloc"]

HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's malloc tunable (2.35 and later): 1 = malloc advises the kernel to back its heap and its mapped blocks with
transparent huge pages (madvise MADV_HUGEPAGE)."""
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_CODEGEN_SPLIT = "--xla_cpu_parallel_codegen_split_count"


def lean_malloc(mmap_threshold: int = 1 << 20, arena_max: int = 2, trim_threshold: int = 16 << 20) -> bool:
    """Makes glibc's malloc hand large blocks back to the system as soon as they are freed, for this process.

    XLA:CPU allocates every run's activations and temporary buffers with malloc. By default glibc raises its mmap
    threshold up to 32 MiB after such blocks are freed, so they are then carved from the heap and kept there, and
    each XLA worker thread gets its own arena that keeps its own: the resident set climbs above what is live.
    Here: blocks >= `mmap_threshold` bytes are mapped and unmapped on each use (mallopt M_MMAP_THRESHOLD, which
    also stops the threshold's growth), free memory at an arena's top is returned once it exceeds `trim_threshold`
    bytes (M_TRIM_THRESHOLD), and at most `arena_max` arenas are made from now on (M_ARENA_MAX). Not undone: it holds
    for the whole process.

    Why the trim threshold is not the mmap threshold: the heaps then hold only blocks under `mmap_threshold`, and a
    top returned at every 1 MiB made each regrowth fault in (zeroed) pages afresh: on the Python-docs GPTQ bench
    (BENCHMARKS.md) 16 MiB cut minor faults 2.76-2.95 M -> 2.40-2.60 M and system seconds 22-24 -> 19-22 at +7-15 MiB
    of peak resident set; 64 or 256 MiB did no better.

    Returns True when every option was accepted; False (and changes nothing) where the C library has no mallopt
    (not glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # glibc's <malloc.h> parameter numbers
    return bool(mallopt(m_mmap_threshold, mmap_threshold) and mallopt(m_trim_threshold, trim_threshold)
                and mallopt(m_arena_max, arena_max))


def trim_malloc() -> bool:
    """Hands the free pages of every malloc arena back to the system now (glibc's `malloc_trim(0)`).

    XLA's compilations (LLVM) and runs leave many small freed blocks scattered through the heap and through each
    worker thread's arena; glibc returns only the free top of the main heap by itself. Called between the phases
    of a layer's calibration (the `between_phases` callback of `quantize_calibrated_lm`), it keeps the resident
    set near what is live. Returns False where there is no malloc_trim (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


@contextlib.contextmanager
def lean_compile() -> Iterator[None]:
    """While the block runs, XLA_FLAGS asks XLA:CPU to compile each module as one piece
    (`--xla_cpu_parallel_codegen_split_count=1`, unless XLA_FLAGS already sets that flag); restored after.

    XLA reads the flags when JAX's CPU backend starts, so this takes effect only in a process whose first JAX
    computation happens inside the block (the `qformats` CLI, a fresh script); elsewhere nothing changes.
    Parallel code generation compiles the pieces of a module at once, and their LLVM temporaries add up; one
    piece at a time lowers the peak. Also usable as a decorator: `@lean_compile()`."""
    before = os.environ.get("XLA_FLAGS")
    if _CODEGEN_SPLIT not in (before or ""):
        os.environ["XLA_FLAGS"] = f"{before} {_CODEGEN_SPLIT}=1" if before else f"{_CODEGEN_SPLIT}=1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = before


@contextlib.contextmanager
def lean_calibration() -> Iterator[Callable[[], bool]]:
    """The process tuning of a calibration run: `lean_malloc()` (for the whole process) and `lean_compile()` while
    the block runs; yields `trim_malloc`, the `between_phases` callback to hand to `quantize_calibrated_lm`.

        with lean_calibration() as between_phases:
            quantize_calibrated_lm(src, dst, scheme, calibration, between_phases=between_phases)
    """
    lean_malloc()
    with lean_compile():
        yield trim_malloc


def hugepage_malloc_env(environ: Optional[Mapping[str, str]] = None, thp_path: str = _THP_ENABLED) -> Optional[dict]:
    """The environment (`environ`, default os.environ) with GLIBC_TUNABLES += "glibc.malloc.hugetlb=1", under which
    a new process's malloc asks for transparent huge pages; None where that would change nothing or is not this
    function's to decide: the C library is not glibc >= 2.35, the kernel's THP mode (`thp_path`) is missing or
    "never", or GLIBC_TUNABLES already sets the tunable (the caller's choice, 0 included, is kept).

    Why: with `lean_malloc`, XLA:CPU's per-run temporaries (tens of MiB a layer pass) are mapped afresh for every
    run and each 4 KiB page faults on first touch: 14.4 M faults and ~22% of a calibration's CPU seconds in the
    kernel (SmolLM2, 15k tokens, GPTQ, 2 cores). With huge pages a fault maps 2 MiB: 4.1 M faults, the whole process
    119-120 -> 103-106 s wall and 203-205 -> 175-180 CPU s, the same peak resident set (521 -> 525 MiB) and the
    same bytes written (BENCHMARKS.md). Tunables are read when a process starts: hence a new process
    (`reexec_with_hugepage_malloc`). Measured for calibration (under `lean_malloc`) only: `qformats eval --text`
    (without it) ran slower under huge pages (SmolLM2, 16 windows: 33.3 -> 45.1 s wall, system time 6.3 -> 24.1 s),
    so the CLI restarts for `quantize --calibrate` alone.
    """
    env = dict(os.environ if environ is None else environ)
    lib, version = platform.libc_ver()
    try:
        new_enough = lib == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 35)
        with open(thp_path) as f:
            mode = f.read()
    except (OSError, ValueError):
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if not new_enough or "[never]" in mode or "[" not in mode or HUGEPAGE_TUNABLE in tunables:
        return None
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGEPAGE_TUNABLE}=1" if tunables else f"{HUGEPAGE_TUNABLE}=1"
    return env


def reexec_with_hugepage_malloc() -> None:
    """Replaces this process by the same command line (`sys.orig_argv`, `sys.executable`) started under
    `hugepage_malloc_env()`, where that is not None (after which it is None: no loop); otherwise returns and changes
    nothing. Call it first thing in a program that owns its process (the `qformats` CLI, a script), before it reads
    input or writes output: the new process starts over (standard output and error are flushed first).
    GLIBC_TUNABLES=glibc.malloc.hugetlb=0 in the environment keeps malloc as it is."""
    env = hugepage_malloc_env()
    if env is None or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
