"""MiniLM calibration without padding rows (`embedded.calibration_batches`) and the held-out sentence sets."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from converters.pipelines import calibrate  # noqa: E402
from converters.evaluation import embedded, embedding_fidelity as evaluate  # noqa: E402
from qformats.errors import ModelError  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return embedded.Tokenizer()


def _ids(tok, sentence):
    b = tok([sentence])
    return b["input_ids"][0][: int(b["attention_mask"][0].sum())]


@pytest.mark.parametrize("bucket", [1, 8])
def test_calibration_batches_hold_only_real_tokens(tok, bucket):
    sentences = embedded.default_sentences()
    batches = embedded.calibration_batches(tok, sentences, batch_size=5, bucket=bucket)
    import tokenizers  # the tok fixture's package

    sep = tokenizers.Tokenizer.from_file(str(embedded.model_dir() / "tokenizer.json")).token_to_id("[SEP]")
    rows = []
    for b in batches:
        n, length = b["input_ids"].shape
        assert 1 <= n <= 5
        assert b["attention_mask"].dtype == np.int32 and np.all(b["attention_mask"] == 1)  # no padding row
        assert length < bucket or length % bucket == 0
        rows += [tuple(r) for r in b["input_ids"]]
    assert [b["input_ids"].shape[1] for b in batches] == sorted(b["input_ids"].shape[1] for b in batches)
    assert len(rows) == len(sentences)
    for s in sentences:  # each sentence once: its own ids, the tail word pieces cut, [SEP] kept last
        full = _ids(tok, s)
        n = len(full) if len(full) < bucket else len(full) - len(full) % bucket
        want = tuple(full[: n - 1]) + (sep,)
        assert rows.count(want) >= 1
    if bucket == 1:  # whole sentences
        assert sorted(rows) == sorted(tuple(_ids(tok, s)) for s in sentences)


@pytest.mark.parametrize("kw", [dict(batch_size=0), dict(bucket=0), dict(batch_size=True), dict(bucket=2.0)])
def test_calibration_batches_bad_arguments(tok, kw):
    with pytest.raises(ModelError, match="calibration_batches: (batch_size|bucket) must be a positive int"):
        embedded.calibration_batches(tok, ["A sentence."], **kw)


class _Stop(Exception):
    pass


def test_quantize_calibrated_feeds_no_padding_rows(tmp_path, monkeypatch):
    # every row that enters the layers' statistics (GPTQ's H) is a real token of a sentence, never padding
    seen = {}

    def spy(model, rules, calibration_data=None, **kw):
        seen["batches"] = list(calibration_data)
        raise _Stop

    monkeypatch.setattr(calibrate, "quantize_model", spy)
    sentences = embedded.default_sentences()
    with pytest.raises(_Stop):
        calibrate.quantize_calibrated(tmp_path / "out", "W4A16", sentences=sentences, weight_search="gptq")
    batches = seen["batches"]
    assert all(np.all(b["attention_mask"] == 1) for b in batches)
    assert sum(b["input_ids"].shape[0] for b in batches) == len(sentences)
    assert not (tmp_path / "out").exists()


def test_evaluate_calibrates_on_no_padding_rows(monkeypatch):
    seen = []

    def spy(name, sentences, reference, *, calibration=None, **kw):
        seen.append(calibration)
        return {"mean_cos": 1.0, "min_cos": 1.0, "bytes": 1}

    monkeypatch.setattr(evaluate, "evaluate_one", spy)
    sentences = embedded.default_sentences()[:20]
    evaluate.evaluate(["W4A16"], sentences, calibrated=True, reference=np.ones((20, 384), np.float32),
                      searches=("gptq",))
    calib = [c for c in seen if c is not None]
    assert len(calib) == 1
    assert all(np.all(b["attention_mask"] == 1) for b in calib[0])
    assert sum(b["input_ids"].shape[0] for b in calib[0]) == 20


def test_heldout_sets_are_disjoint_prose():
    held, cal = embedded.heldout_sentences("eval"), embedded.heldout_sentences("calib")
    shipped = embedded.default_sentences()
    assert len(held) == len(set(held)) == 256 and len(cal) == len(set(cal)) == 256
    assert not set(held) & set(cal) and not (set(held) | set(cal)) & set(shipped)
    assert all(8 <= len(s.split()) <= 40 and s.endswith(".") for s in held + cal)
    with pytest.raises(ModelError, match="which must be one of"):
        embedded.heldout_sentences("train")
