"""qformats.plan's texts: natural order of module paths, paths folded by layer number, wrapped lists, the fit
refusal with its ways out first."""

from __future__ import annotations

import pytest

from qformats.errors import ModelError
from qformats.plan import check_fits, divisible_group_scheme, group_paths, natural_key, paths_text, wrap_list
from qformats.presets import parse_scheme


def test_natural_key_orders_numbers_as_numbers():
    names = ["layers.10.q", "layers.2.q", "layers.1.q", "embed", "layers.1.k"]
    assert sorted(names, key=natural_key) == ["embed", "layers.1.k", "layers.1.q", "layers.2.q", "layers.10.q"]


def test_group_paths_folds_layer_numbers():
    paths = [f"model.layers.{i}.self_attn.q_proj" for i in (10, 0, 1, 2, 3, 5)] + ["lm_head"]
    got = group_paths(paths)
    assert [(p, len(m)) for p, m in got] == [("lm_head", 1), ("model.layers.{0..3,5,10}.self_attn.q_proj", 6)]
    assert got[1][1][0] == "model.layers.0.self_attn.q_proj" and got[1][1][-1] == "model.layers.10.self_attn.q_proj"
    assert group_paths(["a/3/b", "a/4/b"], "/") == [("a/{3,4}/b", ["a/3/b", "a/4/b"])]
    assert paths_text(["x.1.y", "x.2.y", "x.3.y", "z"]) == ["x.{1..3}.y (3)", "z"]


def test_wrap_list_breaks_lines():
    text = wrap_list("head: ", [f"model.layers.{i}.mlp.down_proj" for i in range(40)], 80)
    lines = text.splitlines()
    assert len(lines) > 10 and all(len(x) <= 80 for x in lines) and lines[1].startswith("    model.layers.")
    assert text.replace("\n    ", " ").count(", ") == 39


def test_check_fits_groups_layers_and_puts_the_way_out_first():
    ss = parse_scheme("W4A16")
    layers = [(f"model/layers/{i}/self_attn/{p}", 576, ss) for i in range(30) for p in ("q_proj", "v_proj")]
    layers += [("model/layers/0/mlp/down_proj", 1536, ss)]
    with pytest.raises(ModelError) as e:
        check_fits(layers, static_acts=False)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("60 layer(s) do not fit their scheme's groups")
    assert lines[1].startswith("Ways out: a group size that divides their in_features (e.g. 'W4A16:g64')")
    assert lines[2:] == [
        "  model/layers/{0..29}/self_attn/q_proj (30 layers): weight group size 128 of W4A16 (int4 group128 "
        "scale=input/absmax) does not divide in_features = 576 (columns=576 not divisible by group_size=128)",
        "  model/layers/{0..29}/self_attn/v_proj (30 layers): weight group size 128 of W4A16 (int4 group128 "
        "scale=input/absmax) does not divide in_features = 576 (columns=576 not divisible by group_size=128)"]


def test_divisible_group_scheme():
    w = parse_scheme("W4A16:g128:w")
    assert divisible_group_scheme([(576, w.weights, w), (1000, w.weights, w)]) == "W4A16:g8:w"
    assert divisible_group_scheme([(100, w.weights, w)]) is None
    mx = parse_scheme("MXFP4A16")
    assert divisible_group_scheme([(48, mx.weights, mx)]) is None  # MX groups are 32 by definition
