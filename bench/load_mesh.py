"""Load time and peak host memory: unsharded vs sharded onto a CPU mesh vs transformers' from_pretrained.

  python bench/load_mesh.py [--workdir DIR] [--smollm2 /tmp/smollm2-dense] [--layers 22] [--repeat 1]
                            [--only smollm2-dense,smollm2-w4a16-g64,tinyllama-bf16]

Checkpoints (made once under --workdir, each in a child process):
  - smollm2-dense: a dense float32 SmolLM2-135M HF directory (default /tmp/smollm2-dense; made from the
    embedded GGUF by `converters.formats.gguf_convert` when the path does not exist);
  - smollm2-w4a16-g64: the same quantized by `qformats quantize SRC DST --scheme W4A16:g64` (compressed-tensors
    pack-quantized; embeddings and norms stay float32);
  - tinyllama-bf16: the TinyLlama-1.1B-shaped random bf16 checkpoint of bench/checkpoint.py (`build`, 3 shards).

Each load runs in a FRESH interpreter that first imports its libraries and starts its runtime (JAX's CPU
devices; torch + transformers), warms nothing else, records its baseline, then times the load alone
(`time.perf_counter` around the call, parameters made ready: `jax.block_until_ready`) and reads
/proc/self/status: VmHWM (peak resident set: anonymous + file-backed pages, i.e. memory-mapped checkpoint
pages count while mapped) and RssAnon (sampled every 2 ms during the load: the peak; and after it). Loaders:
  - ours: `converters.pipelines.causal_lm.load_causal_lm(SRC, param_dtype=<stored dtype>)`, one device;
  - ours, N devices: `converters.pipelines.causal_lm.load_causal_lm(SRC, mesh=mesh)` on an N-device CPU mesh
    (`tensor_parallel_setup(N)`), the decoder's Megatron layout (`tensor_parallel_rules`) with every logical
    axis that N does not divide replicated instead (SmolLM2's 9 heads / 3 KV heads at N=8, TinyLlama's 4 KV
    heads at N=8: the table says which); per-device parameter bytes are `param_bytes_per_device`;
  - transformers: `AutoModelForCausalLM.from_pretrained(SRC, dtype=<stored dtype>)` (torch, CPU; for the
    compressed-tensors checkpoint, transformers' compressed-tensors integration, which decompresses the packed
    weights to dense torch weights unless the layout runs compressed); then every weight's pages are touched
    once (one byte per 4 KiB), timed apart, since torch tensors of the stored dtype stay views of the mapped file.
All files are read once before the runs (page cache warm for every loader alike). On a CPU mesh all "devices"
live in this one process, so a sharded load holds the whole model in host memory too: what it bounds is the
transient (one shard at a time), not the total. Prints the markdown table of BENCHMARKS.md's section "Sharded
loading"; update that section with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out


class _PeakAnon:
    """Peak RssAnon while the block runs, sampled every `interval` seconds in a thread."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval

    def __enter__(self):
        self.peak = _status()["RssAnon"]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _status()["RssAnon"])

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _status()["RssAnon"])


