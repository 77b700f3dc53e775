"""converters.formats.compressed_tensors.read with legacy `weight_g_idx` (activation-ordered GPTQ groups): the fixture
is built by hand (neither compressed-tensors 0.20 nor llm-compressor 0.14 writes one): a pack-quantized checkpoint plus
a permuted group index. The reader gives the dense weight W[:, j] = (q[:, j] - z[:, g[j]]) * s[:, g[j]], computed here
with compressed-tensors' own unpacking; the trivial index still reads as a QArray."""

import json
import warnings

import numpy as np
import pytest

import qformats as qf
from converters.formats.compressed_tensors.read import read_compressed
from converters.formats.compressed_tensors.write import write_compressed
from converters.formats.safetensors_io import SafetensorsFile, save_file
from qformats.qarray import QArray

torch = pytest.importorskip("torch")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

RNG = np.random.default_rng(0)
W = (RNG.standard_normal((64, 24)) * 0.1).astype(np.float32)  # Flax [K, N]: torch [24, 64], 2 groups of 32


def _fixture(path, preset, g_idx):
    ss = qf.presets[preset]
    import dataclasses
    sch = dataclasses.replace(ss.weights, group_size=32)
    write_compressed(path, {"m.a.weight": qf.quantize(W, sch, axis=0)}, dataclasses.replace(ss, weights=sch),
                     config={"model_type": "tiny"})
    f = path / "model.safetensors"
    with SafetensorsFile(f) as sf:
        t = {k: np.array(sf.get(k)) for k in sf.keys()}
    t["m.a.weight_g_idx"] = g_idx.astype(np.int32)
    save_file(t, f)
    return t


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_permuted_g_idx_reads_dense_by_the_formula(tmp_path, preset):
    g = RNG.permutation(np.arange(64) // 32)
    t = _fixture(tmp_path / "ck", preset, g)
    with pytest.warns(UserWarning, match="m.a.*activation-ordered groups.*dense"):
        got = read_compressed(tmp_path / "ck").modules["m.a"]["weight"]
    assert not isinstance(got, QArray) and got.shape == (24, 64)
    q = unpack_from_int32(torch.from_numpy(t["m.a.weight_packed"]), 4, torch.Size([24, 64])).numpy()
    s = t["m.a.weight_scale"]
    z = np.zeros_like(s)
    if "m.a.weight_zero_point" in t:
        z = unpack_from_int32(torch.from_numpy(t["m.a.weight_zero_point"]), 4, torch.Size([24, 2]),
                              packed_dim=0).numpy()
    want = (q[:, np.arange(64)] - z[:, g]) * s[:, g]
    np.testing.assert_array_equal(got, want.astype(s.dtype))


def test_trivial_g_idx_stays_packed(tmp_path):
    _fixture(tmp_path / "ck", "W4A16", np.arange(64) // 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = read_compressed(tmp_path / "ck").modules["m.a"]["weight"]
    assert isinstance(got, QArray)


def test_out_of_range_g_idx_is_an_error(tmp_path):
    from qformats.errors import CheckpointError
    _fixture(tmp_path / "ck", "W4A16", np.r_[np.zeros(63), 2])
    with pytest.raises(CheckpointError, match=r"weight_g_idx.*\[0, 1\]"):
        read_compressed(tmp_path / "ck")
