"""Calibrated quantization to compressed-tensors checkpoints: the embedded all-MiniLM-L6-v2 and the decoder family.

`qformats quantize DST --scheme W4A16 --calibrate [FILE] [--weight-search mse+gptq]` lands here: the Flax MiniLM
(`qformats.models.minilm`, real weights from `converters.evaluation.embedded`) runs the calibration sentences once
through `qformats.nn.quantize_model` (static activation scales, per-layer H = E[x x^T], then the weight search: GPTQ on
MSE-searched scales by default), and the packed model is written with `converters.evaluation.embedded.save_checkpoint`
under the HF tensor names, next to the packaged tokenizer and sentence-transformers files. The result is an ordinary
compressed-tensors checkpoint: GPTQ changes the codes, not the format (transformers / vLLM load a W4A16 GPTQ
checkpoint like an RTN one).

Causal LMs (llama / mistral / qwen2 / qwen3, and the qwen2_moe / qwen3_moe / mixtral / gpt_oss / deepseek_v3 mixtures
of experts, every expert calibrated: `quantize_calibrated_lm`; gpt-oss's fused experts written per expert as
llm-compressor writes them): the checkpoint is loaded into the Flax
decoder (`converters.pipelines.causal_lm`), calibrated layer by layer on samples from a text / jsonl / .npy file
(`converters.evaluation.calibration_data`, `qformats.models.decoder.calibration`), optionally after SmoothQuant or AWQ scales are
folded into each layer, and written with `converters.pipelines.flax_io.save_compressed` (lm_head left dense and listed
in `ignore`, as llm-compressor's recipes do).

A data-free checkpoint of any HF model needs no Flax model (`converters.pipelines.quantize_checkpoint`); calibration
does.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

from converters.evaluation import embedded
from converters.evaluation.embedding_fidelity import resolve
from converters.formats.safe_files import check_destination
from qformats.errors import CheckpointError, ModelError
from qformats.algorithms.gptq import DAMPENING_FRAC
from qformats.nn import Rule, quantize_model, quantized_layers
from qformats.algorithms.weight_search import RTN, WEIGHT_SEARCHES, search_text

__all__ = ["DEFAULT_WEIGHT_SEARCH", "DEFAULT_LM_WEIGHT_SEARCH", "quantize_calibrated", "quantize_calibrated_lm"]

DEFAULT_WEIGHT_SEARCH = "mse+gptq"  # the best held-out fidelity: BENCHMARKS.md, "Embedding fidelity (MiniLM held out)"
DEFAULT_LM_WEIGHT_SEARCH = "gptq"  # llm-compressor's GPTQModifier (round-to-nearest scales, GPTQ codes)


def quantize_calibrated(dst, scheme: str, *, sentences: Optional[Sequence[str]] = None,
                        weight_search: str = DEFAULT_WEIGHT_SEARCH, batch_size: int = 32, overwrite: bool = False,
                        dampening_frac: float = embedded.GPTQ_DAMPENING,
                        log: Callable[[str], None] = lambda m: None) -> dict:
    """Quantize MiniLM's Linear layers (pooler included) with `scheme`, calibrated on `sentences` (default: the
    shipped set), and write the checkpoint to `dst`. Returns {"layers", "searched", "seconds", "path"}.

    The sentences are batched without padding (`embedded.calibration_batches`: grouped by length, at most
    `batch_size` a batch): padded positions would enter every layer's H = E[x x^T] and activation ranges.

    weight_search: "rtn" (round-to-nearest weights; calibration still sets static activation scales),
    "mse", "gptq" or "mse+gptq" (see `qformats.nn.quantize_model`). `dampening_frac`: GPTQ's, H += dampening_frac *
    mean(diag H) * I (default `embedded.GPTQ_DAMPENING` = 0.1, chosen on held-out text; llm-compressor's is 0.01).

    Raises:
      SchemeError: unknown scheme. ModelError: the scheme does not fit a layer. CheckpointError: dst exists
        (without overwrite) or cannot be written; nothing is left half-written.
    """
    if weight_search not in WEIGHT_SEARCHES:
        raise ModelError(f"weight_search must be one of {WEIGHT_SEARCHES}, got {weight_search!r}")
    ss = resolve(scheme)
    if ss is None:
        raise ModelError("scheme 'dense' quantizes nothing; pick a preset such as W4A16")
    if Path(dst).exists() and not overwrite:  # fail before the calibration work, not after
        raise CheckpointError(f"{dst}: already exists (pass overwrite=True to replace it)")
    sentences = list(sentences) if sentences is not None else embedded.default_sentences()
    if not sentences:
        raise ModelError("calibration needs at least one sentence")
    t0 = time.perf_counter()
    tok = embedded.Tokenizer()
    batches = embedded.calibration_batches(tok, sentences, batch_size)  # no padding rows in H
    model = embedded.load_minilm()
    damp = f" (dampening {dampening_frac:g})" if "gptq" in weight_search else ""
    log(f"calibrating all-MiniLM-L6-v2 on {len(sentences)} sentences ({len(batches)} batches), "
        f"{ss.name}, weights: {weight_search}{damp}")
    logger = logging.getLogger("qformats")
    handler = _LogTo(log)
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rule matches every Linear; nothing to warn about here
            quantize_model(model, [Rule(".*", ss)], calibration_data=batches, weight_search=weight_search,
                           dampening_frac=dampening_frac)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    layers = quantized_layers(model)
    searched = sum(1 for m in layers.values() if m.weight_method != RTN)
    log(f"quantized {len(layers)} Linear layers in {time.perf_counter() - t0:.1f} s "
        f"({search_text(len(layers), searched, weight_search)})")
    embedded.save_checkpoint(model, dst, overwrite=overwrite)
    log(f"wrote {dst}")
    return {"layers": len(layers), "searched": searched, "seconds": time.perf_counter() - t0, "path": str(dst)}


class _LogTo(logging.Handler):
    """Forwards the INFO records of the `qformats` logger to a `log(str)` callable."""

    def __init__(self, fn):
        super().__init__(logging.INFO)
        self.fn = fn

    def emit(self, record):
        self.fn(record.getMessage())


def quantize_calibrated_lm(src, dst, scheme: str, calibration, *, weight_search: Optional[str] = None,
                           awq: bool = False, smooth: Optional[float] = None, calibration_tokens: int = 65536,
                           seq_len: int = 512, seed: Optional[int] = 0, dampening_frac: float = DAMPENING_FRAC,
                           block_size: int = 128, actorder: Optional[str] = "static",
                           propagate: Optional[str] = None, guard: bool = False, overwrite: bool = False,
                           awq_n_grid: int = 20,
                           awq_duo_scaling=True, kv_cache=None, rotate: Optional[str] = None,
                           rotate_seed: int = 0, between_phases: Optional[Callable[[], object]] = None,
                           timings: Optional[dict] = None, moe_statistics: str = "all",
                           log: Callable[[str], None] = lambda m: None) -> dict:
    """Quantize a causal LM's decoder projections with `scheme`, calibrated layer by layer, and write a
    compressed-tensors checkpoint at `dst`. Returns {"layers", "projections", "searched", "tokens", "samples",
    "seconds", "path"}.

    Args:
      src: a dense HF checkpoint directory (llama / mistral / qwen2 / qwen3 / qwen2_moe / qwen3_moe / mixtral / gpt_oss
        / deepseek_v3) or a .gguf file. gpt_oss is written in llm-compressor's per-expert layout
        (`experts.{e}.{gate,up,down}_proj` with biases) by the streamed path only (no rotate / kv_cache).
      dst: the output directory (atomic write; tokenizer and other files of a directory `src` copied, a .gguf
        file's tokenizer written as tokenizer.json / tokenizer_config.json).
      scheme: a scheme string ("W4A16", "W4A16:g64", "W8A8", ...) for every projection; lm_head stays dense.
      calibration: a text file (one sample per non-empty line), a .jsonl file ({"text": ...} per line) or a
        .npy array of token ids (`converters.evaluation.calibration_data.load_calibration`).
      weight_search: "rtn", "mse", "gptq" or "mse+gptq"; default "gptq", or "rtn" with `awq` (llm-compressor's
        AWQ recipe: AWQModifier then round-to-nearest QuantizationModifier).
      awq: AWQ scales (`qformats.algorithms.awq`, llm-compressor 0.14's AWQModifier arithmetic) folded into each
        layer before its weight search; `awq_n_grid`, `awq_duo_scaling`: its n_grid and duo_scaling. Not
        combinable with `smooth` (both fold per-channel scales into the same norms; llm-compressor does not
        combine them).
      smooth: SmoothQuant migration strength alpha in [0, 1] (`qformats.algorithms.smoothquant`), or None.
      calibration_tokens, seq_len, seed: the token budget, the longest sample, the sample order's seed.
      dampening_frac, block_size, actorder: GPTQ's options (llm-compressor 0.14's names and defaults).
      guard: keep round-to-nearest for a projection where the search does not lower tr(dW^T H dW) (`calibrate_decoder`'s
        guard). Off by default, as llm-compressor keeps every GPTQ result: on SmolLM2 it never fired (210 of 210
        projections kept GPTQ's codes) and its error products cost a quarter of the weight search.
      propagate: "quantized" or "float" (`qformats.models.decoder.calibration`); default "quantized", except with
        round-to-nearest weights: "float", as llm-compressor runs such a recipe (its pipeline keeps quantization
        disabled and RTN leaves the weights float until the checkpoint is written, so layer i+1 sees float outputs:
        what the static activation ranges of W4A4 / W8A8 and the KV-cache scales are calibrated on).
      kv_cache: a `qformats.kv_cache.KVCacheScheme` or "fp8" / "fp8:head" / "fp8:dynamic": FP8 KV cache, static
        k_scale / v_scale calibrated on the same samples (`calibrate_decoder`'s kv_cache), written as
        compressed-tensors' kv_cache_scheme with the scales under each attention module.
      rotate: "hadamard" or "random-hadamard": SpinQuant's R1 + R2 (`converters.pipelines.rotate.rotate_checkpoint`,
        signs from `rotate_seed`) fused into a dense copy of `src` (a directory) before loading, so calibration sees the
        rotated model; recorded as quantization_config.transform_config.
      between_phases: called with no arguments between the phases of each layer's calibration
        (`qformats.models.decoder.calibration.calibrate_decoder`'s), e.g. `converters.process.trim_malloc`; the process
        tuning of the `qformats` CLI is `converters.process.lean_calibration`, which this function does not apply.
      timings: optional dict receiving the wall seconds of each phase: "read calibration" (tokenizing the file),
        "load" (the model, or the streamed checkpoint's checks), "write" (the checkpoint's last tensors and files),
        and `calibrate_decoder`'s phases.
      moe_statistics: mixture-of-experts models (qwen2_moe, qwen3_moe, mixtral): what each expert's statistics are
        taken over (`qformats.models.decoder.calibration.MOE_STATISTICS`): "all" (every token through every expert,
        llm-compressor's `moe_calibrate_all_experts=True` default), "routed" (routed tokens only; an expert that
        receives none is refused, naming layer and expert) or "routed-or-all"; the same tokens give each expert's
        static input scale (FP8, NVFP4), written per expert (`mlp.experts.{e}.gate_proj.input_scale`). Routers and the
        shared expert's gate stay dense and are listed in `ignore`, as llm-compressor's MoE recipes do. AWQ on
        qwen3_moe / qwen2_moe / mixtral / deepseek_v3 follows llm-compressor's MoE mappings under "all" statistics
        (`awq_transform`; gpt_oss and other statistics are refused); SmoothQuant smooths the attention only (its
        Qwen-MoE / Mixtral / DeepSeek mappings).

    Raises:
      CheckpointError: unreadable src / calibration file, dst exists without overwrite. ModelError / SchemeError:
        a scheme that does not fit, bad options.
    """
    import tempfile

    from converters.evaluation.calibration_data import load_calibration
    from converters.pipelines.causal_lm import kv_scale_name_map, load_causal_lm
    from converters.pipelines.flax_io import save_compressed
    from qformats.kv_cache import parse_kv_cache
    from qformats.models.decoder import hf_tensor_names
    from qformats.algorithms.gptq import GPTQOptions
    from qformats.models.decoder.calibration import calibrate_decoder

    check_destination(dst, (src,))  # fail before the calibration work, not after (the writer checks again)
    if Path(dst).exists() and not overwrite:  # fail before the calibration work, not after
        raise CheckpointError(f"{dst}: already exists (pass overwrite=True to replace it)")
    if awq and smooth is not None:
        raise ModelError("quantize_calibrated_lm: AWQ and SmoothQuant (smooth=ALPHA / --smooth) both fold per-channel "
                         "scales into the same norms and projections, and llm-compressor does not combine them: "
                         "choose one")
    if awq:
        _refuse_moe_awq(src, moe_statistics)
    if smooth is not None and _model_type(src) == "gpt_oss":
        raise ModelError(f"{src}: SmoothQuant on gpt_oss models is not supported (llm-compressor 0.14 has no "
                         "mapping for GptOssForCausalLM's fused experts); use GPTQ (--weight-search gptq)")
    if isinstance(kv_cache, str):
        kv_cache = parse_kv_cache(kv_cache)
    if weight_search is None:
        weight_search = RTN if awq else DEFAULT_LM_WEIGHT_SEARCH
    if propagate is None:
        propagate = "float" if weight_search == RTN else "quantized"
    gptq = GPTQOptions(block_size=block_size, dampening_frac=dampening_frac, actorder=actorder)
    transform = None
    if awq:
        from qformats.models.decoder.calibration import awq_transform

        transform = awq_transform(scheme, n_grid=awq_n_grid, duo_scaling=awq_duo_scaling)
    if smooth is not None:
        from qformats.models.decoder.calibration import smoothquant_transform

        transform = smoothquant_transform(smooth, moe=_is_moe(src))
    t0 = time.perf_counter()
    if rotate is None and kv_cache is None and _streamable(Path(src)):  # one layer resident at a time
        return _quantize_streamed(Path(src), dst, scheme, calibration, weight_search=weight_search, gptq=gptq,
                                  propagate=propagate, transform=transform, seq_len=seq_len,
                                  calibration_tokens=calibration_tokens, seed=seed, overwrite=overwrite, t0=t0,
                                  between_phases=between_phases, timings=timings, guard=guard,
                                  moe_statistics=moe_statistics, log=log)
    with tempfile.TemporaryDirectory(prefix="qformats-rotated-") as rot_dir:
        rotated = None
        if rotate is not None:  # before calibration: the rotated model is the one calibrated
            from converters.pipelines.rotate import rotate_checkpoint

            rotated = rotate_checkpoint(src, Path(rot_dir) / "rotated", rotate, seed=rotate_seed)
            log(f"rotated {src}: SpinQuant R1 + R2, {rotate}")
        model, hf_config, tok = load_causal_lm(src if rotated is None else Path(rot_dir) / "rotated",
                                               packed=False)  # a .gguf file dequantized: calibration starts dense
        if model.config.moe is not None and model.config.moe.fused_gate_up:
            raise ModelError(f"{src}: a calibrated {model.config.model_type} checkpoint is written in llm-compressor's "
                             "per-expert layout by the streamed path only (a dense checkpoint directory, without "
                             "rotate / kv_cache); this combination would write the fused gate_up_proj stacks")
        # the model holds its parameters now; the rotated copy goes (its tokenizer files are src's)
    tokenize = None if tok is None else (lambda text: tok.encode(text).ids)
    samples = load_calibration(calibration, tokenize, seq_len=seq_len, max_tokens=calibration_tokens, seed=seed,
                               vocab_size=model.config.vocab_size)
    log(f"loaded {src} ({model.config.model_type}, {model.config.num_layers} layers) in "
        f"{time.perf_counter() - t0:.1f} s; {len(samples)} calibration samples, "
        f"{sum(len(s) for s in samples)} tokens from {calibration}")
    t1 = time.perf_counter()
    info = calibrate_decoder(model, samples, scheme, weight_search=weight_search, gptq=gptq, propagate=propagate,
                             transform=transform, kv_cache=kv_cache, between_phases=between_phases, timings=timings,
                             guard=guard, moe_statistics=moe_statistics, log=log)
    t2 = time.perf_counter()
    # an expert's slice of a stacked parameter carries its index
    names = {n: ("/".join(str(p) for p in slot.path), slot.transpose) + (() if slot.expert is None else (slot.expert,))
             for n, slot in hf_tensor_names(model.config).items()}
    names.update(kv_scale_name_map(model))
    from qformats.models.decoder.calibration import moe_ignored

    ignore = ([] if model.lm_head is None else ["lm_head"]) + moe_ignored(model.config)
    src_path = Path(src)
    with tempfile.TemporaryDirectory() as extra:
        copy_from = src_path if src_path.is_dir() else None
        if copy_from is None and tok is not None:  # a GGUF file: its tokenizer as transformers' GGUF loading saves it
            import json

            from converters.formats.gguf_convert import open_gguf

            for name, content in open_gguf(src_path).tokenizer_files().items():
                text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False)
                (Path(extra) / name).write_text(text, encoding="utf-8")
            copy_from = Path(extra)
        save_compressed(model, dst, names, config=dict(hf_config), copy_from=copy_from, overwrite=overwrite,
                        ignore=ignore, kv_cache_scheme=kv_cache,
                        transform_config=None if rotated is None else rotated.transform_config)
    seconds = time.perf_counter() - t0
    if timings is not None:
        timings["load"] = timings.get("load", 0.0) + t1 - t0
        timings["write"] = timings.get("write", 0.0) + time.perf_counter() - t2
    log(f"wrote {dst}: {info['projections']} projections "
        f"({search_text(info['projections'], info['searched'], weight_search)}) in {seconds:.1f} s")
    return {**info, "samples": len(samples), "seconds": seconds, "path": str(dst)}


def _model_type(src) -> Optional[str]:
    """config.json's model_type of a checkpoint directory (None for a file or a directory without one)."""
    from converters.formats.safetensors_io import read_json

    src = Path(src)
    cfg = read_json(src / "config.json") if src.is_dir() and (src / "config.json").is_file() else {}
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def _is_moe(src) -> bool:
    """Whether `src` (a checkpoint directory) holds a mixture-of-experts model (by its config.json model_type)."""
    from converters.formats.safetensors_io import read_json
    from qformats.models.decoder.moe import MOE_MODEL_TYPES

    src = Path(src)
    cfg = read_json(src / "config.json") if src.is_dir() and (src / "config.json").is_file() else {}
    return isinstance(cfg, dict) and cfg.get("model_type") in MOE_MODEL_TYPES + ("deepseek_v3",)


def _refuse_moe_awq(src, moe_statistics: str) -> None:
    """ModelError for AWQ on a mixture-of-experts checkpoint directory that `awq_transform`'s MoE mappings
    (llm-compressor 0.14's Qwen-MoE and DeepSeek-V3 ones, every expert observing every token) do not cover, before any
    work: gpt-oss blocks, or routed-only statistics."""
    from converters.formats.safetensors_io import read_json

    if not _is_moe(src):
        return
    cfg = read_json(Path(src) / "config.json")
    kind = cfg.get("model_type")
    if kind == "gpt_oss":
        raise ModelError(f"{src}: AWQ on gpt_oss models is not supported (llm-compressor 0.14 has no AWQ mapping for "
                         "GptOssForCausalLM's fused experts); use GPTQ (--weight-search gptq)")
    if moe_statistics != "all":
        raise ModelError(f"{src}: AWQ on mixture-of-experts models takes every token through every expert "
                         f"(llm-compressor's moe_calibrate_all_experts); moe_statistics={moe_statistics!r} is not "
                         "supported with it")


def _streamable(src: Path) -> bool:
    """A dense (not compressed-tensors) HF checkpoint directory: calibrated streaming, one layer resident."""
    from converters.formats.safetensors_io import read_json

    if not (src.is_dir() and (src / "config.json").is_file()):
        return False
    cfg = read_json(src / "config.json")
    return isinstance(cfg, dict) and "quantization_config" not in cfg


def _stream_plan(ck, scheme, slots, per_layer, outside, model):
    """The output tensors of `_quantize_streamed`, in the order it writes them (layer by layer: each layer's
    tensors in `per_layer` order, its seven projections packed, the rest float32; then the tensors `outside` the
    layers), so the writer puts each one straight to disk (`ShardedWriter`'s planned mode) instead of holding
    every packed layer until the end. None (the writer then keeps a shard in memory) for schemes with static
    input scales, whose extra tensors this plan does not list."""
    import numpy as np

    from converters.pipelines.quantize_checkpoint import packed_specs
    from converters.formats.shard_writer import TensorSpec
    from qformats.models.decoder.calibration import quantized_paths
    from qformats.nn import resolve_scheme

    ss = resolve_scheme(scheme)
    a = ss.input_activations
    if a is not None and a.dynamic is not True:
        return None
    if model.config.moe is not None and model.config.moe.fused_gate_up:  # written per expert (`_write_fused_experts`)
        return None
    plan, cache = [], {}
    for i, names in per_layer.items():
        quantized = set(quantized_paths(model.model.layers[i]))
        for n in names:
            slot = slots[n]
            if slot.path[-1] == "kernel" and "/".join(str(p) for p in slot.path[3:-1]) in quantized:
                plan += packed_specs(ss, n.rsplit(".", 1)[0], tuple(ck.info(n).shape), np.float32, cache)
            else:
                plan.append(TensorSpec(n, np.dtype(np.float32), tuple(ck.info(n).shape)))
    plan += [TensorSpec(n, np.dtype(np.float32), tuple(ck.info(n).shape)) for n in outside]
    return plan


def _write_fused_experts(w, name: str, slot, layer, packed: dict, rel: str) -> None:
    """Writes one of gpt-oss's fused expert tensors of a calibrated layer (`name`: "<P>.experts.gate_up_proj",
    "..._bias", "<P>.experts.down_proj", "..._bias") per expert, in the layout llm-compressor 0.14 writes after
    linearizing them (`converters.formats.moe_layout`): gate_up_proj's packed rows split into
    `<P>.experts.{e}.gate_proj` (even columns) and `.up_proj` (odd; `params.split_gate_up`), biases alike, down_proj
    as `<P>.experts.{e}.down_proj`; each expert's static input scales (FP8, NVFP4) under both of its gate / up."""
    import jax
    import numpy as np

    from qformats.models.decoder.params import resolve_path, split_gate_up

    base, local = name.rsplit(".", 1)
    proj = local[:-len("_bias")] if local.endswith("_bias") else local
    parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
    if local.endswith("_bias"):
        b = np.asarray(resolve_path(layer, slot.path[3:]).get_value())
        for e in range(b.shape[0]):
            for j, p in enumerate(parts):
                w.add_dense(f"{base}.{e}.{p}.bias", b[e, j::len(parts)])
        return
    if rel not in packed:
        raise CheckpointError(f"{name}: gpt-oss's fused experts were not quantized by the calibration; a fused stack "
                              "cannot be written in llm-compressor's per-expert layout dense")
    q = packed[rel]["weight"]
    for e in range(q.codes.shape[0]):
        qe = jax.tree.map(lambda leaf, e=e: leaf[e], q)
        qs = split_gate_up(qe, f"{base}.{e}") if len(parts) == 2 else (qe,)
        for p, qp in zip(parts, qs):
            w.add_qarray(f"{base}.{e}.{p}", qp, packed[rel]["schemes"])
            for extra in ("input_scale", "input_global_scale"):
                if extra in packed[rel]:
                    w.add_dense(f"{base}.{e}.{p}.{extra}", np.asarray(packed[rel][extra][e]))


def _release(module) -> None:
    """Drops a module's arrays (each Variable holds a scalar placeholder afterwards): a layer that was written out."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Variable):
            var.set_value(jax.ShapeDtypeStruct((), jnp.float32))


def _quantize_streamed(src: Path, dst, scheme: str, calibration, *, weight_search: str, gptq, propagate: str,
                       transform, seq_len: int, calibration_tokens: int, seed, overwrite: bool, t0: float,
                       between_phases: Optional[Callable[[], object]], timings: Optional[dict], guard: bool,
                       log: Callable[[str], None], moe_statistics: str = "all") -> dict:
    """`quantize_calibrated_lm` for a dense checkpoint directory, streamed: the model is built abstract
    (shapes only), each decoder layer's tensors are read from the memory-mapped checkpoint just before its
    calibration (`calibrate_decoder`'s load_layer) and its packed result goes to the checkpoint writer right
    after (store_layer), its arrays then dropped; the embeddings of the calibration tokens are gathered from
    the map. The dense model is never resident: peak memory is one layer (plus the packed layers waiting in the
    writer's shard and the calibration activations). Same tensors, values and checks as loading it whole."""
    c0 = time.process_time()
    import jax.numpy as jnp
    import numpy as np

    from converters.evaluation.calibration_data import load_calibration
    from converters.pipelines.causal_lm import load_tokenizer
    from converters.formats.compressed_tensors.write import CompressedWriter
    from converters.formats.safetensors_io import open_checkpoint, read_json
    from qformats.models.abstract import abstract_module
    from qformats.models.decoder import CausalLM, DecoderConfig, hf_tensor_names, inv_freq
    import jax

    from qformats.models.decoder.calibration import calibrate_decoder, moe_ignored
    from qformats.models.decoder.params import resolve_path
    from qformats.nn import export_quantized

    hf_config = read_json(src / "config.json")
    try:
        cfg = DecoderConfig.from_hf(hf_config)
    except ModelError as e:
        raise CheckpointError(f"{src / 'config.json'}: {e}") from None
    model = abstract_module(lambda rngs: CausalLM(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs))
    tok = load_tokenizer(src)
    t1, c1 = time.perf_counter(), time.process_time()
    samples = load_calibration(calibration, None if tok is None else (lambda text, t=tok: t.encode(text).ids),
                               seq_len=seq_len, max_tokens=calibration_tokens, seed=seed, vocab_size=cfg.vocab_size)
    del tok  # the tokenizer's tables (~50 MiB) are not needed while calibrating
    t2, c2 = time.perf_counter(), time.process_time()
    slots = hf_tensor_names(cfg)

    with open_checkpoint(src) as ck:
        # every check of a whole load (decoder.load_hf_tensors), before any work
        names = set(ck.keys())
        missing = sorted(n for n in slots if n not in names)
        unexpected, bad = [], []
        for n in sorted(names - set(slots)):
            if n == "lm_head.weight" and cfg.tie_word_embeddings:
                if not np.array_equal(ck.get(n), ck.get("model.embed_tokens.weight")):
                    bad.append(f"{n} (tied to model.embed_tokens.weight, but the values differ)")
            elif n.endswith("rotary_emb.inv_freq"):
                if not np.array_equal(np.asarray(ck.get(n), np.float32), inv_freq(cfg)):
                    bad.append(f"{n} (differs from the config's RoPE inverse frequencies)")
            else:
                unexpected.append(n)
        for n, slot in slots.items():
            if n in names:
                want = tuple(resolve_path(model, slot.path).get_value().shape)[(0 if slot.expert is None else 1):]
                want = want[::-1] if slot.transpose else want
                if tuple(ck.info(n).shape) != want:
                    bad.append(f"{n} (shape {tuple(ck.info(n).shape)}, expected {want})")
        ck.drop_pages()
        if missing or unexpected or bad:
            problems = [f"{len(x)} {what}: {', '.join(x[:6])}" + (" ..." if len(x) > 6 else "")
                        for x, what in ((missing, "missing"), (unexpected, "unexpected"), (bad, "wrong")) if x]
            raise CheckpointError(f"{src}: expected the tensors of a {cfg.model_type} decoder; " + "; ".join(problems))
        log(f"streaming {src} ({cfg.model_type}, {cfg.num_layers} layers) in {time.perf_counter() - t0:.1f} s; "
            f"{len(samples)} calibration samples, {sum(len(s) for s in samples)} tokens from {calibration}")
        per_layer = {i: [n for n in slots if slots[n].path[:3] == ("model", "layers", i)]
                     for i in range(cfg.num_layers)}
        # embeddings, final norm, an untied lm_head: written last, as the checkpoint has them
        outside = [n for n, slot in slots.items() if slot.path[:2] != ("model", "layers")]
        plan = _stream_plan(ck, scheme, slots, per_layer, outside, model)
        if timings is not None:
            timings["read calibration"] = timings.get("read calibration", 0.0) + t2 - t1
            timings["read calibration cpu"] = timings.get("read calibration cpu", 0.0) + c2 - c1
            timings["load"] = timings.get("load", 0.0) + time.perf_counter() - t0 - (t2 - t1)
            timings["load cpu"] = timings.get("load cpu", 0.0) + time.process_time() - c0 - (c2 - c1)
        with CompressedWriter(dst, overwrite=overwrite, plan=plan, sources=(src,)) as w:
            def load_layer(i, layer):
                experts = {}  # stacked [E, ...] parameters, filled expert by expert (mixture-of-experts layers)
                for n in per_layer[i]:
                    slot = slots[n]
                    v = resolve_path(layer, slot.path[3:])
                    a = ck.get(n)
                    a = np.asarray(a.T if slot.transpose else a, dtype=np.float32)
                    if slot.expert is None:
                        v.set_value(jnp.asarray(a))
                    else:
                        experts.setdefault(id(v), (v, {}))[1][slot.expert] = a
                for v, parts in experts.values():
                    v.set_value(jnp.asarray(np.stack([parts[e] for e in range(len(parts))])))
                ck.drop_pages()

            def store_layer(i, layer):
                packed = export_quantized(layer)  # projection path relative to the layer -> QArray, scales
                for n in per_layer[i]:
                    slot = slots[n]
                    rel = "/".join(str(p) for p in slot.path[3:-1])
                    if cfg.moe is not None and cfg.moe.fused_gate_up and n.rsplit(".", 1)[0].endswith(".experts"):
                        _write_fused_experts(w, n, slot, layer, packed, rel)
                        continue
                    if rel in packed and slot.path[-1] == "kernel":
                        mod = n.rsplit(".", 1)[0]
                        q = packed[rel]["weight"]
                        if slot.expert is not None:  # one expert of a stacked QExperts: every leaf indexed
                            q = jax.tree.map(lambda leaf, e=slot.expert: leaf[e], q)
                        w.add_qarray(mod, q, packed[rel]["schemes"])
                        for local in ("input_scale", "input_global_scale"):
                            if local in packed[rel]:  # per expert for a stacked QExperts, as its weight
                                v = packed[rel][local]
                                w.add_dense(f"{mod}.{local}", np.asarray(v if slot.expert is None else v[slot.expert]))
                    else:
                        a = np.asarray(resolve_path(layer, slot.path[3:]).get_value())
                        a = a if slot.expert is None else a[slot.expert]
                        w.add_dense(n, a.T if slot.transpose else a)
                _release(layer)

            def embed(ids):
                rows = np.asarray(ck.get("model.embed_tokens.weight")[np.asarray(ids)], np.float32)
                ck.drop_pages()
                return rows

            info = calibrate_decoder(model, samples, scheme, weight_search=weight_search, gptq=gptq,
                                     propagate=propagate, transform=transform, embed=embed, load_layer=load_layer,
                                     store_layer=store_layer, between_phases=between_phases, timings=timings,
                                     guard=guard, moe_statistics=moe_statistics, log=log)
            t3, c3 = time.perf_counter(), time.process_time()
            for n in outside:
                w.add_dense(n, np.asarray(ck.get(n), np.float32))
            w.finish(dict(hf_config), ignore=([] if cfg.tie_word_embeddings else ["lm_head"]) + moe_ignored(cfg),
                     copy_from=src)
    seconds = time.perf_counter() - t0
    if timings is not None:
        timings["write"] = timings.get("write", 0.0) + time.perf_counter() - t3
        timings["write cpu"] = timings.get("write cpu", 0.0) + time.process_time() - c3
    log(f"wrote {dst}: {info['projections']} projections "
        f"({search_text(info['projections'], info['searched'], weight_search)}) in {seconds:.1f} s")
    return {**info, "samples": len(samples), "seconds": seconds, "path": str(dst)}
