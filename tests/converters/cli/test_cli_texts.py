"""The CLI's texts stay true: every subcommand and option has help, README's CLI lines name only options the
parser has, refusals group layers and put the way out first in the CLI's spelling, summaries wrap, preset typos
get a suggestion, `inspect` starts with the quantization summary and sorts naturally, `--version`."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest

from converters.cli import COMMANDS, _parser, main
from converters.cli.eval import perplexity_parser
from converters.formats.safetensors_io import save_file

ROOT = Path(__file__).resolve().parents[3]
RNG = np.random.default_rng(7)


def _subparsers(p):
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))


def _all_parsers():
    from converters.evaluation.embedding_fidelity import build_parser
    sub = _subparsers(_parser())
    out = {n: sp for n, sp in sub.choices.items() if n != "eval"}
    out["eval (perplexity)"], out["eval (fidelity)"] = perplexity_parser(), build_parser()
    return sub, out


def test_every_subcommand_and_option_has_help():
    sub, parsers = _all_parsers()
    assert sorted(c.dest for c in sub._choices_actions if c.help) == sorted(COMMANDS)
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in parsers.items() for a in p._actions
               if not a.help and a.dest != "help"]
    assert missing == []


def test_quantize_help_says_calibrate_takes_causal_lms_too(capsys):
    assert main(["quantize", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "embedded model only" not in out
    assert "A causal LM (SRC DST): FILE of text, .jsonl or .npy token ids" in out
    assert "model.safetensors.index.json" in out  # --max-shard-size


def test_readme_cli_lines_name_only_real_options():
    """Every `qformats CMD ... --option` in README.md is an option of CMD (of either eval parser for eval)."""
    _, parsers = _all_parsers()
    opts = {n: {o for a in p._actions for o in a.option_strings} for n, p in parsers.items()}
    opts["eval"] = opts.pop("eval (perplexity)") | opts.pop("eval (fidelity)")
    checked = 0
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        for m in re.finditer(r"qformats (\w+)([^`#|&]*)", line):
            cmd, rest = m.groups()
            if cmd not in opts:
                continue
            for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                assert o in opts[cmd], f"README: `qformats {cmd} ... {o}`: not an option of {cmd}"
                checked += 1
    assert checked > 20


def test_version(capsys):
    from qformats import __version__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"qformats {__version__}"


def test_unknown_preset_suggests_the_close_ones(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "x"), str(tmp_path / "y"), "--scheme", "W4A17"]) == 1
    err = capsys.readouterr().err
    assert "unknown preset 'W4A17'; did you mean W4A16" in err and err.index("did you mean") < err.index("valid")


@pytest.fixture()
def layered(tmp_path):
    """12 numbered layers whose q_proj (576 columns) W4A16's 128-groups do not divide, down_proj (1536) they do."""
    src = tmp_path / "dense"
    src.mkdir()
    t = {}
    for i in range(12):
        t[f"model.layers.{i}.self_attn.q_proj.weight"] = (RNG.standard_normal((16, 576)) * 0.05).astype(np.float32)
        t[f"model.layers.{i}.mlp.down_proj.weight"] = (RNG.standard_normal((16, 1536)) * 0.05).astype(np.float32)
    save_file(t, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    return src


def test_refusal_groups_layers_way_out_first_in_the_cli_spelling(layered, tmp_path, capsys):
    assert main(["quantize", str(layered), str(tmp_path / "out"), "--scheme", "W4A16", "--quiet"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("qformats: error: ") and "12 of the 24 targeted weights do not fit scheme 'W4A16'" in err[0]
    assert err[1] == ("Ways out: --skip-indivisible keeps exactly these dense and lists them in the summary; a group "
                      "size that divides their columns (--scheme W4A16:g64); or leave them dense with --ignore "
                      "PATTERN. The weights:")
    assert err[2:] == ["  - model.layers.{0..11}.self_attn.q_proj (12 layers, weight [16, 576] in model.safetensors): "
                       "columns=576 not divisible by group_size=128"]
    assert not any("=True" in x or "ignore=[" in x for x in err)


def test_skip_indivisible_summary_wraps(layered, tmp_path, capsys):
    assert main(["quantize", str(layered), str(tmp_path / "out"), "--scheme", "W4A16", "--quiet",
                 "--skip-indivisible"]) == 0
    err = capsys.readouterr().err
    assert "left dense by --skip-indivisible (12; their columns are not a multiple of the group size): " \
           "model.layers.{0..11}.self_attn.q_proj (12)" in err.replace("\n    ", " ")
    assert all(len(x) <= 100 for x in err.splitlines()[1:])


def test_overwrite_error_in_the_cli_spelling(layered, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["quantize", str(layered), str(tmp_path / "out"), "--scheme", "W4A16:g64", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err


def test_inspect_starts_with_the_summary_and_sorts_naturally(layered, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(layered), str(out), "--scheme", "W4A16:g64", "--quiet",
                 "--ignore", "re:.*layers\\.1[01]\\..*"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "quantization: compressed-tensors, format pack-quantized (version " + \
        json.loads((out / "config.json").read_text())["quantization_config"]["version"] + ")"
    assert lines[1].startswith("  group_0 (pack-quantized): targets Linear, weights int4 group64 ")
    assert lines[2] == "  ignore (4): model.layers.{10,11}.mlp.down_proj (2), model.layers.{10,11}.self_attn.q_proj (2)"
    names = [x.split()[0] for x in lines if x.startswith("model.layers.")]
    order = [int(n.split(".")[2]) for n in names]
    assert order == sorted(order) and order[-1] == 11 and len(names) == 24


def test_inspect_dense_says_so(layered, capsys):
    assert main(["inspect", str(layered)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "quantization: none (a dense checkpoint)"


@pytest.mark.parametrize("path", ["/no/such/dir", "/no/such/model.gguf"])
def test_eval_on_a_missing_path_says_it_is_missing(path, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert main(["eval", path, "--text", str(text)]) in (1, 2)
    err = capsys.readouterr().err
    assert path in err and ("no such checkpoint" in err or "no such file" in err) and "tokenizer" not in err
