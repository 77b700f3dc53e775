"""Perplexity of causal-LM checkpoints on a text, per scheme: `qformats eval SRC --text FILE` (token windows, jit, NLL).

Protocol (the one `qformats eval --text` states in its help):
  1. tokenize the whole text once, without special tokens;
  2. cut the ids into consecutive non-overlapping windows of `seq_len` tokens; the last partial window is
     dropped; the first `max_windows` are kept (all when None);
  3. run each window alone (no context carried over), and
       ppl = exp( (1 / N) * sum_w sum_{t=1}^{L-1} -log p(x_{w,t} | x_{w,0..t-1}) ),  N = windows * (L - 1),
     i.e. every token but the first of each window is predicted.
Windows run `batch_size` at a time through one jit-compiled function (one compile per window shape: the last
batch is padded to full size and its padding rows are not counted).

Schemes: "stored" runs SRC as stored (a compressed-tensors SRC keeps its packed layers; a GGUF SRC runs the
values gguf dequantizes); "dense" is its alias for a dense SRC (HF safetensors or GGUF); any other scheme
string (`qformats.presets.parse_scheme`, e.g. "W4A16:g64") quantizes a dense SRC round-to-nearest with
`qformats.nn.quantize_model` over the decoder's projections, lm_head left dense
(`qformats.models.decoder.quantization_rules`, llm-compressor's `ignore=["lm_head"]`), NVFP4 global scales shared
across the fused siblings q/k/v_proj and gate/up_proj as llm-compressor's oneshot and `qformats quantize` share them
(`quantize_model`'s fuse_global_scales, `qformats.algorithms.shared_scales`); on an already-quantized SRC a preset
is a CheckpointError.
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from converters.formats.compressed_tensors.read import is_quantized
from converters.formats.safetensors_io import read_json
from qformats.errors import CheckpointError, ModelError

__all__ = ["STORED", "token_windows", "window_nll", "perplexity", "load_for_scheme", "encode_text",
           "check_context", "check_window", "evaluate_text"]

STORED = "stored"


def token_windows(ids: Sequence[int], seq_len: int, max_windows: Optional[int] = None) -> np.ndarray:
    """ids -> [W, seq_len] int32: window w = ids[w * L : (w + 1) * L] for w < floor(len(ids) / L), the first
    `max_windows` of them (the last partial window is dropped).

    Raises:
      ModelError: seq_len < 2, max_windows < 1, or fewer than seq_len ids (not one whole window).
    """
    if int(seq_len) != seq_len or seq_len < 2:
        raise ModelError(f"perplexity: seq_len must be an integer >= 2 (one token predicted per window at least), "
                         f"got {seq_len!r}")
    if max_windows is not None and (int(max_windows) != max_windows or max_windows < 1):
        raise ModelError(f"perplexity: max_windows must be a positive integer or None, got {max_windows!r}")
    a = np.asarray(ids, np.int64)
    n = len(a) // seq_len
    if n == 0:
        raise ModelError(f"perplexity: the text has {len(a)} tokens, fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, int(max_windows))
    return a[: n * seq_len].reshape(n, seq_len).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(0,))
def _window_nll(graphdef, state, ids):
    from flax import nnx

    model = nnx.merge(graphdef, state)
    logits, _ = model(ids)  # [B, L, V] float32
    pred, target = logits[:, :-1], ids[:, 1:]
    # -log softmax(z)_y = logsumexp(z) - z_y, without materialising the log-softmax
    nll = jax.nn.logsumexp(pred, axis=-1) - jnp.take_along_axis(pred, target[..., None], axis=-1)[..., 0]
    return jnp.sum(nll, axis=-1)


def window_nll(model, windows) -> np.ndarray:
    """[B, L] token ids -> [B] float64: sum_{t=1}^{L-1} -log p(x_t | x_<t) of each window, run alone (no cache).
    Compiled once per (model graph, B, L)."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    return np.asarray(_window_nll(graphdef, state, np.asarray(windows, np.int32)), np.float64)


def perplexity(model, windows: np.ndarray, *, batch_size: int = 4,
               log: Optional[Callable[[str], None]] = None) -> Dict[str, float]:
    """{"ppl", "nll", "tokens"} of `model` over token windows [W, L] (`token_windows`):
    nll = (1 / N) sum of every window's `window_nll`, N = W (L - 1) predicted tokens, ppl = exp(nll).

    Windows go `batch_size` at a time; a short last batch is padded with copies of its first window (so one
    compile serves every batch) and the padding is not counted.
    """
    w = np.asarray(windows, np.int32)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 2:
        raise ModelError(f"perplexity: expected windows [W >= 1, L >= 2], got shape {w.shape}")
    if int(batch_size) != batch_size or batch_size < 1:
        raise ModelError(f"perplexity: batch_size must be a positive integer, got {batch_size!r}")
    b = min(int(batch_size), w.shape[0])
    total = 0.0
    for i in range(0, w.shape[0], b):
        chunk = w[i:i + b]
        n = chunk.shape[0]
        if n < b:
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], b - n, axis=0)])
        total += float(np.sum(window_nll(model, chunk)[:n]))
        if log:
            log(f"  windows {min(i + b, w.shape[0])}/{w.shape[0]}")
    tokens = w.shape[0] * (w.shape[1] - 1)
    nll = total / tokens
    return {"ppl": math.exp(nll), "nll": nll, "tokens": tokens}


