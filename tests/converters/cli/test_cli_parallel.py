"""`qformats generate / eval --expert-parallel N [--tensor-parallel M]` on a tiny random qwen3_moe checkpoint (8
experts, a word-level tokenizer): the flags' usage and help, and, in fresh interpreters (the CPU device count is
set before JAX starts), the same greedy tokens and perplexity as one device, and the refusal of an expert count the
expert-parallel size does not divide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converters.cli import main
from tiny_hf import write_tiny_hf

pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[3]
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
PROMPT = "w3 w4 w5 w9"
CFG = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=64,
           intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           max_position_embeddings=64, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
           torch_dtype="float32")


def make_tiny_moe(dst: Path) -> Path:
    """A random qwen3_moe (2 sparse layers, 8 experts of 32, top-2) in HF layout (one tensor per expert) and a
    word-level tokenizer."""
    return write_tiny_hf(dst, CFG, WORDS, ["<s>", "</s>"])


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_tiny_moe(tmp_path_factory.mktemp("tiny_moe") / "dense")


def _fresh(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "converters.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_help_lists_the_parallel_flags(command, tiny_moe, capsys):
    args = [command, "--help"] if command == "generate" else [command, str(tiny_moe), "--help"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--tensor-parallel N" in out and "--expert-parallel N" in out
    assert "split every expert stack by experts over N devices" in out


@pytest.mark.parametrize("flag", ["--tensor-parallel", "--expert-parallel"])
def test_parallel_sizes_below_one_are_usage_errors(flag, tiny_moe, tmp_path, capsys):
    assert main(["generate", str(tiny_moe), "--prompt", PROMPT, flag, "0"]) == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
    text = tmp_path / "t.txt"
    text.write_text(PROMPT)
    assert main(["eval", str(tiny_moe), "--text", str(text), flag, "-1"]) == 2
    assert f"{flag} must be >= 1, got -1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["W4A16:g16"])  # dense: tests/multidevice/test_expert_parallel_mesh.py
def test_generate_expert_parallel_equals_one_device(tiny_moe, tmp_path, scheme, capsys):
    """--expert-parallel 4 --tensor-parallel 2 and --tensor-parallel 2 alone (attention split, experts replicated):
    the single-device greedy tokens; with the expert stacks split 4 ways each device holds well under the whole
    model. (--expert-parallel 8 alone goes through the same CLI code, parallel_setup(1, 8) in place of
    parallel_setup(2, 4); the same stored W4A16:g16 qwen3_moe checkpoint on the 8-way expert mesh, its tokens
    and its expert shards: tests/multidevice/test_expert_parallel_mesh.py, w4/ep8.)"""
    src = tiny_moe
    if scheme is not None:  # a stored compressed-tensors MoE checkpoint, its experts read onto their devices
        src = tmp_path / "q"
        assert main(["quantize", str(tiny_moe), str(src), "--scheme", scheme, "--quiet"]) == 0
        for f in ("tokenizer.json",):
            (src / f).write_bytes((tiny_moe / f).read_bytes())
    args = ["generate", str(src), "--prompt", PROMPT, "--max-new-tokens", "8", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for par in (["--expert-parallel", "4", "--tensor-parallel", "2"], ["--tensor-parallel", "2"]):
        r = _fresh(*args, *par)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["tokens"] == want["tokens"], par
        per = got["param_bytes_per_device"]
        if "--expert-parallel" in par:
            stored = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            assert len(per) == 8 and max(per) < 0.5 * stored, (per, stored)
        else:
            assert len(per) == 2


@pytest.mark.slow
def test_eval_expert_parallel_equals_one_device_and_refuses_indivisible(tiny_moe, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{(7 * i) % 61}" for i in range(200)))
    args = ["eval", str(tiny_moe), "--text", str(text), "--seq-len", "32", "--max-windows", "4", "--json"]
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stored"]
    r = _fresh(*args, "--expert-parallel", "4", "--tensor-parallel", "2")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])["stored"]
    assert got["tokens"] == want["tokens"] and got["bytes"] == want["bytes"]
    # the attention's row-parallel all-reduce sums in another order: the same perplexity up to float32 rounding
    assert abs(got["ppl"] - want["ppl"]) <= 1e-5 * want["ppl"], (got, want)
    r = _fresh("generate", str(tiny_moe), "--prompt", PROMPT, "--expert-parallel", "3")
    assert r.returncode == 1
    assert "expert parallel 3: the qwen3_moe model has num_experts = 8" in r.stderr and "8 mod 3 = 2" in r.stderr
