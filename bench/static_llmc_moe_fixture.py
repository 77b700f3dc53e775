"""Generates tests/qformats/models/decoder/data/static_llmc_moe_tiny.npz: llm-compressor's static activation scales
for every projection (experts included) of a tiny Qwen3-MoE.

The model and samples are bench/gptq_llmc_moe_fixture.py's (`tiny_qwen3_moe`, 2 sparse layers, 8 experts of 32,
top-2; the "single" samples: 96 one-token sequences, whose attention output is v itself, so both sides see the same
layer inputs whatever the attention mask). llm-compressor 0.14's `oneshot` (its venv, `--llmc-python`) runs
QuantizationModifier with compressed-tensors' static-activation presets FP8 (per-tensor e4m3 input_scale, observer
static_minmax) and NVFP4 (input_global_scale = 448 * 6 / max|x|, observer static_minmax), lm_head and the routers
ignored, batch 1, samples unshuffled, twice: `moe_calibrate_all_experts=True` (its default: every expert observes
every token) and False (each expert observes the tokens routed to it). The fixture keeps, per quantized module and
run, the stored input_scale / input_global_scale (and the NVFP4 weight_global_scale, the FP8 weight_scale), plus the
weights' digest; tests/qformats/models/decoder/test_moe_static_llmc.py runs our calibration on the same model and
compares.

    python bench/static_llmc_moe_fixture.py [--llmc-python /work/oneshot/bin/python] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

RUNS = (("FP8", "all"), ("FP8", "routed"), ("NVFP4", "all"), ("NVFP4", "routed"))
"""(compressed-tensors preset, moe statistics) of each llm-compressor run."""


def _moe_fixture():
    spec = importlib.util.spec_from_file_location("gptq_llmc_moe_fixture",
                                                  Path(__file__).parent / "gptq_llmc_moe_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BODY = r"""
from llmcompressor.modifiers.quantization import QuantizationModifier
scheme, all_experts = args[0], args[1] == "all"
oneshot(model=model, processor=tok, dataset=ds,
        recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head", "re:.*mlp.gate$"]),
        max_seq_length=512, num_calibration_samples=len(ids), shuffle_calibration_samples=False,
        moe_calibrate_all_experts=all_experts)
res = {}
for name, m in model.named_modules():
    for local in ("input_scale", "input_global_scale", "weight_scale", "weight_global_scale"):
        if hasattr(m, local) and not (scheme == "NVFP4" and local == "weight_scale"):
            res[f"{name}.{local}"] = getattr(m, local).detach().float().numpy().reshape(-1)
print(sorted(res)[:6], len(res), file=sys.stderr)
np.savez(out, **res)
"""
"""The llm-compressor script after bench/gptq_llmc_fixture.py's ONESHOT_PREAMBLE; args: (preset, "all" | "routed")."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "qformats" / "models" /
                                         "decoder" / "data" / "static_llmc_moe_tiny.npz"))
    a = ap.parse_args()
    gen = _moe_fixture()
    tensors = gen.tiny_qwen3_moe()
    samples = gen.tiny_samples("single")
    fixture = {"digest": np.array(gen.digest(tensors)), "lengths": np.array([len(s) for s in samples]),
               "ids": np.concatenate(samples)}
    dense = gen._dense()
    with tempfile.TemporaryDirectory() as d:
        src = gen.write_checkpoint(Path(d) / "tiny", tensors)
        for scheme, stats in RUNS:
            theirs = dense.run_oneshot(a.llmc_python, dense.ONESHOT_PREAMBLE + BODY, src, samples,
                                       Path(d) / f"{scheme}_{stats}.npz", scheme, stats)
            local = "input_scale" if scheme == "FP8" else "input_global_scale"
            missing = [n for n in gen.modules() if f"{n}.{local}" not in theirs]
            if missing:
                raise SystemExit(f"{scheme}/{stats}: llm-compressor wrote no {local} for {missing[:4]} ...")
            for k, v in theirs.items():
                fixture[f"{scheme}/{stats}/{k}"] = v
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **fixture)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
