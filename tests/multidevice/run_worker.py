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


# XLA's CPU backend at LLVM optimisation level 0 in the workers: their programs are tiny models compiled once and
# run for a few tokens, so compiling is most of their time and O0 cuts it by about a third (moe_mesh_worker's
# generate: 7.8 -> 5.4 s of CPU on one device, 9.1 -> 6.8 s on 8). Every check of tests/multidevice compares the
# mesh with one device (or two processes with one) inside the same worker, both compiled with these flags.
WORKER_XLA_FLAGS = "--xla_backend_optimization_level=0"


def _env(xla_flags: str = ""):
    """The environment of a worker interpreter: this checkout first on PYTHONPATH, the CPU platform, and XLA_FLAGS
    of WORKER_XLA_FLAGS (plus `xla_flags`) in place of the caller's (the worker sets its own device count with
    jax_num_cpu_devices, or passes it in `xla_flags`)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (WORKER_XLA_FLAGS, xla_flags) if f)
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
