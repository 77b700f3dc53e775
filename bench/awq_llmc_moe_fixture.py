"""Generates tests/qformats/models/decoder/data/awq_llmc_moe_tiny.npz: llm-compressor's AWQ result on a tiny Qwen3-MoE.

The model and samples are bench/gptq_llmc_moe_fixture.py's (`tiny_qwen3_moe`: 2 sparse layers, 8 experts of 32, top-2;
the first 32 of its one-token samples, whose attention output is v itself, so both sides see the same layer inputs whatever the
mask). llm-compressor 0.14's `oneshot` (its venv, `--llmc-python`) runs [AWQModifier(n_grid=20, duo_scaling=True),
QuantizationModifier(W4A16 int4 symmetric groups of 32, lm_head and the routers ignored)] with its Qwen3-MoE AWQ
mappings (`_moe_default_mappings`: post_attention_layernorm balanced over the router and every expert's gate / up,
each expert's up_proj over its down_proj) and `moe_calibrate_all_experts=True`, batch 1, samples unshuffled. The
fixture keeps, per quantized module, its int4 codes (two per byte) and group scales, and the smoothed norms and
routers, plus the weights' digest; tests/qformats/models/decoder/test_moe_awq_llmc.py runs our AWQ on the same model
and compares.

    python bench/awq_llmc_moe_fixture.py [--llmc-python /work/oneshot/bin/python] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np


SAMPLES = 32
"""The first 32 of the 96 one-token samples: their AWQ grid search runs the whole MoE block (every expert on every
token) once per grid point and sample (~10 min on the busy 2-core machine with 96)."""


def _moe_fixture():
    spec = importlib.util.spec_from_file_location("gptq_llmc_moe_fixture",
                                                  Path(__file__).parent / "gptq_llmc_moe_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def theirs_script(dense) -> str:
    """The llm-compressor script (`dense`: bench/gptq_llmc_fixture.py as a module): AWQ then W4A16 RTN, every expert
    calibrated on every token; saves each quantized module's smoothed weight, codes and scales, the norms, routers."""
    return dense.ONESHOT_PREAMBLE + dense.W4_GROUP + r"""
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
# AWQ pins its cached batches (host -> GPU copies); a CPU-only torch cannot pin: pinning moves no value
IntermediatesCache.pin_memory = lambda self, batch_index: None
oneshot(model=model, processor=tok, dataset=ds,
        recipe=[AWQModifier(n_grid=20, duo_scaling=True),
                QuantizationModifier(config_groups={"group_0": w4}, ignore=["lm_head", "re:.*mlp.gate$"])],
        max_seq_length=512, num_calibration_samples=len(ids), shuffle_calibration_samples=False,
        moe_calibrate_all_experts=True)
res = {}
for name, m in model.named_modules():
    if hasattr(m, "weight_scale"):
        w, s = m.weight.detach().float(), m.weight_scale.detach().float()
        # round-to-nearest (the QuantizationModifier leaves the smoothed weights float until compression)
        codes = torch.clamp(torch.round(w / s.repeat_interleave(group, dim=1)), -8, 7).to(torch.int8)
        res[name + ".smoothed"] = w.numpy()
        res[name + ".codes"] = codes.numpy()
        res[name + ".scale"] = s.numpy()
    elif name.endswith("layernorm") or name.endswith("mlp.gate"):
        res[name + ".weight"] = m.weight.detach().float().numpy()
print(sorted(res)[:6], len(res), file=sys.stderr)
np.savez(out, **res)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llmc-python", default="/work/oneshot/bin/python")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "qformats" / "models" /
                                         "decoder" / "data" / "awq_llmc_moe_tiny.npz"))
    a = ap.parse_args()
    gen = _moe_fixture()
    tensors = gen.tiny_qwen3_moe()
    samples = gen.tiny_samples("single")[:SAMPLES]
    dense = gen._dense()
    with tempfile.TemporaryDirectory() as d:
        src = gen.write_checkpoint(Path(d) / "tiny", tensors)
        theirs = dense.run_oneshot(a.llmc_python, theirs_script(dense), src, samples, Path(d) / "theirs.npz",
                                   gen.GROUP)
    fixture = {"digest": np.array(gen.digest(tensors)), "lengths": np.array([len(s) for s in samples]),
               "ids": np.concatenate(samples)}
    missing = [n for n in gen.modules() if n + ".codes" not in theirs]
    if missing:
        raise SystemExit(f"llm-compressor quantized no {missing[:4]} ...; it quantized {sorted(theirs)[:8]}")
    for name in gen.modules():
        fixture[name + ".codes"] = dense.pack(theirs[name + ".codes"])
        fixture[name + ".scale"] = theirs[name + ".scale"]
    fixture.update({k: v for k, v in theirs.items() if k.endswith(".weight")})
    for layer in range(gen.CONFIG["num_hidden_layers"]):  # a few smoothed float weights, for the scales' comparison
        for name in (f"model.layers.{layer}.mlp.experts.0.gate_proj", f"model.layers.{layer}.mlp.experts.0.down_proj"):
            fixture[name + ".smoothed"] = theirs[name + ".smoothed"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **fixture)
    print(f"wrote {a.out} ({Path(a.out).stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
