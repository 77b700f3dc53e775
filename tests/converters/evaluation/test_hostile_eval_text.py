"""Eval text as one long word: the text handed to the tokenizer is bounded -- a run without whitespace longer than
MAX_WORD_CHARS is a typed error naming the file and the limit (the tokenizer would otherwise abort the process), and
long texts are encoded in pieces cut where the tokenizer's own pre-tokenization cuts, with the ids of one encode."""

from __future__ import annotations

import random
import time

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from converters import cli
from converters.evaluation import perplexity
from converters.evaluation.calibration_data import MAX_WORD_CHARS, longest_word_at, read_text_file
from converters.evaluation.perplexity import encode_text
from qformats.errors import CheckpointError, ModelError

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ["hello", "world", "Hello", "don't", "it's", "123", "4567", "3.14", "...", "!!", "café", "日本語", "naïve",
         "  ", "\n", "\n\n", "\t", " \n ", "--", "(x)", "a", "I", "'s", "\u00a0", "e\u0301", "<|endoftext|>"]


def _text(seed: int, n: int = 3000) -> str:
    r = random.Random(seed)
    return "".join(r.choice(WORDS) + r.choice([" ", " ", " ", "", "  ", "\n"]) for _ in range(n))


def _bpe(pre, normalizer=None) -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre
    if normalizer is not None:
        t.normalizer = normalizer
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    alphabet = pre_tokenizers.ByteLevel.alphabet() if "ByteLevel" in repr(pre) else []
    t.train_from_iterator([_text(s, 400) for s in range(5)],
                          trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False))
    return t


TOKENIZERS = {
    "gpt2": lambda: _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False)),
    "llama3": lambda: _bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    "qwen2": lambda: _bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), normalizers.NFC()),
    "metaspace": lambda: _bpe(pre_tokenizers.Metaspace(prepend_scheme="first", split=True)),
    "metaspace_whole": lambda: _bpe(pre_tokenizers.Metaspace(prepend_scheme="first", split=False)),
    "prefix_space": lambda: _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)),
}


@pytest.mark.parametrize("name, cuttable", [("gpt2", True), ("llama3", True), ("qwen2", True), ("metaspace", True),
                                            ("metaspace_whole", False), ("prefix_space", False)])
def test_pieces_give_the_ids_of_one_encode(monkeypatch, name, cuttable):
    tok = TOKENIZERS[name]()
    assert perplexity._cuttable(tok) is cuttable
    for seed in range(6):
        text = _text(100 + seed)
        whole = list(tok.encode(text, add_special_tokens=False).ids)
        for size in (7, 50, 333, 10 ** 9):
            monkeypatch.setattr(perplexity, "CHUNK_CHARS", size)
            assert encode_text(tok, text) == whole, (name, seed, size)


def test_pieces_cut_only_at_lone_spaces():
    text = _text(7, 5000)
    pieces = list(perplexity._pieces(text, 40))
    assert "".join(pieces) == text and len(pieces) > 100
    for p in pieces[1:]:
        assert p[0] == " " and not p[1].isspace()
    for a in pieces[:-1]:
        assert not a[-1].isspace()
    assert list(perplexity._pieces("ab\ncd\nef", 2)) == ["ab\ncd\nef"]  # no lone space: one piece


def test_longest_word_is_found_in_linear_time():
    assert longest_word_at("ab cd", 2) is None and longest_word_at("ab cde", 2) == 3
    t0 = time.perf_counter()
    assert longest_word_at(("a" * MAX_WORD_CHARS + " ") * 200) is None
    assert longest_word_at("x " + "a" * 20_000_000) == 2
    assert time.perf_counter() - t0 < 5


def test_one_long_word_is_refused_naming_the_file_and_the_limit(tmp_path, capsys):
    p = tmp_path / "word.txt"
    p.write_bytes(b"some text\n" + b"a" * (50 << 20))  # 50 MB without whitespace
    with pytest.raises(CheckpointError, match=rf"word.txt: expected a text file with runs of at most "
                                              rf"{MAX_WORD_CHARS} characters without whitespace \(MAX_WORD_CHARS\), "
                                              r"found a longer one at character 10"):
        read_text_file(p)
    src = tmp_path / "lm"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "llama"}')  # refused before anything of SRC is loaded
    assert cli.main(["eval", str(src), "--text", str(p)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qformats: error: {p}: expected --text text with runs of at most {MAX_WORD_CHARS}")
    assert "\n" not in err
    with pytest.raises(ModelError, match=f"expected runs of at most {MAX_WORD_CHARS} characters"):
        encode_text(None, "b " + "a" * (MAX_WORD_CHARS + 1))
    p.write_text("b " + "a" * MAX_WORD_CHARS + "\n")  # exactly the limit: read
    assert read_text_file(p).endswith("a\n")
