"""Whole-checkpoint quantization and reader throughput on a TinyLlama-1.1B-shaped random bf16 checkpoint.

  python bench/checkpoint.py [--layers 22] [--schemes FP8_DYNAMIC,W4A16,NVFP4A16] [--workdir DIR]
                             [--no-baseline] [--oneshot-python VENV/bin/python]

Builds the checkpoint (LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
num_attention_heads=32, num_key_value_heads=4), vocab 32000, 3 shards) from random normal weights, then for
each scheme runs, each in a fresh process measured with os.wait4 (wall time, peak RSS):
  - `qformats quantize SRC DST --scheme S` (this library), and
  - a compressed-tensors baseline: the data-free path of llm-compressor's `oneshot` done with
    compressed-tensors directly (load the state dict in torch, apply the preset to nn.Linear modules,
    min-max weight qparams, ModelCompressor.compress_model, save shards + config). llm-compressor itself
    (which pins compressed-tensors 0.19) is not installed here, so this is a proxy for it that skips its
    model instantiation, hooks and pipeline overhead: it is a lower bound on oneshot's cost.
Then the reader: bytes/s of `open_checkpoint(...).get` (copying every tensor) vs safetensors' own
`safe_open(framework="pt").get_tensor().clone()` on the same dense files, and `read_compressed` on the W4A16 output.
Prints the markdown tables of BENCHMARKS.md's sections "Checkpoint quantization vs llm-compressor oneshot" and
"Checkpoint reader"; update those sections with them (the figures there are the current ones).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000)


def llama_shapes(layers: int):
    h, i, v = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"]
    kv = h // LLAMA["num_attention_heads"] * LLAMA["num_key_value_heads"]
    yield "model.embed_tokens.weight", (v, h)
    for n in range(layers):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def build(dst: Path, layers: int) -> int:
    import ml_dtypes

    from converters.formats.shard_writer import ShardedWriter
    shapes = list(llama_shapes(layers))
    total = sum(int(np.prod(s)) * 2 for _, s in shapes)
    rng = np.random.default_rng(0)
    dst.mkdir(parents=True)
    with ShardedWriter(dst, max_shard_size=total // 3 + 1) as w:
        for name, shape in shapes:
            if len(shape) == 1:
                a = np.ones(shape, np.float32)
            else:
                a = rng.standard_normal(shape, np.float32) * np.float32(0.02)
            w.add(name, a.astype(ml_dtypes.bfloat16))
    cfg = dict(LLAMA, num_hidden_layers=layers, architectures=["LlamaForCausalLM"], model_type="llama",
               torch_dtype="bfloat16", rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return total


BASELINE = r'''
import json, math, sys, warnings
warnings.filterwarnings("ignore")
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam, \
    maybe_pad_tensor_for_block_quant
src, dst, preset = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
sd = {}
for f in sorted(src.glob("*.safetensors")):
    sd.update(load_file(str(f)))
root = torch.nn.Module()
for name, t in sd.items():
    mod, _, local = name.rpartition(".")
    node = root
    for p in mod.split("."):
        if p not in node._modules:
            node.add_module(p, torch.nn.Module())
        node = node._modules[p]
    if t.ndim == 2 and "embed" not in mod and "norm" not in mod and local == "weight":
        lin = torch.nn.Linear(1, 1, bias=False)
        lin.weight = torch.nn.Parameter(t, requires_grad=False)
        parent = root
        parts = mod.split(".")
        for p in parts[:-1]:
            parent = parent._modules[p]
        parent._modules[parts[-1]] = lin
    else:
        node.register_parameter(local, torch.nn.Parameter(t, requires_grad=False))
cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"])
apply_quantization_config(root, cfg)
for _, m in root.named_modules():
    s = getattr(m, "quantization_scheme", None)
    if s is None or s.weights is None:
        continue
    a, w = s.weights, m.weight.data
    st = a.strategy.value if hasattr(a.strategy, "value") else a.strategy
    gs = None
    if st == "tensor_group":
        gs = generate_gparam(w.min(), w.max()); m.weight_global_scale.data.copy_(gs)
    if st == "channel":
        mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif st in ("group", "tensor_group"):
        v = w.unflatten(-1, (w.shape[-1] // a.group_size, a.group_size)); mn, mx = v.amin(-1), v.amax(-1)
    elif st == "block":
        bh, bw = a.block_structure; v = maybe_pad_tensor_for_block_quant(w, (bh, bw))
        v = v.reshape(v.shape[0] // bh, bh, v.shape[1] // bw, bw); mn, mx = v.amin((1, 3)), v.amax((1, 3))
    else:
        mn, mx = torch.aminmax(w)
    sc, zp = calculate_qparams(mn, mx, a, global_scale=gs)
    m.weight_scale.data.copy_(sc.reshape(m.weight_scale.shape))
mc = ModelCompressor.from_pretrained_model(root)
mc.compress_model(root)
dst.mkdir(parents=True)
out = {k: v.contiguous() for k, v in root.state_dict().items()}
names = sorted(out); third = math.ceil(len(names) / 3)
for i in range(3):
    save_file({k: out[k] for k in names[i * third:(i + 1) * third]}, str(dst / f"model-{i + 1:05d}-of-00003.safetensors"))
(dst / "config.json").write_text((src / "config.json").read_text())
mc.update_config(str(dst))
'''


ONESHOT = r'''
import sys, warnings
warnings.filterwarnings("ignore")
import torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, dst, preset = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"]))
model.save_pretrained(dst, save_compressed=True)
'''


def measure(cmd, env=None):
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({rc}): {err[-2000:]}")
    return wall, ru.ru_maxrss / 1024  # MiB (ru_maxrss is KiB on Linux)


def read_ours(path: Path) -> float:
    from converters.formats.safetensors_io import open_checkpoint
    t0 = time.monotonic()
    n = 0
    with open_checkpoint(path) as ck:
        for k in ck.keys():
            n += np.array(ck.get(k)).nbytes  # copy: every byte is read
    return n / (time.monotonic() - t0)


def read_ref(path: Path) -> float:
    from safetensors import safe_open
    t0 = time.monotonic()
    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k).clone()  # copy, as read_ours does: every byte is read
                n += t.numel() * t.element_size()
    return n / (time.monotonic() - t0)


def read_compressed_rate(path: Path) -> float:
    from converters.formats.compressed_tensors.read import read_compressed
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    t0 = time.monotonic()
    read_compressed(path)
    return size / (time.monotonic() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--schemes", default="FP8_DYNAMIC,W4A16,NVFP4A16")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--oneshot-python", default=None,
                    help="python of a separate venv with llmcompressor installed: also time its real oneshot")
    ap.add_argument("--build-only", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.build_only:
        build(Path(a.build_only), a.layers)
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="qformats-bench-"))
    src = work / "src"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not src.exists():
        # in a child process: this one must stay small, as a forked child's peak RSS counts the parent's pages
        wall, _ = measure([sys.executable, __file__, "--layers", str(a.layers), "--build-only", str(src)], env)
        print(f"built {src} ({a.layers} layers) in {wall:.0f}s", file=sys.stderr)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    rows = []
    for s in a.schemes.split(","):
        dst = work / f"q-{s}"
        wall, rss = measure([sys.executable, "-m", "converters.cli", "quantize", str(src), str(dst), "--scheme", s,
                             "--quiet", "--overwrite"], env)
        out = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
        row = {"scheme": s, "ours_s": wall, "ours_rss": rss, "out_gb": out / 1e9}
        if not a.no_baseline:
            bdst = work / f"ct-{s}"
            if bdst.exists():
                import shutil
                shutil.rmtree(bdst)
            bwall, brss = measure([sys.executable, "-c", BASELINE, str(src), str(bdst), s], env)
            row.update(ct_s=bwall, ct_rss=brss)
        if a.oneshot_python:
            odst = work / f"oneshot-{s}"
            if odst.exists():
                import shutil
                shutil.rmtree(odst)
            owall, orss = measure([a.oneshot_python, "-c", ONESHOT, str(src), str(odst), s],
                                  dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
            row.update(os_s=owall, os_rss=orss)
        rows.append(row)
        print(row, file=sys.stderr)
    read_ref(src), read_ours(src)  # warm the page cache
    r_ours, r_ref = read_ours(src), read_ref(src)
    w4 = work / "q-W4A16"
    r_ct = read_compressed_rate(w4) if w4.exists() else float("nan")
    lines = [f"## bench/checkpoint.py — TinyLlama-shaped random bf16, {a.layers} layers, {total / 1e9:.2f} GB, "
             f"3 shards ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs)", "",
             "| scheme | qformats quantize s | peak RSS MiB | CT baseline s | CT peak RSS MiB | speedup | RSS ratio | "
             "llm-compressor oneshot s | oneshot peak RSS MiB | speedup vs oneshot | RSS ratio vs oneshot | out GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ct_s, ct_rss = r.get("ct_s"), r.get("ct_rss")
        ours_s, ours_rss = r["ours_s"], r["ours_rss"]
        cells = [r["scheme"], f"{ours_s:.1f}", f"{ours_rss:.0f}",
                 "-" if ct_s is None else f"{ct_s:.1f}", "-" if ct_rss is None else f"{ct_rss:.0f}",
                 "-" if ct_s is None else f"{ct_s / ours_s:.2f}x",
                 "-" if ct_rss is None else f"{ours_rss / ct_rss:.2f}"]
        os_s, os_rss = r.get("os_s"), r.get("os_rss")
        cells += ["-" if os_s is None else f"{os_s:.1f}", "-" if os_rss is None else f"{os_rss:.0f}",
                  "-" if os_s is None else f"{os_s / ours_s:.2f}x",
                  "-" if os_rss is None else f"{ours_rss / os_rss:.2f}", f"{r['out_gb']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"reader: open_checkpoint().get + copy {r_ours / 1e9:.2f} GB/s vs safetensors safe_open(pt) + clone "
                  f"{r_ref / 1e9:.2f} GB/s (ratio {r_ours / r_ref:.2f}); read_compressed(W4A16) "
                  f"{r_ct / 1e9:.2f} GB/s of file", "",
              "CT baseline = compressed-tensors' data-free quantize+compress+save in torch (a lower bound on "
              "llm-compressor's cost); oneshot = llm-compressor's own `oneshot` (+ save_pretrained compressed) "
              "in a separate venv (--oneshot-python), when given.", ""]
    text = "\n".join(lines)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
