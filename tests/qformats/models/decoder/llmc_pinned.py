"""The tiny Qwen3-MoE cross-checks against llm-compressor (test_moe_*_llmc.py): the model and samples of
bench/gptq_llmc_moe_fixture.py with the results pinned from llm-compressor (no torch needed here)."""

from pathlib import Path

import numpy as np


def pinned_llmc_source(data: Path, dst: Path):
    """The llm-compressor cross-checks' inputs: (bench/gptq_llmc_moe_fixture.py as a module, the pinned results in
    `data` (.npz), the tiny Qwen3-MoE checkpoint written to `dst`, the pinned calibration samples). The model's weight
    digest must equal the one pinned with the results."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gptq_llmc_moe_fixture", Path(__file__).resolve().parents[4] / "bench" / "gptq_llmc_moe_fixture.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fx = dict(np.load(data))
    tensors = gen.tiny_qwen3_moe()
    assert gen.digest(tensors) == str(fx["digest"]), "the tiny MoE decoder's weights changed: regenerate the fixture"
    src = gen.write_checkpoint(dst, tensors)
    return gen, fx, src, np.split(fx["ids"], np.cumsum(fx["lengths"])[:-1])


def pinned_family_source(data: Path, dst: Path, family: str = "deepseek_v3"):
    """The same for the tiny `family` model of bench/awq_llmc_families_fixture.py (deepseek_v3, qwen2_moe):
    (bench/gptq_llmc_families_fixture.py as a module, with that script's configs added, the pinned results, the
    checkpoint written to `dst`, the pinned samples); the weight digest and config must equal the pinned ones."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "awq_llmc_families_fixture", Path(__file__).resolve().parents[4] / "bench" / "awq_llmc_families_fixture.py")
    fam = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fam)
    gen = fam.families()
    fx = dict(np.load(data))
    name = fam.FAMILY[family]
    assert json.loads(str(fx["config"])) == gen.FAMILIES[name], "the tiny model's config changed"
    tensors = gen.tensors(name)
    assert gen.digest(tensors) == str(fx["digest"]), "the tiny model's weights changed: regenerate the fixture"
    src = gen.write_checkpoint(name, dst, tensors)
    return gen, fx, src, np.split(fx["ids"], np.cumsum(fx["lengths"])[:-1])


def awq_rtn_codes(model, samples, scheme: str):
    """Our side of the AWQ cross-checks: AWQ (`awq_transform`) + round-to-nearest `scheme` on `model` in place
    (float propagation, unpacked), then each quantized weight's integer codes by llm-compressor's per-expert name
    (`...experts.{e}.{proj}` for a QExperts stack). Returns (codes {name: int8 array}, the AWQ record)."""
    import jax.numpy as jnp

    from qformats.models.decoder.calibration import awq_transform, calibrate_decoder
    from qformats.nn import quantized_layers
    from qformats.nn.experts import QExperts

    rec = []
    calibrate_decoder(model, samples, scheme, weight_search="rtn", propagate="float",
                      transform=awq_transform(scheme, record=rec), pack=False)
    codes = {}
    for path, q in quantized_layers(model).items():
        name = path.replace("/", ".")
        head, proj = name.rsplit(".", 1)
        qs = [(f"{head}.{e}.{proj}", q.expert_weight(e)) for e in range(q.num_experts)] \
            if isinstance(q, QExperts) else [(name, q.kernel.get_value())]
        for n, qa in qs:
            codes[n] = np.asarray(qa.element_values(jnp.float32)).astype(np.int8)
    return codes, rec
