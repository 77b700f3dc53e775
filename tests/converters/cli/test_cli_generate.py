"""`qformats generate` as a process that talks (loading, compiling, prefill, decode on stderr), streams, applies
the chat template, refuses a request over the context before any compute, runs a --prompts file, and keeps its
compiled programs in the persistent compilation cache; on a tiny random llama with a word-level tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from converters.cli import main
from tiny_hf import write_tiny_hf

pytest.importorskip("tokenizers")
ROOT = Path(__file__).resolve().parents[3]
WORDS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(59)]
PROMPT = "w3 w4 w5"
CHAT = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> w1 {% endif %}")


def make_tiny(dst: Path, max_pos: int = 64) -> Path:
    """A random llama (2 layers, hidden 64, vocab 64, context `max_pos`) in HF layout, a word-level tokenizer
    (w0 ... w58 and special tokens) and a chat template."""
    cfg = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=max_pos, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False,
               torch_dtype="float32")
    write_tiny_hf(dst, cfg, WORDS, ["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    (dst / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>"}))
    (dst / "chat_template.jinja").write_text(CHAT)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "dense")


def _run(capsys, *args):
    rc = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def _library(src, ids, n, **kw):
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models.generate import generate
    model, cfg, _ = load_causal_lm(src)
    return [int(t) for t in np.asarray(generate(model, np.asarray(ids, np.int32), n, **kw))]


def _upto_eos(tokens, eos):
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


# ---- a process that talks ------------------------------------------------------------------------------------
def test_json_tokens_equal_the_library_and_the_process_talks(tiny, capsys):
    rc, out, err = _run(capsys, tiny, "--prompt", PROMPT, "--max-new-tokens", 10, "--json")
    assert rc == 0
    got = json.loads(out)
    assert got["tokens"] == _upto_eos(_library(tiny, [5 + 3, 5 + 4, 5 + 5], 10, eos_id=2), [2])
    lines = err.splitlines()
    assert lines[0].startswith(f"qformats: loading {tiny} (") and lines[1].startswith("qformats: loaded ")
    assert lines[1].endswith("/s)")
    assert lines[2].startswith("qformats: layers: 2 in 1 scanned run(s) (0-1), stacked in ")
    assert lines[3].startswith("qformats: compiled prefill [1 x 16 tokens] and decode (cache of 16 positions) in ")
    assert "cache" in lines[3]
    assert lines[4].startswith("qformats: prefill: 3 tokens in ") and lines[4].endswith("tokens/s)")
    assert lines[5].startswith(f"qformats: decode: {len(got['tokens']) - 1} tokens in ") and "tokens/s" in lines[5]


def test_sampled_tokens_equal_the_library(tiny, capsys):
    import jax
    rc, out, _ = _run(capsys, tiny, "--prompt", PROMPT, "--max-new-tokens", 8, "--temperature", 0.8, "--top-k", 20,
                      "--seed", 4, "--json")
    assert rc == 0
    want = _library(tiny, [8, 9, 10], 8, key=jax.random.key(4), temperature=0.8, top_k=20, eos_id=2)
    assert json.loads(out)["tokens"] == _upto_eos(want, [2])


def test_stream_prints_the_same_text(tiny, capsys):
    rc, plain, _ = _run(capsys, tiny, "--prompt", PROMPT, "--max-new-tokens", 10)
    assert rc == 0
    rc, streamed, err = _run(capsys, tiny, "--prompt", PROMPT, "--max-new-tokens", 10, "--stream")
    assert rc == 0 and streamed == plain and "decode:" in err
    assert _run(capsys, tiny, "--prompt", PROMPT, "--stream", "--json")[0] == 2


def test_stream_holds_back_an_unfinished_character(capsys):
    from converters.cli.generate import _print_new
    printed = _print_new("caf", "")
    assert _print_new("caf\ufffd", printed) == "caf"  # half of a UTF-8 sequence: wait for the next token
    assert _print_new("café", printed) == "café"
    assert capsys.readouterr().out == "café"


# ---- chat ----------------------------------------------------------------------------------------------------
def test_chat_applies_the_checkpoints_template(tiny, capsys):
    rc, out, _ = _run(capsys, tiny, "--prompt", PROMPT, "--max-new-tokens", 6, "--chat", "--json")
    assert rc == 0
    ids = [WORDS.index(w) for w in "<|im_start|> w0 w3 w4 w5 <|im_end|> <|im_start|> w1".replace(
        "w0", "<unk>").split()]  # role "user" is not a word of the tokenizer: <unk>
    eos = [2, WORDS.index("<|im_end|>")]  # config's eos and the template's end of turn
    assert json.loads(out)["tokens"] == _upto_eos(_library(tiny, ids, 6, eos_id=eos), eos)


def test_chat_renders_as_transformers(tiny):
    """SmolLM2-Instruct's template (from the embedded GGUF's metadata) and the tiny one: the same text as
    transformers' apply_chat_template."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from converters.evaluation.embedded import smollm2_gguf
    from converters.pipelines.chat_template import load_chat_template, render_chat
    messages = [{"role": "user", "content": "Wie heißt die Hauptstadt? \"Paris\" <b>"}]
    for src in (smollm2_gguf(), tiny):
        template, special, where = load_chat_template(src)
        ours = render_chat(template, messages, where=where, **special)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"), **special)
        assert ours == hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True)


