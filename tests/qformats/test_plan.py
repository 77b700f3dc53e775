"""The one matcher (qformats.matching) and the plan (qformats.plan): rules, compressed-tensors targets and ignore
lists select alike; every candidate gets a scheme or a reason; kinds told by name are never silent."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from qformats.errors import CheckpointError, ModelError
from qformats.matching import Matcher, Rule
from qformats.plan import Candidate, plan_quantization
from qformats.presets import parse_scheme

W4 = parse_scheme("W4A16:g64")


def test_rules_first_full_match_wins_and_shadowed_rules_are_unused():
    m = Matcher.from_rules([Rule("pooler", None), Rule("a/.*", "W4A16:g64"), Rule("a/q_proj", "W8A16")])
    plan = plan_quantization([Candidate("pooler"), Candidate("a/q_proj"), Candidate("b/q_proj")], m)
    assert [(d.path, d.scheme and d.scheme.name, d.why) for d in plan.decisions] == [
        ("pooler", None, "rule #0 'pooler' says so"), ("a/q_proj", "W4A16:g64", "rule #1 'a/.*'"),
        ("b/q_proj", None, "matched no rule")]
    assert [s.label for s in plan.unused] == ["rule #2 'a/q_proj'"]  # shadowed by rule #1
    assert Matcher.from_rules([Rule("q", None)]).match("q_proj") == (None, None)  # full match, not a prefix


@pytest.mark.parametrize("rules, msg", [([Rule("(", "W4A16")], "not a valid regex"),
                                        ([Rule("x", "NOPE")], "rule #0 'x'"),
                                        (["x"], None)])
def test_rules_are_checked_first(rules, msg):
    if msg is None:
        assert Matcher.from_rules(rules).selectors[0].scheme is None  # a bare string leaves its modules dense
        return
    with pytest.raises(ModelError, match=re.escape(msg)):
        Matcher.from_rules(rules)


def test_targets_and_ignore_follow_compressed_tensors():
    m = Matcher.from_targets(W4, ["Linear", "re:model\\.embed"], ["lm_head", "re:.*\\.k_proj$", "model.norm"])
    cands = [Candidate("model.layers.0.self_attn.q_proj", 64), Candidate("model.layers.0.self_attn.k_proj", 64),
             Candidate("model.lm_head", 64), Candidate("model.embed_tokens", 64, "Embedding"),
             Candidate("model.norm", 64, "Norm")]
    plan = plan_quantization(cands, m, unmatched="not targeted")
    got = {d.path: (d.scheme is not None, d.why) for d in plan.decisions}
    assert got == {"model.layers.0.self_attn.q_proj": (True, "target 'Linear'"),
                   "model.layers.0.self_attn.k_proj": (False, "ignore 're:.*\\\\.k_proj$' says so"),
                   "model.lm_head": (False, "ignore 'lm_head' says so"),  # a last part of the path
                   "model.embed_tokens": (True, "target 're:model\\\\.embed'"),  # re.match from the start
                   "model.norm": (False, "not targeted")}
    # an ignore entry that names no targeted module is unused (model.norm is not targeted)
    assert [(s.role, s.entry) for s in plan.unused] == [("ignore", "model.norm")]


def test_untrusted_patterns_are_bounded():
    with pytest.raises(CheckpointError, match=r"targets\[0\].*lookaround"):
        Matcher.from_targets(W4, ["re:(?=a)a"])


def test_summary_states_reasons_and_name_heuristics():
    m = Matcher.from_targets(W4, ["Linear"], ["lm_head"])
    plan = plan_quantization([Candidate("x.q", 64, how="name heuristic"), Candidate("lm_head", 64)], m,
                             unmatched="not targeted")
    text = plan.summary()
    assert "quantized with W4A16:g64: 1" in text and "left dense (ignore 'lm_head' says so): 1: lm_head" in text
    assert "kind taken from names and shapes" in text and "x.q" in text


def _ckpt(d, names, cfg):
    from converters.formats.safetensors_io import save_file

    d.mkdir()
    rng = np.random.default_rng(0)
    save_file({n: rng.standard_normal(s).astype(np.float32) for n, s in names.items()}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_checkpoint_kinds_come_from_the_model_definition_or_are_reported(tmp_path):
    from converters.pipelines.quantize_checkpoint import quantize_checkpoint

    llama = {"model_type": "llama", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "tie_word_embeddings": False}
    names = {"model.embed_tokens.weight": (16, 64), "model.norm.weight": (64,), "lm_head.weight": (16, 64),
             "model.layers.0.input_layernorm.weight": (64,), "model.layers.0.post_attention_layernorm.weight": (64,)}
    for p, s in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)), ("self_attn.v_proj", (32, 64)),
                 ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                 ("mlp.down_proj", (64, 128))):
        names[f"model.layers.0.{p}.weight"] = s
    s = quantize_checkpoint(_ckpt(tmp_path / "llama", names, llama), tmp_path / "o1", "W4A16:g64", progress=False)
    assert s.quantized == 7 and s.by_name == [] and s.kinds_from == "the llama model definition"
    assert "by their names" not in s.text()

    other = {"model_type": "something", "hidden_size": 64}
    s = quantize_checkpoint(_ckpt(tmp_path / "other", {"blk.proj.weight": (8, 64), "blk.embed.weight": (8, 64)},
                                  other), tmp_path / "o2", "W4A16:g64", progress=False, ignore=())
    assert s.by_name == ["blk.proj"] and "no model definition for model_type 'something'" in s.kinds_from
    assert "1 of them taken as Linear by their names" in s.text() and "--targets" in s.text()
    s = quantize_checkpoint(tmp_path / "other", tmp_path / "o3", "W4A16:g64", progress=False, ignore=(),
                            targets=["re:blk\\.proj"])
    assert s.quantized == 1 and s.by_name == []  # explicit targets: nothing told by name