def _indivisible_paths(model, rules, ss) -> List[str]:
    """Paths of the Linear layers `rules` would quantize whose in_features the scheme's groups do not divide."""
    import re

    from flax import nnx

    from qformats.plan import group_indivisible

    out = []
    for path, m in nnx.iter_modules(model):
        p = "/".join(str(x) for x in path)
        if isinstance(m, nnx.Linear) and any(re.fullmatch(r.pattern, p) for r in rules):
            k = int(m.in_features)
            if group_indivisible(k, ss.weights) or group_indivisible(k, ss.input_activations):
                out.append(p)
    return out


def _refuse_quantized(src, cfg, name: str) -> None:
    if is_quantized(cfg):
        qm = cfg["quantization_config"].get("format") or cfg["quantization_config"].get("quant_method")
        raise CheckpointError(f"{src}: scheme {name!r} needs a dense checkpoint, found a quantized one ({qm}); "
                              f"use 'stored' to run it as stored, or quantize its dense original")


def load_for_scheme(src: "str | os.PathLike", scheme: str, *, dtype=None, tokenizer: bool = True,
                    skip_indivisible: bool = False):
    """(model, hf_config, tokenizer, skipped) of the causal LM at `src`
    (`converters.pipelines.causal_lm.load_causal_lm`) run with `scheme`: "stored" as stored (a .gguf file packed from
    its blocks), "dense" (a dense SRC or a .gguf file, dequantized) the same, a scheme string quantized
    round-to-nearest over the decoder's projections with lm_head left dense
    (`decoder.quantization_rules`), fused siblings sharing their NVFP4 global scale (so the packed layers equal those
    `qformats quantize` stores). `skipped` lists the projections left dense by `skip_indivisible` (those whose
    in_features the scheme's groups do not divide; without it they are a ModelError naming every one).

    Raises:
      CheckpointError: "dense" or a preset on a quantized (compressed-tensors) SRC; unreadable SRC.
      SchemeError: an unknown scheme string. ModelError: layers the scheme does not fit (all named).
    """
    from converters.pipelines.causal_lm import load_causal_lm
    from qformats.models import decoder
    from qformats.nn import Rule, quantize_model
    from qformats.presets import parse_scheme

    name = scheme.strip()
    ss = None if name.lower() in (STORED, "dense") else parse_scheme(name)
    if name.lower() != STORED and Path(src).is_dir():  # refuse before loading the weights
        _refuse_quantized(src, read_json(Path(src) / "config.json"), name)
    # a .gguf file runs packed as stored; "dense" and presets start from its dequantized weights
    model, cfg, tok = load_causal_lm(src, dtype=dtype, tokenizer=tokenizer, packed=name.lower() == STORED)
    if name.lower() != STORED:
        _refuse_quantized(src, cfg, name)
    skipped: List[str] = []
    if ss is not None:
        rules = decoder.quantization_rules(ss)
        if skip_indivisible:
            skipped = _indivisible_paths(model, rules, ss)
            rules = [Rule(p, None) for p in skipped] + rules
        try:
            quantize_model(model, rules, fuse_global_scales=True)
        except ModelError as e:
            raise ModelError(f"{src}: {e}".replace("Ways out: ", "Ways out: skip_indivisible=True leaves exactly "
                                                   "those dense; ", 1)) from None
    return model, cfg, tok, skipped


#: Characters handed to the tokenizer at once where the text can be cut without changing its ids (`_cuttable`).
CHUNK_CHARS = 1 << 20


