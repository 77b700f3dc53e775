"""Suite-wide settings and fixtures: one JAX compilation cache per test run, the garbage collector tuned for tracing, and
the embedded SmolLM2 converted once per run."""

from __future__ import annotations

import gc
import os
import sys

import pytest

# One intra-op thread per test process for torch (and OpenMP / BLAS numpy): the suite runs one process per core
# (`pytest -n 2` on 2 cores), and an OpenMP pool with more threads than free cores spin-waits for its
# descheduled workers: transformers' 32-step SmolLM2 greedy loop took 45-51 s of CPU with 2 threads on a busy
# 2-core host against 3 s with one. Results do not depend on it beyond accumulation order, which the tests
# that compare with torch allow for. An OMP_NUM_THREADS set by the caller is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# XLA compiles the suite's programs with little optimization work: JAX's jax_disable_most_optimizations (LLVM at -O0,
# no expensive LLVM passes) and XLA:CPU's classic loop emitters instead of its MLIR fusion emitters
# (--xla_cpu_use_fusion_emitters=false in XLA_FLAGS); XLA's HLO passes, fusion included, still run. Compiling is
# most of the suite's time (67% of tests/qformats/models/decoder/test_decoder_scan.py's wall time, py-spy --idle) and
# these programs run once or a few times on tiny shapes: that file 79 -> 49 s (-O0) -> 41 s (and classic emitters).
# What changes: at full optimization XLA:CPU contracts a * b + c into one fused multiply-add, and rsqrt and tanh
# are computed otherwise, so fused floating-point code (norms, attention, activations) may differ in its last bits.
# What does not: quantize / dequantize / packing / the packed and scaled dots, bit for bit (tests/
# test_optimization_level.py: every finite bfloat16 value for 13 presets). A module whose claim rests on those
# last bits against a reference computed outside XLA (torch's bit-exact scales) sets `pytestmark =
# pytest.mark.full_optimization`: -O3 for it (the emitters and the code splitting below are fixed per process; those
# modules pass with either). Inherited by the CLI and multi-device subprocesses. QFORMATS_TEST_FULL_OPTIMIZATION=1
# runs the whole suite as users' programs compile.
#
# And XLA:CPU emits each program's code as one LLVM module (--xla_cpu_parallel_codegen_split_count=1) instead of
# splitting it into parts compiled on a thread pool: with one test process per core the threads only compete with
# the other process, and every part pays its own setup. Only how the code is compiled changes, not what it computes
# (tests/test_optimization_level.py compiles its lean programs this way and finds the exact paths bit-equal):
# tests/qformats/nn + algorithms + test_packed_dot.py + test_decoder_scan.py (363 tests, -n 2) 151-154 -> 132-135 s
# wall, 264-269 -> 236-241 CPU s.
LEAN_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
if os.environ.get("QFORMATS_TEST_FULL_OPTIMIZATION", "0") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    for _flag in LEAN_XLA_FLAGS:
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Python's cyclic garbage collector less often: tracing and compiling allocate millions of short-lived objects, and
# with the default thresholds (700, 10, 10) the collector ran 2,300 times in tests/qformats/models/decoder/
# test_decoder_model.py (3.2 of its 59 CPU s); at (20000, 20, 50) 116 times (1.8 s). Objects are still collected;
# only how often the collector looks changes. After collection the imported modules are frozen out of its scans.
gc.set_threshold(20000, 20, 50)


def pytest_configure(config):
    if sys.modules.get("jax") is not None:  # imported before this file (a plugin): its flag was read already
        sys.modules["jax"].config.update("jax_disable_most_optimizations",
                                         os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "0") in ("1", "true", "True"))
    if sys.modules.get("torch") is not None:  # imported before this file (a plugin): its pool size is fixed
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # `-n N --dist loadfile` (or loadscope): xdist hands out files in the order the workers collected them
    # (pytest_collection_modifyitems below: the heaviest first), not re-sorted by its own default, the number of
    # tests per file, which left the few-test files of one long fixture each (the 8-device workers) for the end
    if getattr(config.option, "dist", None) in ("loadfile", "loadscope") and hasattr(config.option,
                                                                                     "loadscopereorder"):
        config.option.loadscopereorder = False


# The estimated cost of a test for the order of files under xdist: marked slow (over ~20 s), or not (most well under
# a second). Only the order of whole files changes, and only in xdist workers; a file's tests keep theirs.
SLOW_COST, FAST_COST = 20.0, 0.5