def test_chat_template_is_sandboxed(tmp_path):
    from converters.pipelines.chat_template import render_chat
    from qformats.errors import CheckpointError
    with pytest.raises(CheckpointError, match="SecurityError"):
        render_chat("{{ messages.__class__.__mro__ }}", [], where="t.jinja")
    with pytest.raises(CheckpointError, match="t.jinja: TemplateError: no system role"):
        render_chat("{{ raise_exception('no system role') }}", [], where="t.jinja")


def test_chat_without_a_template_says_so(tiny, tmp_path, capsys):
    import shutil
    src = tmp_path / "m"
    shutil.copytree(tiny, src)
    (src / "chat_template.jinja").unlink()
    rc, _, err = _run(capsys, src, "--prompt", PROMPT, "--chat")
    assert rc == 2 and "has no chat template" in err


# ---- a request that cannot fit -------------------------------------------------------------------------------
def test_over_the_context_is_refused_before_any_compute(tiny, capsys, monkeypatch):
    from qformats.models import generate as gen

    def no_compile(self):
        raise AssertionError("compiled a request that cannot fit")

    monkeypatch.setattr(gen.TokenStream, "compile", no_compile)
    rc, out, err = _run(capsys, tiny, "--prompt", " ".join(["w7"] * 60), "--max-new-tokens", 8)
    assert rc == 1 and out == ""
    assert ("a prompt of 60 tokens with --max-new-tokens 8 needs 68 positions, over the model's context of 64 "
            "(max_position_embeddings); shorten the prompt to at most 56 tokens or ask for at most 4 new tokens") in err
    assert "compiled" not in err


def test_library_refuses_over_the_context_with_the_api_spelling(tiny):
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.errors import ModelError
    from qformats.models.generate import TokenStream, generate
    model, _, _ = load_causal_lm(tiny)
    for f in (generate, TokenStream):
        with pytest.raises(ModelError, match=r"60 tokens with max_new_tokens=5 needs 65 positions, over .* of 64"):
            f(model, np.zeros(60, np.int32), 5)


# ---- --prompts FILE.jsonl ------------------------------------------------------------------------------------
def test_prompts_file_in_input_order(tiny, tmp_path, capsys):
    f = tmp_path / "req.jsonl"
    f.write_text('{"prompt": "w3 w4 w5"}\n\n{"prompt": "w9", "max_new_tokens": 3}\n'
                 '{"prompt": "w11 w12", "max_new_tokens": 5}\n', encoding="utf-8")
    rc, out, err = _run(capsys, tiny, "--prompts", f, "--max-new-tokens", 7)
    assert rc == 0
    got = [json.loads(x) for x in out.splitlines()]
    assert err.count("qformats: request ") == 3 and err.count("qformats: loading") == 1
    singles = []
    for p, n in ((PROMPT, 7), ("w9", 3), ("w11 w12", 5)):
        rc, o, _ = _run(capsys, tiny, "--prompt", p, "--max-new-tokens", n, "--json")
        singles.append(json.loads(o))
    assert got == singles and len(got[1]["tokens"]) <= 3 and len(got[2]["tokens"]) <= 5
    # 2 rows, the third request takes the row of the first one done (one prefill each, one decode program), the
    # layers scanned (the default) and unrolled: the same lines
    rc, out, err = _run(capsys, tiny, "--prompts", f, "--max-new-tokens", 7, "--batch-size", 2)
    assert rc == 0 and [json.loads(x) for x in out.splitlines()] == got and err.count("qformats: request ") == 3
    assert "compiled prefill [1 x 16 tokens] and decode [2 rows] (cache of 16 positions)" in err
    rc, out, err = _run(capsys, tiny, "--prompts", f, "--max-new-tokens", 7, "--batch-size", 3, "--no-scan")
    assert rc == 0 and [json.loads(x) for x in out.splitlines()] == got and "scanned run(s)" not in err


@pytest.mark.parametrize("line, msg", [
    ('{"prompt": "w1"', "line 1: expected a JSON object, found invalid JSON"),
    ("[" * 100 + "]" * 100, "line 1: expected JSON nested at most 64 deep"),
    ('{"text": "w1"}', 'line 1: expected a JSON object with a string "prompt"'),
    ('{"prompt": "w1", "max_new_tokens": 0}', '"max_new_tokens": expected a positive integer, found 0'),
    ('{"prompt": "w1", "max_new_tokens": true}', '"max_new_tokens": expected a positive integer, found True'),
    ('{"prompt": "w1", "temperature": 2}', "line 1: unknown keys ['temperature']"),
    ("", "expected at least one request, found none"),
])
def test_prompts_file_refused_before_loading(tiny, tmp_path, capsys, line, msg):
    f = tmp_path / "req.jsonl"
    f.write_text(line + "\n", encoding="utf-8")
    rc, out, err = _run(capsys, tiny, "--prompts", f)
    assert rc == 1 and msg in err and "loading" not in err and out == ""