def _stored_dtype(src: Path) -> str:
    cfg = json.loads((src / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def mesh_rules(config, n: int, axis: str = "tp"):
    """The decoder's Megatron rules (`decoder.tensor_parallel_rules`) on an `n`-device axis, with every logical
    axis whose size `n` does not divide (in whole heads for heads / KV heads) replicated instead.

    Returns (rules, names of the logical axes replicated for that reason)."""
    from qformats.models import decoder
    from qformats.sharding import ShardingRules

    sizes = {"vocab": config.vocab_size, "heads": config.num_heads, "kv_heads": config.num_kv_heads,
             "mlp": config.intermediate_size}
    base = decoder.tensor_parallel_rules(config, axis)
    mesh_axes, dropped = [], []
    for logical, ax in base.mesh_axes:
        if ax is not None and sizes.get(logical, n) % n:
            dropped.append(logical)
            ax = None
        mesh_axes.append((logical, ax))
    return ShardingRules(base.params, tuple(mesh_axes), base.units), dropped


def child(kind: str, src: Path, devices: int) -> dict:
    """One load in this (fresh) process; returns the measurements."""
    dtype = _stored_dtype(src)
    res = {"kind": kind, "devices": devices, "dtype": dtype}
    if kind == "transformers":
        import torch
        from transformers import AutoModelForCausalLM
        import transformers.utils.logging as tl

        tl.set_verbosity_error()
        torch.set_num_threads(os.cpu_count() or 1)
        base = _status()
        with _PeakAnon() as pk:
            t0 = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype))
            wall = time.perf_counter() - t0
        params = list(model.parameters()) + list(model.buffers())
        seen, nbytes = set(), 0
        for p in params:
            if p.data_ptr() in seen:
                continue  # tied weights
            seen.add(p.data_ptr())
            nbytes += p.numel() * p.element_size()
        res.update(param_bytes=nbytes, per_device=nbytes, all_devices=nbytes,
                   param_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in params}),
                   linear=type(model.model.layers[0].mlp.down_proj).__name__,
                   packed=sorted({n.rpartition(".")[2] for n, _ in model.named_parameters() if "packed" in n}))
        res["vmhwm_loaded"] = _status()["VmHWM"]
        # tensors of the stored dtype can stay views of the memory-mapped file, read on first use: page every
        # weight in once (one byte per 4 KiB page) to see what the deferred reading costs
        t0 = time.perf_counter()
        touched = 0
        with torch.no_grad():
            for p in params:
                if p.numel():
                    touched += int(p.detach().reshape(-1).view(torch.uint8)[::4096].sum())
        res["touch_s"] = time.perf_counter() - t0
    else:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from converters.pipelines.causal_lm import load_causal_lm
        from converters.pipelines.mesh_load import ReadStats, tensor_parallel_setup
        from qformats.models.decoder import DecoderConfig
        from qformats.nn.sharding import param_bytes_per_device

        mesh = tensor_parallel_setup(devices) if kind == "sharded" else None
        jax.block_until_ready(jax.device_put(jnp.zeros(8), jax.devices()[0]))  # runtime started before baseline
        pdt = jnp.dtype(dtype)
        base = _status()
        st = ReadStats()
        with _PeakAnon() as pk:
            t0 = time.perf_counter()
            if kind == "sharded":
                cfg = DecoderConfig.from_hf(json.loads((src / "config.json").read_text()))
                rules, dropped = mesh_rules(cfg, devices)
                model, _, _ = load_causal_lm(src, mesh=mesh, rules=rules, param_dtype=pdt,
                                             tokenizer=False, stats=st)
                res["replicated_axes"] = dropped
            else:
                model, _, _ = load_causal_lm(src, param_dtype=pdt, tokenizer=False)
            leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
            jax.block_until_ready(leaves)
            wall = time.perf_counter() - t0
        per = param_bytes_per_device(model)
        res.update(param_bytes=sum(int(x.nbytes) for x in leaves), per_device=max(per.values()),
                   all_devices=sum(per.values()),
                   per_device_min=min(per.values()), n_devices=len(per), largest_slice=st.largest,
                   param_dtypes=sorted({str(x.dtype) for x in leaves}))
    end = _status()
    res.update(load_s=wall, vmhwm=res.pop("vmhwm_loaded", end["VmHWM"]), vmhwm_end=end["VmHWM"], peak_anon=pk.peak, anon_after=end["RssAnon"],
               base_anon=base["RssAnon"], base_rss=base["VmRSS"])
    return res


