"""Scheme strings (qformats.presets.parse_scheme): NAME[:gN][:w], the one parser eval, quantize and quantize_model use."""

from __future__ import annotations

import dataclasses

import pytest

from qformats import SchemeError, SchemeSet, presets
from qformats.presets import parse_scheme


def test_plain_name_is_the_preset():
    assert parse_scheme("W4A16") == presets["W4A16"]
    assert parse_scheme("nvfp4a16") == presets["NVFP4A16"]


@pytest.mark.parametrize("text", ["W4A16:g64", "w4a16:G64", " W4A16:g64 "])
def test_group_override_changes_only_the_weight_group_size(text):
    ss = parse_scheme(text)
    base = presets["W4A16"]
    assert ss.name == "W4A16:g64"
    assert ss.weights == dataclasses.replace(base.weights, group_size=64)
    assert ss.input_activations == base.input_activations and ss.output_activations == base.output_activations


def test_group_override_keeps_activations():
    ss = parse_scheme("W4AFP8:g32")
    assert ss.weights.group_size == 32 and ss.weights.strategy == "group"
    assert ss.input_activations == presets["W4AFP8"].input_activations
    assert ss.name == "W4AFP8:g32"


@pytest.mark.parametrize("text", ["W4AFP8:g64:w", "W4AFP8:w:g64", "w4afp8:W:g64"])
def test_weights_only_and_group_combine_in_any_order(text):
    assert parse_scheme(text) == SchemeSet("W4AFP8:g64:w",
                                           weights=dataclasses.replace(presets["W4AFP8"].weights, group_size=64))


def test_weights_only_suffix():
    assert parse_scheme("FP8_BLOCK:w") == SchemeSet("FP8_BLOCK:w", weights=presets["FP8_BLOCK"].weights)


def test_fixed_group_formats_accept_their_own_size():
    assert parse_scheme("MXFP4A16:g32").weights == presets["MXFP4A16"].weights
    assert parse_scheme("NVFP4A16:g16").weights == presets["NVFP4A16"].weights


@pytest.mark.parametrize("text, msg", [
    ("FP8_DYNAMIC:g64", r"'FP8_DYNAMIC:g64': the weights of FP8_DYNAMIC \(.*\) have channel scales, not groups"),
    ("FP8_BLOCK:g64", r"have block scales, not groups"),
    ("FP6_E3M2:g64", r"have channel scales, not groups"),
    ("MXFP4A16:g64", r"MX scales groups of 32 by definition"),
    ("NVFP4A16:g32", r"NVFP4 scales groups of 16 by definition"),
    ("W4A16:g0", r"must be a positive integer"),
    ("W4A16:gx", r"suffix ':gx'; expected NAME with ':w'"),
    ("W4A16:g-4", r"suffix ':g-4'"),
    ("W4A16:x", r"suffix ':x'"),
    ("W4A16:", r"suffix ':'"),
    ("W4A16:w:w", r"repeated suffix ':w'"),
    ("W4A16:g64:g32", r"repeated suffix ':g32'"),
    ("W9A16:g64", r"unknown preset 'W9A16'"),
])
def test_bad_scheme_strings_raise_scheme_error(text, msg):
    with pytest.raises(SchemeError, match=msg):
        parse_scheme(text)


def test_non_string_is_a_scheme_error():
    with pytest.raises(SchemeError, match="expected a scheme string"):
        parse_scheme(4)


def test_eval_and_rules_use_the_parser():
    from converters.evaluation.embedding_fidelity import resolve
    from qformats.matching import resolve_scheme

    want = parse_scheme("W4A16:g64:w")
    assert resolve("W4A16:g64:w") == want and resolve_scheme("W4A16:g64:w") == want
    assert resolve("dense") is None
