"""The `gemma` package's real Gemma3_270M (random weights): qformats vs qwix quantize time, peak memory, logits error.

Usage (in a separate venv that holds `gemma`; never the project's): PY bench/flax_any_gemma3.py [--repeat 2]
       [--schemes W8A16,W4A16,NVFP4A16,FP8_E4M3] [--tokens 32]

`gemma` 3.3.0 (the last for Python 3.11) does not import from PyPI packages alone: its model code imports kauldron,
whose import chain needs tensorflow, tensorboard, IPython, mediapy, ... (clu metric writers, kauldron.inspect), and
it names `kauldron.checkpoints.AbstractPartialLoader`, which PyPI's kauldron (<= 1.4.4) calls `InitTransform`.
Installing gemma, kauldron, clu, grain and ~25 small packages with `--no-deps`, this script stubs those heavy
modules (`_stub_heavy_imports`; none of them runs in the model's forward) and aliases the kauldron class. The
model code itself (gemma's own `Einsum` modules calling `jnp.einsum` on their params) runs unchanged, with
`Gemma3_270M().init` random weights (float32, 268 M params, nothing downloaded).

Each (tool, scheme) runs in a fresh process (`--repeat` times, tools alternating): the time and process CPU time of
quantizing (qformats: `quantize_linen` with its one abstract trace; qwix 0.1.8: `quantize_model` + `quantize_params`,
PtqProvider, int8 / int4 tile 128, nvfp4, float8_e4m3fn), peak RSS growth during it (`bench/peak_rss.py`: VmHWM
over a baseline taken after `malloc_trim`), packed param MB, and the rel-L2 error of the logits against the float
model on the same tokens. The tied embedding (262144 x 640, gathered and multiplied) stays float on both sides.
Prints one markdown table (medians, min–max).

The venv (Python 3.11, from scratch; the repository root is put on sys.path by this script, so qformats need not be
installed in it):
  python3 -m venv /work/gemma-venv && P=/work/gemma-venv/bin/pip
  $P install jax==0.10.2 jaxlib==0.10.2 flax==0.12.8 ml_dtypes==0.7.0 numpy==2.4.6 safetensors google-re2 qwix==0.1.8
  $P install --no-deps gemma==3.3.0 kauldron==1.4.2 clu==0.0.12 grain==0.2.18 einops jaxtyping sentencepiece chex \
      immutabledict lark ml_collections tabulate tqdm typeguard wadler_lindig toolz packaging wrapt cloudpickle \
      pandas python-dateutil six pytz tzdata portpicker array_record
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import time
import types
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

SCHEMES = ["W8A16", "W4A16", "NVFP4A16", "FP8_E4M3"]
QWIX = {"W8A16": ("int8", 128), "W4A16": ("int4", 128), "FP8_E4M3": ("float8_e4m3fn", None),
        "NVFP4A16": ("nvfp4", 16)}
_STUBBED = ("tensorflow", "tensorflow_datasets", "tensorboard", "IPython", "mediapy", "altair", "graphviz", "cv2",
            "sklearn", "skimage", "xmanager")


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub (callable, usable as a base class: dropped)."""
    __path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *a, **k):
        return self

    def __mro_entries__(self, bases):
        return ()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def _stub_heavy_imports():
    """Lets `from gemma import gm` import without the modules in `_STUBBED` (see the module docstring)."""
    sys.meta_path.insert(0, _StubFinder())
    import kauldron.checkpoints as ckpts

    if not hasattr(ckpts, "AbstractPartialLoader"):
        ckpts.AbstractPartialLoader = ckpts.InitTransform


def child(args) -> dict:
    """One (tool, scheme) measured in this fresh process."""
    _stub_heavy_imports()
    import jax
    import jax.numpy as jnp
    from gemma import gm

    from peak_rss import PeakRSS
    from qformats.nn import Rule, quantize_linen

    warnings.simplefilter("ignore")
    model = gm.nn.Gemma3_270M()
    tokens = (jnp.arange(2 * args.tokens).reshape(2, args.tokens) * 7919 + 2) % 262144
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    ref = jax.jit(model.apply)(params, tokens).logits
    jax.block_until_ready(ref)
    name = args.scheme
    with PeakRSS() as mem:
        t, c = time.perf_counter(), time.process_time()
        if args.tool == "qformats":
            qmod, qparams = quantize_linen(model, params, [Rule("embedder/.*", None), Rule(".*", name)], tokens)
            run = lambda: qmod.apply(qparams, tokens).logits  # noqa: E731
        else:
            import qwix

            qt, tile = QWIX[name]
            rule = qwix.QtRule(module_path="layer.*", weight_qtype=qt, **({"tile_size": tile} if tile else {}))
            qm = qwix.quantize_model(model, qwix.PtqProvider([rule]))
            abstract = jax.eval_shape(qm.init, jax.random.key(0), tokens)["params"]
            qparams = {"params": qwix.quantize_params(params["params"], abstract)}
            run = lambda: qm.apply(qparams, tokens).logits  # noqa: E731
        jax.block_until_ready([x for x in jax.tree.leaves(qparams) if hasattr(x, "block_until_ready")])
        dt, dc = time.perf_counter() - t, time.process_time() - c
    mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(qparams) if hasattr(x, "dtype")) / 2**20
    out = run()
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    return {"s": dt, "cpu_s": dc, "mb_peak": mem.growth, "params_mb": mb, "err": err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tool", default="qformats")
    p.add_argument("--scheme", default="W8A16")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from flax_any import table  # the same table as bench/flax_any.py's

    print(f"Gemma3_270M (gemma package), random weights, {args.tokens} tokens x 2, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; each run a fresh process, {args.repeat} per row: median (min–max)")
    out = []
    for name in [s for s in args.schemes.split(",") if s]:
        runs, why = {"qformats": [], "qwix": []}, {}
        for _ in range(args.repeat):
            for tool in runs:
                if tool in why:
                    continue
                res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--tool", tool,
                                      "--scheme", name, f"--tokens={args.tokens}"], capture_output=True, text=True)
                line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
                if res.returncode == 0 and line:
                    runs[tool].append(json.loads(line[-1]))
                else:
                    why[tool] = (res.stderr.strip().splitlines() or ["?"])[-1]
        for tool, label in (("qformats", f"qformats {name}"), ("qwix", f"qwix {QWIX[name][0]}")):
            out.append((label, name, runs[tool] if tool not in why else None, why.get(tool)))
    print(table("Gemma3_270M (gemma 3.3.0), tied embedding float", out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