def run_child(kind: str, src: Path, devices: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)  # tensor_parallel_setup sets the CPU device count itself
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, __file__, "--child", kind, str(src), str(devices)], capture_output=True,
                       text=True, env=env)
    proc_s = time.monotonic() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        return {"kind": kind, "devices": devices, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    r = json.loads(lines[-1][len("RESULT "):])
    r["process_s"] = proc_s
    return r


def prepare(work: Path, smollm2: Path, layers: int, only) -> dict:
    """name -> checkpoint directory, each made once (in a child process) if missing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    out = {}
    if not smollm2.exists():
        smollm2 = work / "smollm2-dense"
        if not smollm2.exists():
            subprocess.run([sys.executable, "-c", "import sys; "
                            "from converters.evaluation.embedded import smollm2_gguf; "
                            "from converters.formats.gguf_convert import convert_gguf; "
                            "convert_gguf(smollm2_gguf(), sys.argv[1])",
                            str(smollm2)], check=True, env=env)
    if "smollm2-dense" in only:
        out["smollm2-dense"] = smollm2
    if "smollm2-w4a16-g64" in only:
        w4 = work / "smollm2-w4a16-g64"
        if not w4.exists():
            subprocess.run([sys.executable, "-m", "converters.cli", "quantize", str(smollm2), str(w4), "--scheme",
                            "W4A16:g64", "--quiet"], check=True, env=env)
        out["smollm2-w4a16-g64"] = w4
    if "tinyllama-bf16" in only:
        tl = work / f"tinyllama-bf16-{layers}"
        if not tl.exists():
            subprocess.run([sys.executable, str(ROOT / "bench" / "checkpoint.py"), "--layers", str(layers),
                            "--build-only", str(tl)], check=True, env=env)
        out["tinyllama-bf16"] = tl
    return out


def _warm(path: Path) -> int:
    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as h:
            while True:
                b = h.read(1 << 24)
                if not b:
                    break
                n += len(b)
    return n


def _mib(x) -> str:
    return f"{x / MIB:.0f}"


def table(results, meta) -> str:
    lines = [f"## Loading onto a mesh: load time and peak host memory, sharded vs unsharded vs transformers "
             f"(bench/load_mesh.py, {meta['date']}, {meta['machine']}, load average {meta['load']})", "",
             "Each row is one load in a fresh interpreter after its imports and runtime start (page cache warm). "
             "load s: the load call alone; process s: the whole child (imports, runtime start, load, exit). "
             "VmHWM: peak resident set of the process (anonymous + mapped file pages); peak anon: RssAnon "
             "sampled every 2 ms during the load, and its growth over the pre-load baseline. "
             "param: the model's parameter bytes; per device: on the fullest device; all devices: summed over the "
             "mesh (replicated parameters once per device: on a CPU mesh every copy is in this one process). "
             "transient (ours): peak anon - baseline - all devices, the host memory beyond the placed arrays; "
             "largest slice: the largest single shard placed. transformers' growth can be below its parameter "
             "bytes: torch tensors of the stored dtype stay memory-mapped file pages, read on first use; paged in: "
             "the time to touch every page of every weight once after the load, and VmHWM then. A negative "
             "transient: some of our arrays alias the mapped file too (no copy).",
             "",
             "| checkpoint | files MB | loader | devices | param dtype | load s | process s | VmHWM MiB | "
             "peak anon MiB | anon growth MiB | param MiB | per device MiB | all devices MiB | transient MiB | "
             "largest slice MiB | paged in: s, VmHWM MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for name, size, r in results:
        loader = {"ours": "qformats load_causal_lm", "sharded": "qformats load_causal_lm(mesh=)",
                  "transformers": "transformers from_pretrained"}[r["kind"]]
        if "error" in r:
            lines.append(f"| {name} | {size / 1e6:.0f} | {loader} | {r['devices']} | - | failed |" + " - |" * 10)
            notes.append(f"{name}, {loader}: {r['error']}")
            continue
        if r.get("replicated_axes"):
            notes.append(f"{name} at {r['devices']} devices: {', '.join(r['replicated_axes'])} not divisible by "
                         f"{r['devices']}, replicated")
        if r["kind"] == "transformers" and (r.get("packed") or r.get("linear") not in (None, "Linear")):
            notes.append(f"{name}, transformers: projections load as {r['linear']} holding "
                         f"{', '.join(r['packed']) or 'dense weights'} (run compressed, not decompressed)")
        dts = "/".join(r["param_dtypes"])
        ours = r["kind"] != "transformers"  # our parameters are anonymous memory; transformers' may map the file
        transient = _mib(r["peak_anon"] - r["base_anon"] - r["all_devices"]) if ours else "-"
        slice_ = f"{r['largest_slice'] / MIB:.1f}" if r["kind"] == "sharded" else "-"
        touch = f"{r['touch_s']:.2f}, {_mib(r['vmhwm_end'])}" if "touch_s" in r else "-"
        lines.append(f"| {name} | {size / 1e6:.0f} | {loader} | {r['devices']} | {dts} | {r['load_s']:.2f} | "
                     f"{r['process_s']:.1f} | {_mib(r['vmhwm'])} | {_mib(r['peak_anon'])} | "
                     f"{_mib(r['peak_anon'] - r['base_anon'])} | {_mib(r['param_bytes'])} | {_mib(r['per_device'])} | "
                     f"{_mib(r['all_devices'])} | {transient} | {slice_} | {touch} |")
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where the checkpoints are made (kept for reruns)")
    ap.add_argument("--smollm2", default="/tmp/smollm2-dense", help="dense SmolLM2 HF directory")
    ap.add_argument("--layers", type=int, default=22, help="layers of the TinyLlama-shaped checkpoint")
    ap.add_argument("--only", default="smollm2-dense,smollm2-w4a16-g64,tinyllama-bf16")
    ap.add_argument("--repeat", type=int, default=1, help="loads per row; the row keeps the fastest")
    ap.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], Path(a.child[1]), int(a.child[2]))), flush=True)
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="qformats-load-mesh-"))
    work.mkdir(parents=True, exist_ok=True)
    cks = prepare(work, Path(a.smollm2), a.layers, a.only.split(","))
    plan = {"smollm2-dense": [("ours", 1), ("sharded", 3), ("sharded", 8), ("transformers", 1)],
            "smollm2-w4a16-g64": [("ours", 1), ("sharded", 3), ("sharded", 8), ("transformers", 1)],
            "tinyllama-bf16": [("ours", 1), ("sharded", 4), ("sharded", 8), ("transformers", 1)]}
    results = []
    for name, path in cks.items():
        size = _warm(path)
        for kind, n in plan[name]:
            runs = [run_child(kind, path, n) for _ in range(a.repeat)]
            ok = [r for r in runs if "error" not in r]
            r = min(ok, key=lambda r: r["load_s"]) if ok else runs[0]
            print(name, json.dumps(r), file=sys.stderr, flush=True)
            results.append((name, size, r))
    load = os.getloadavg()
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=f"{os.cpu_count()}-core CPU",
                load=" / ".join(f"{x:.2f}" for x in load))
    text = table(results, meta)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
