"""Where the test suite compiles: a pytest plugin that logs every XLA compilation, and a table of the log.

    PYTHONPATH=bench SUITE_COMPILE_LOG=/tmp/cl python -m pytest -p suite_compiles -n 2 --dist loadfile tests
    python bench/suite_compiles.py /tmp/cl            # the table: per file, the slowest programs, by name

Each compilation that misses JAX's caches (`jax._src.compiler.backend_compile_and_load`: persistent-cache hits do not
reach it) is one JSON line in SUITE_COMPILE_LOG.<xdist worker>: the test, the program's name, CPU and wall seconds, the
size of its StableHLO text and a hash of it (the same program compiled twice has the same hash). Programs under 1,500
characters are single operations: an eager dispatch (an unjitted model forward compiles hundreds). Subprocesses (the
CLI, tests/multidevice workers) are not logged. The log is for finding what to jit or to fold; the suite's time is
not asserted anywhere.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import time

SMALL = 1500  # characters of StableHLO: one eager operation
_state = {"test": "collection", "out": None}


def pytest_configure(config):
    """Wraps JAX's compile entry point (in this process) to log each compilation."""
    from jax._src import compiler

    base = os.environ.get("SUITE_COMPILE_LOG", "suite_compiles.log")
    _state["out"] = open(f"{base}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a", buffering=1)
    inner = compiler.backend_compile_and_load

    def logged(backend, module, *args, **kwargs):
        c0, w0 = time.process_time(), time.perf_counter()
        result = inner(backend, module, *args, **kwargs)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        try:
            name, text = str(module.operation.attributes["sym_name"]).strip('"'), str(module)
        except Exception:  # noqa: BLE001 -- not an MLIR module: logged without a name
            name, text = "?", ""
        _state["out"].write(json.dumps(dict(test=_state["test"], name=name, cpu=round(cpu, 3), wall=round(wall, 3),
                                            size=len(text), hash=hashlib.md5(text.encode()).hexdigest()[:12])) + "\n")
        return result

    compiler.backend_compile_and_load = logged


def pytest_runtest_setup(item):
    _state["test"] = item.nodeid


def table(base: str, top: int = 30) -> str:
    """Per file (compilations, CPU s, of them single operations), the slowest programs, the most frequent names, and
    the CPU s of programs compiled again with the same text."""
    rows = []
    folder, stem = os.path.split(os.path.abspath(base))
    for f in sorted(os.listdir(folder)):
        if f.startswith(stem + "."):
            with open(os.path.join(folder, f)) as fh:
                rows += [json.loads(line) for line in fh if line.strip()]
    small = [r for r in rows if r["size"] < SMALL]
    out = [f"{len(rows)} compilations, {sum(r['cpu'] for r in rows):.1f} CPU s; single operations (< {SMALL} "
           f"characters): {len(small)}, {sum(r['cpu'] for r in small):.1f} CPU s"]
    count, cpu = collections.Counter(r["hash"] for r in rows), collections.Counter()
    for r in rows:
        cpu[r["hash"]] += r["cpu"]
    out.append(f"compiled again with the same text: {sum(cpu[h] * (n - 1) / n for h, n in count.items()):.1f} CPU s")
    per = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    for r in rows:
        p = per[r["test"].split("::")[0]]
        p[0] += 1
        p[1] += r["cpu"]
        if r["size"] < SMALL:
            p[2] += 1
            p[3] += r["cpu"]
    out += ["", "| file | compilations | CPU s | single operations | their CPU s |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for f, (n, c, ns, cs) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append(f"| {f} | {n} | {c:.1f} | {ns} | {cs:.1f} |")
    out += ["", "| CPU s | program | characters | test |", "| ---: | --- | ---: | --- |"]
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        out.append(f"| {r['cpu']:.2f} | {r['name']} | {r['size']} | {r['test']} |")
    names = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        names[r["name"]][0] += 1
        names[r["name"]][1] += r["cpu"]
    out += ["", "| program | compilations | CPU s |", "| --- | ---: | ---: |"]
    for n, (k, c) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append(f"| {n} | {k} | {c:.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/suite_compiles.py LOG_BASE (the SUITE_COMPILE_LOG of the run)")
    print(table(sys.argv[1]))