def encode_text(tokenizer, text: str) -> List[int]:
    """The token ids of the whole text, without special tokens (`tokenizers.Tokenizer.encode`).

    The ids are those of one `encode` of the whole text; where the tokenizer's normalizer and pre-tokenizer
    make a lone space between two non-space characters a boundary no token crosses (`_cuttable`: byte-level
    BPE with its split regex, whitespace splitting, Metaspace with split), the text is encoded in pieces of about
    CHUNK_CHARS cut before such spaces, which gives the same ids with memory bounded by one piece.

    Raises ModelError for anything but a str of Unicode characters (a lone surrogate, e.g. from a JSON
    `\\ud800` escape, is refused with its position), or for a run of more than MAX_WORD_CHARS characters
    without whitespace (BPE over one such word takes minutes and gigabytes, and the tokenizer aborts the
    process once allocation fails)."""
    from converters.evaluation.calibration_data import MAX_WORD_CHARS, longest_word_at

    if not isinstance(text, str):
        raise ModelError(f"perplexity: expected the text as a str, found {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ModelError(f"perplexity: expected text of Unicode characters, found a lone surrogate "
                         f"U+{ord(text[e.start]):04X} at character {e.start}") from None
    at = longest_word_at(text, MAX_WORD_CHARS)
    if at is not None:
        raise ModelError(f"perplexity: expected runs of at most {MAX_WORD_CHARS} characters without whitespace "
                         f"(MAX_WORD_CHARS), found a longer one at character {at}")
    if len(text) <= CHUNK_CHARS or not _cuttable(tokenizer):
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    ids: List[int] = []
    for piece in _pieces(text, CHUNK_CHARS):
        ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
    return ids


_CHAR_NORMALIZERS = ("NFC", "NFD", "NFKC", "NFKD", "Lowercase")


def _cuttable(tokenizer) -> bool:
    """Whether encoding "A B" (A ending, B starting with a non-space character) as encode("A") + encode(" B")
    gives the ids of encode("A B") for this `tokenizers.Tokenizer`: no normalizer, or only per-character ones
    (Unicode normal forms, lowercase: a space is a starter that composes with nothing), and a pre-tokenizer that
    starts a new piece at such a space -- ByteLevel with its GPT-2 regex and no added prefix space, a Split by a
    regex (followed by ByteLevel without regex: Llama 3, Qwen2), Whitespace / WhitespaceSplit / BertPreTokenizer,
    or Metaspace with split (which prepends nothing to a piece already starting with its replacement); and no
    added token that holds whitespace or strips it."""
    import json

    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:  # not a tokenizers.Tokenizer: encode whole
        return False

    def normalizer_ok(n) -> bool:
        if n is None:
            return True
        if n.get("type") == "Sequence":
            return all(normalizer_ok(x) for x in n.get("normalizers", []))
        return n.get("type") in _CHAR_NORMALIZERS

    def pre_ok(t, first: bool) -> bool:
        kind = t.get("type")
        if kind == "ByteLevel":
            return not t.get("add_prefix_space", False) and (t.get("use_regex", True) or not first)
        if kind == "Split":
            return first and t.get("behavior") == "Isolated" and not t.get("invert", False)
        if kind == "Metaspace":
            return bool(t.get("split", True))
        return kind in ("Whitespace", "WhitespaceSplit", "BertPreTokenizer")

    pre = spec.get("pre_tokenizer")
    if pre is None or not normalizer_ok(spec.get("normalizer")):
        return False
    for t in spec.get("added_tokens") or []:  # matched across the whole text before pre-tokenization
        if t.get("lstrip") or t.get("rstrip") or any(c.isspace() for c in str(t.get("content", " "))):
            return False
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return bool(steps) and pre_ok(steps[0], True) and all(pre_ok(t, False) for t in steps[1:])


_CUT = re.compile(r"(?<=\S) (?=\S)")


def _pieces(text: str, size: int):
    """`text` in consecutive pieces of at most about `size` characters, each after the first starting at a lone
    space between two non-space characters (a piece runs on to the next such space when there is none within
    `size`)."""
    start, n = 0, len(text)
    while n - start > size:
        cut = text.rfind(" ", start + 1, start + size)
        while cut > start and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind(" ", start + 1, cut)
        if cut <= start:  # none within `size`: the first one after it
            m = _CUT.search(text, start + size)
            if m is None:
                break
            cut = m.start()
        yield text[start:cut]
        start = cut
    yield text[start:]


def _hf_config(src: "str | os.PathLike") -> Dict:
    """The HF config of the causal LM at `src` without loading weights (config.json, or a GGUF header)."""
    p = Path(src)
    if p.is_dir():
        cfg = read_json(p / "config.json")
        return cfg if isinstance(cfg, dict) else {}
    from converters.formats.gguf_convert import open_gguf
    return open_gguf(p).config


def check_context(src: "str | os.PathLike", seq_len: int, cfg: Optional[Dict] = None) -> None:
    """Refuses `seq_len` above the `max_position_embeddings` (the context) of the causal LM at `src`, read
    from config.json or the GGUF header (or `cfg`, that config) before any weight is loaded; ModelError
    naming `src` and the limit."""
    ctx = (_hf_config(src) if cfg is None else cfg).get("max_position_embeddings")
    if isinstance(ctx, int) and not isinstance(ctx, bool) and seq_len > ctx:
        raise ModelError(f"{src}: seq_len={seq_len}: expected at most the model's context, "
                         f"max_position_embeddings = {ctx}")