def pytest_collection_finish(session):
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Under xdist, the files of the collection heaviest first (the sum of SLOW_COST / FAST_COST over their tests;
    ties in collection order), so that with `--dist loadfile` the long files start at once and the workers finish
    on short ones: the wall time approaches the total over the workers instead of waiting for one long file last."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cost, first = {}, {}
    for i, item in enumerate(items):
        f = item.nodeid.split("::", 1)[0]
        first.setdefault(f, i)
        cost[f] = cost.get(f, 0.0) + (SLOW_COST if item.get_closest_marker("slow") else FAST_COST)
    items.sort(key=lambda item: (-cost[item.nodeid.split("::", 1)[0]], first[item.nodeid.split("::", 1)[0]]))


@pytest.fixture(scope="session", autouse=True)
def jax_compilation_cache(tmp_path_factory):
    """JAX's persistent compilation cache in a directory of this run only (shared by the xdist workers of the
    run, under pytest's own temporary root, which pytest rotates away): a computation compiled by one test,
    worker or subprocess (the CLI, tests/multidevice) is loaded, not compiled again, by the next one that
    lowers to the same HLO. Executables loaded from the cache are the compiled ones (XLA serialises them), so
    what a test checks does not change; only the compile time of repeats goes.

    Set QFORMATS_TEST_JAX_CACHE=0 to compile everything afresh. Either way the CLI's own default cache
    (~/.cache/qformats/jax, converters.cli.common.enable_compile_cache) stays untouched: it keeps a directory the
    caller configured (this one), and QFORMATS_COMPILE_CACHE=0 turns it off."""
    if os.environ.get("QFORMATS_TEST_JAX_CACHE", "1") == "0":
        saved = os.environ.get("QFORMATS_COMPILE_CACHE")
        os.environ["QFORMATS_COMPILE_CACHE"] = "0"  # inherited by the CLI subprocesses too
        yield None
        if saved is None:
            os.environ.pop("QFORMATS_COMPILE_CACHE", None)
        else:
            os.environ["QFORMATS_COMPILE_CACHE"] = saved
        return
    import jax

    path = run_root(tmp_path_factory) / "jax-compilation-cache"
    path.mkdir(exist_ok=True)
    keys = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    saved = {k: os.environ.get(k) for k in keys}
    # inherited by subprocesses; every executable is cached, not only those that took over a second to compile:
    # the suite compiles thousands of small ones, many of them again in another module or worker (-9% wall)
    os.environ.update(zip(keys, (str(path), "0")))
    prev = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    yield path
    jax.config.update("jax_compilation_cache_dir", prev[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", prev[1])
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_root(tmp_path_factory):
    """The temporary root of this pytest run: shared by its xdist workers (each worker's basetemp is a folder of
    it), pytest's own basetemp without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def smollm2_dense(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct GGUF converted by `converters.formats.gguf_convert.convert_gguf` into a dense
    float32 HF directory, once per test run: the first xdist worker that needs it converts it under a file lock
    (convert_gguf renames the finished directory into place), the others wait for it and read the same directory
    (tests must not write into it)."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    import fcntl

    from converters.evaluation.embedded import smollm2_gguf
    from converters.formats.gguf_convert import convert_gguf

    home = run_root(tmp_path_factory) / "smollm2"
    home.mkdir(exist_ok=True)
    dst = home / "dense"
    with open(home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not dst.is_dir():
                convert_gguf(smollm2_gguf(), dst)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return dst


@pytest.fixture(scope="module", autouse=True)
def full_optimization(request):
    """For a module marked `full_optimization`: JAX's jax_disable_most_optimizations off while it runs (its
    subprocesses too), JAX's in-memory caches cleared on the way in and out (their keys do not hold the flag; the
    persistent cache's do)."""
    if request.node.get_closest_marker("full_optimization") is None:
        yield
        return
    import jax

    saved = jax.config.values["jax_disable_most_optimizations"], os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    try:
        yield
    finally:
        jax.clear_caches()
        jax.config.update("jax_disable_most_optimizations", saved[0])
        if saved[1] is None:
            os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        else:
            os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = saved[1]


@pytest.fixture(scope="module", autouse=True)
def release_compiled_per_module():
    """After each test module, drop JAX's in-memory executables and tracing caches (and collect garbage): a
    worker runs dozens of modules, and their compiled SmolLM2-sized programs otherwise stay resident until the
    worker exits (one worker reached 5.8 GB). A later module that needs the same program loads it from the
    run's persistent compilation cache above."""
    yield
    import gc

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
