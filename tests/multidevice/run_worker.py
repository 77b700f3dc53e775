"""Runs tests/multidevice/worker.py cases in fresh interpreters and returns their JSON results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _env(xla_flags: str = ""):
    """The environment of a worker interpreter: this checkout first on PYTHONPATH, the CPU platform, and the caller's
    XLA_FLAGS less any host device count, plus `xla_flags` (the worker sets its own device count with
    jax_num_cpu_devices, or passes it in `xla_flags`). The suite's lean compilation (tests/conftest.py: -O0, classic
    emitters) is inherited: a worker's programs are tiny models compiled once and run for a few tokens, and every
    check of tests/multidevice compares the mesh with one device (or two processes with one) inside the same worker,
    both compiled alike."""
    env = dict(os.environ)
    kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(kept + ([xla_flags] if xla_flags else []))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _result(out: str, err: str, rc: int, what: str):
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        raise AssertionError(f"{what} exited with {rc}:\n{err[-4000:]}\n{out[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def run_case(case: str, devices: int, workdir, timeout: int = 900):
    """The JSON result of one worker case at `devices` CPU devices."""
    p = subprocess.run([sys.executable, str(WORKER), case, str(devices), str(workdir)], capture_output=True,
                       text=True, env=_env(), cwd=ROOT, timeout=timeout)
    return _result(p.stdout, p.stderr, p.returncode, f"worker {case} ({devices} devices)")


def run_processes(case: str, devices: int, workdir, processes: int, timeout: int = 600):
    """The JSON results of `processes` jax.distributed processes of `devices` CPU devices each (localhost)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(WORKER), case, str(devices), str(workdir), str(i),
                               str(processes), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(), cwd=ROOT) for i in range(processes)]
    results = []
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            results.append(_result(out, err, p.returncode, f"worker {case} process {i}"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