def check_window(src: "str | os.PathLike", seq_len: int, batch_size: int, memory_bytes: Optional[int] = None) -> None:
    """Refuses, before any load or compute, windows the model at `src` cannot run: `seq_len` above its
    `max_position_embeddings` (its context), or an estimated activation peak above `memory_bytes` (default:
    the machine's physical memory). Estimate, bytes: batch · L · (3 · 4 · vocab + 2 · 4 · heads · L) -- the
    float32 logits with their log-sum-exp temporaries and one layer's attention scores and weights.

    Raises:
      ModelError naming `src`, the limit and the value.
    """
    cfg = _hf_config(src)
    check_context(src, seq_len, cfg)
    vocab, heads = cfg.get("vocab_size"), cfg.get("num_attention_heads")
    if not all(isinstance(v, int) and v > 0 for v in (vocab, heads)):
        return
    if memory_bytes is None:
        try:
            memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    need = batch_size * seq_len * (3 * 4 * vocab + 2 * 4 * heads * seq_len)
    if need > memory_bytes:
        raise ModelError(f"{src}: seq_len={seq_len} with batch_size={batch_size}: expected windows whose "
                         f"activations fit in memory ({memory_bytes / 2**30:.1f} GiB), found an estimated "
                         f"{need / 2**30:.1f} GiB (batch · L · (12 · vocab {vocab} + 8 · heads {heads} · L)); "
                         f"use a smaller seq_len or batch_size")


def evaluate_text(src: "str | os.PathLike", text: str, schemes: Sequence[str] = (STORED,), *, seq_len: int = 512,
                  max_windows: Optional[int] = None, batch_size: int = 4, skip_indivisible: bool = False,
                  log: Optional[Callable[[str], None]] = None, scan: bool = True,
                  mesh=None) -> Dict[str, Dict[str, float]]:
    """scheme -> {"ppl", "tokens", "bytes"} of the causal LM at `src` on `text` (the module's protocol);
    bytes = Σ bytes of the model's parameters as held in memory (packed layers at their stored size,
    `qformats.nn.param_bytes`). The model is loaded afresh for each scheme. With `skip_indivisible` a scheme
    that left projections dense also has "skipped": [their paths] (`load_for_scheme`). With `scan` (default) the
    layers run as scanned runs (`qformats.models.decoder.scan.scan_layers`: the same values, one traced layer per
    run of identical layers, so compile time does not grow with depth). With `mesh` (`converters.pipelines.mesh_load.
    parallel_setup`) each model is laid out on it after loading (`qformats.nn.sharding.shard_model` by
    `qformats.models.decoder.sharding.decoder_parallel_rules`: tensor and / or expert parallel) and runs SPMD.

    Raises:
      CheckpointError: SRC has no tokenizer.json, or as `load_for_scheme`. ModelError: the text is shorter
      than one window, `seq_len` beyond the model's context or memory (`check_window`), or as
      `load_for_scheme`.
    """
    from qformats.nn import param_bytes
    from qformats.presets import parse_scheme

    for s in schemes:  # every scheme string checked before the first (slow) load
        if s.strip().lower() not in (STORED, "dense"):
            parse_scheme(s)
    from converters.pipelines.causal_lm import load_tokenizer

    if int(seq_len) != seq_len or seq_len < 2:  # token_windows says it; check_window needs an int
        token_windows([], seq_len)
    check_window(src, int(seq_len), int(batch_size))
    tok = load_tokenizer(src)
    if tok is None:
        raise CheckpointError(f"{src}: expected a tokenizer.json beside the checkpoint, found none")
    windows = token_windows(encode_text(tok, text), seq_len, max_windows)
    out: Dict[str, Dict[str, float]] = {}
    for s in schemes:
        if log:
            log(f"{s}: {windows.shape[0]} windows of {seq_len} tokens")
        model, _, _, skipped = load_for_scheme(src, s, tokenizer=False, skip_indivisible=skip_indivisible)
        if mesh is not None:
            from qformats.models.decoder.sharding import decoder_parallel_rules
            from qformats.nn.sharding import shard_model
            shard_model(model, mesh, decoder_parallel_rules(model.config, mesh))
        if scan:
            from qformats.models.decoder.scan import scan_layers
            scan_layers(model)
        r = perplexity(model, windows, batch_size=batch_size, log=log)
        out[s] = {"ppl": r["ppl"], "tokens": r["tokens"], "bytes": param_bytes(model)}
        if skipped:
            out[s]["skipped"] = skipped
        del model
    return out