def test_prompts_file_line_size_bound(tiny, tmp_path, capsys, monkeypatch):
    from converters.evaluation import calibration_data
    monkeypatch.setattr(calibration_data, "MAX_LINE_BYTES", 64)
    f = tmp_path / "req.jsonl"
    f.write_text('{"prompt": "' + "w1 " * 40 + '"}\n', encoding="utf-8")
    rc, _, err = _run(capsys, tiny, "--prompts", f)
    assert rc == 1 and "line 1: expected at most 64 bytes a line" in err


def test_prompt_or_prompts(tiny, tmp_path, capsys):
    assert _run(capsys, tiny)[0] == 2
    assert _run(capsys, tiny, "--prompt", "w1", "--prompts", tmp_path / "x.jsonl")[0] == 2
    assert _run(capsys, tiny, "--prompt", "w1", "--batch-size", 2)[0] == 2
    rc, _, err = _run(capsys, tiny, "--prompts", tmp_path / "none.jsonl")
    assert rc == 2 and "no such file" in err


# ---- the persistent compilation cache ------------------------------------------------------------------------
def _fresh(tiny, home, *extra):
    """`python -m converters.cli generate` in a fresh process whose cache directory is under `home`, with no
    compilation cache configured by the caller (the test suite's is removed from the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "QFORMATS_COMPILE_CACHE")}
    env.update(XDG_CACHE_HOME=str(home), PYTHONPATH=str(ROOT), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    r = subprocess.run([sys.executable, "-m", "converters.cli", "generate", str(tiny), "--prompt", PROMPT,
                        "--max-new-tokens", "4", "--json", *extra], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_the_cli_keeps_compiled_programs_in_the_users_cache(tiny, tmp_path):
    home = tmp_path / "xdg"
    cache = home / "qformats" / "jax"
    first, err = _fresh(tiny, home)
    assert f"persistent cache miss, {cache}" in err and any(cache.iterdir())
    again, err = _fresh(tiny, home)
    assert again == first and f"persistent cache hit, {cache}" in err
    off = tmp_path / "off"
    _, err = _fresh(tiny, off, "--no-compile-cache")
    assert "persistent compilation cache off" in err and not off.exists()


def test_a_configured_cache_wins(tmp_path, monkeypatch):
    """In this process the test suite's cache (tests/conftest.py) is configured: the CLI keeps it, and never
    writes into the user's cache directory."""
    import jax

    from converters.cli.common import compile_cache_dir, enable_compile_cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir() == tmp_path / "xdg" / "qformats" / "jax"
    configured = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    got = enable_compile_cache(True)
    assert (got is None and configured is None) or str(got) == str(configured)
    assert not (tmp_path / "xdg").exists()
    monkeypatch.setenv("QFORMATS_COMPILE_CACHE", str(tmp_path / "elsewhere"))
    assert compile_cache_dir() == tmp_path / "elsewhere"


def test_a_copied_cache_hits(tmp_path):
    """On CPU the cache keys do not hold the cache directory's path (XLA's GPU caches stay off): a program compiled
    into one directory is a cache hit from a copy of it elsewhere."""
    import shutil
    import subprocess
    import sys

    code = ("from converters.cli.common import enable_compile_cache; enable_compile_cache(); import jax; "
            "import jax.numpy as jnp; jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(JAX_LOG_COMPILES="1", JAX_PLATFORMS="cpu")
    logs = []
    for d in ("a", "b"):
        if d == "b":
            shutil.copytree(tmp_path / "a", tmp_path / "b")
        env["QFORMATS_COMPILE_CACHE"] = str(tmp_path / d)
        logs.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                                   timeout=120).stderr)
    assert "Persistent compilation cache hit" not in logs[0] and any((tmp_path / "a").iterdir())
    assert "Persistent compilation cache hit for 'jit__lambda'" in logs[1], logs[1][-2000:]


def test_help_names_the_cache_directory(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("QFORMATS_COMPILE_CACHE", raising=False)
    assert main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--no-compile-cache" in out and str(tmp_path / "qformats" / "jax") in out.replace(" ", "")
    assert "--batch-size" in out and "--no-scan" in out and "--no-buckets" in out


def test_eval_takes_no_compile_cache_for_both_measures(monkeypatch, tmp_path, capsys):
    """--no-compile-cache is the CLI's: the embedding-fidelity evaluation never sees it; the perplexity parser has
    it."""
    import converters.cli.eval as cli_eval
    from converters.cli.eval import perplexity_parser
    from converters.evaluation import embedding_fidelity
    seen, asked = {}, []
    monkeypatch.setattr(embedding_fidelity, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    monkeypatch.setattr(cli_eval, "enable_compile_cache", lambda enabled=True: asked.append(enabled))
    assert main(["eval", "--json", "--no-compile-cache"]) == 0
    assert seen["argv"] == ["--json"] and asked == [False]
    assert perplexity_parser().parse_args(["x", "--text", "t", "--no-compile-cache"]).no_compile_cache
