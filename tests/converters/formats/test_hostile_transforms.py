"""A transform_config the readers cannot apply -- a lone Hadamard group added to a W4A8 checkpoint, a rotation
whose counterpart targets no stored module -- is refused by read_compressed, dequantize_checkpoint and
`qformats dequantize` (one `qformats: error:` line), never dropped; groups whose rotations cancel are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import qformats as qf
from converters.cli import main
from converters.formats.compressed_tensors.read import read_compressed
from converters.formats.compressed_tensors.transforms import online_rotations, parse_transform_config
from converters.formats.compressed_tensors.write import write_compressed
from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint
from qformats.errors import CheckpointError

W = (np.random.default_rng(3).standard_normal((128, 32)) * 0.1).astype(np.float32)  # a Flax kernel [in, out]
DOWN, UP = "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def w4a8(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("w4a8") / "ck"
    ss = qf.presets["W4A8"]
    write_compressed(d, {f"{DOWN}.weight": qf.quantize(W, ss.weights, axis=0),
                         f"{UP}.weight": qf.quantize(W, ss.weights, axis=0),
                         "model.norm.weight": np.ones(32, np.float32)}, ss, config={"model_type": "llama"})
    return d


def _with_transform(src: Path, dst: Path, apply) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["transform_config"] = {"config_groups": {"had": {"type": "hadamard",
                                                                                "apply": apply}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _args(targets, location, inverse=False):
    return {"targets": targets, "location": location, "inverse": inverse, "ignore": []}


REFUSED = [
    ([_args(["Linear"], "weight_input")], "'weight_input' .* nothing in the group to undo it"),
    ([_args([f"re:.*down_proj$"], "weight_output", True)], "'weight_output' .* nothing in the group to undo it"),
    ([_args(["Linear"], "weight_input"), _args(["Linear"], "weight_output")], "nothing in the group to undo it"),
    ([_args(["Linear"], "input")], "'input' .* nothing in the group to undo it"),
    ([_args(["Linear"], "input"), _args(["Linear"], "weight_input", True)], "online rotations .* at run time"),
    ([_args(["re:.*self_attn$"], "q_attn")], "'q_attn' .* nothing in the group to undo it"),
    ([_args(["re:.*embed_tokens$"], "weight_output"), _args(["re:.*up_proj$"], "weight_input", True)],
     "'weight_output' targets .*embed_tokens.* name no module"),
    ([_args(["re:.*down_proj$"], "weight_output"), _args(["lm_head"], "weight_input", True)],
     "'weight_input' targets \\['lm_head'\\] name no module"),
]


@pytest.mark.parametrize("apply, match", REFUSED)
def test_unapplied_transform_groups_are_refused(w4a8, tmp_path, capsys, apply, match):
    d = _with_transform(w4a8, tmp_path / "ck", apply)
    with pytest.raises(CheckpointError, match=match) as e:
        read_compressed(d)
    assert "config.json" in str(e.value) and "had" in str(e.value)
    with pytest.raises(CheckpointError, match=match):
        dequantize_checkpoint(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["dequantize", str(d), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("qformats: error:") and "\n" not in err and "config.json" in err, err
    assert not (tmp_path / "out2").exists()


def test_cancelled_offline_pair_is_read(w4a8, tmp_path):
    """An offline pair whose two sides both name stored modules (SpinQuant R1/R2's form) is fused into the
    stored weights: read as stored, as before."""
    d = _with_transform(w4a8, tmp_path / "ck", [_args(["re:.*down_proj$"], "weight_output"),
                                                 _args(["re:.*up_proj$"], "weight_input", True)])
    want = read_compressed(w4a8).qarrays()
    got = read_compressed(d).qarrays()
    assert sorted(got) == sorted(want)
    for k in got:
        np.testing.assert_array_equal(np.asarray(qf.dequantize(got[k])), np.asarray(qf.dequantize(want[k])))
    assert dequantize_checkpoint(d, tmp_path / "out") == 2


def test_empty_group_applies_nothing_and_is_read(w4a8, tmp_path):
    d = _with_transform(w4a8, tmp_path / "ck", [])
    assert sorted(read_compressed(d).qarrays()) == sorted(read_compressed(w4a8).qarrays())


def test_online_rotation_on_a_module_the_decoder_cannot_rotate_is_refused():
    """The loader's side: an online location matching a module of the wrong kind, or no module at all."""
    modules = {"model.layers.0.self_attn": "Attention", f"{DOWN}": "Linear"}
    tensors = {f"model.layers.0.self_attn.had_input.weight": np.eye(4), f"{DOWN}.had_input.weight": np.eye(4)}
    groups = parse_transform_config({"config_groups": {"had": {"type": "hadamard", "apply": [
        _args(["re:.*"], "input"), _args(["re:.*"], "weight_input", True)]}}})
    with pytest.raises(CheckpointError, match="'input' rotation to 'model.layers.0.self_attn' \\(Attention\\)"):
        online_rotations(groups, tensors, modules, "ck")
    groups = parse_transform_config({"config_groups": {"had": {"type": "hadamard", "apply": [
        _args(["re:.*gate_proj$"], "input"), _args(["re:.*gate_proj$"], "weight_input", True)]}}})
    with pytest.raises(CheckpointError, match="online 'input' targets .*gate_proj.* name no module"):
        online_rotations(groups, {"model.layers.0.mlp.gate_proj.weight": np.zeros((2, 2))}, modules, "ck")


def test_loader_refuses_an_offline_side_naming_no_stored_module():
    modules = {f"{DOWN}": "Linear"}
    groups = parse_transform_config({"config_groups": {"had": {"type": "hadamard", "apply": [
        _args(["re:.*embed_tokens$"], "weight_output"), _args(["re:.*down_proj$"], "weight_input", True)]}}})
    with pytest.raises(CheckpointError, match="'weight_output' targets .*embed_tokens.* name no module"):
        online_rotations(groups, {f"{DOWN}.weight": np.zeros((2, 2))}, modules, "ck")
    assert online_rotations(groups, {f"{DOWN}.weight": np.zeros((2, 2)), "model.embed_tokens.weight": np.zeros((2, 2))},
                            modules, "ck") == ([], [])
