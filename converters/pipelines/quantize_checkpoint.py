"""Whole-checkpoint quantization: a dense HF safetensors checkpoint -> a compressed-tensors checkpoint, streaming.

Which tensors are quantized (the plan: `checkpoint_plan`, `qformats.plan`; no torch model is built):
  - a "Linear" weight is a 2-D floating `<module>.weight` that the model definition names a Linear where
    qformats defines the architecture (config.json's model_type: the decoder family, BERT;
    `model_linear_modules`); otherwise one whose module path has no component containing "embed" or "norm"
    (case-insensitive) — a name heuristic the summary reports with the count of weights it chose;
  - an "Embedding" target selects 2-D `*.weight`s with "embed" in a path component;
  - a `re:` target is a regex matched (re.match, as compressed-tensors does) against the module path, and
    selects that module's 2-D floating weight whatever its name;
  - `ignore` entries are exact module paths, `re:` regexes, or a last path component ("lm_head" also
    ignores "model.lm_head"). An ignore entry or target that matches nothing gives a warning.
Mixture-of-experts checkpoints (`converters.formats.moe_layout`): per-expert weights (`<P>.experts.{e}.gate_proj`,
Mixtral's `experts.{e}.w1`, ...) are Linears like any other, so every expert is quantized, under the checkpoint's
own names; routers (`<P>.gate` / `<P>.router` next to `<P>.experts`) are transformers 5 `*TopKRouter` modules, not
nn.Linear: a "Linear" target leaves them dense and they are listed in `ignore` (compressed-tensors types them
"Linear" for vLLM), as llm-compressor 0.14's oneshot writes them. gpt-oss's fused 3-D experts are split into
per-expert Linears (`experts.{e}.{gate,up,down}_proj` with their biases) as llm-compressor linearizes them; fused
expert tensors of any other layout are refused by name. The summary counts the experts ("N layers × E experts ×
P projections") and the routers kept dense.
NVFP4 (tensor_group) global scales of vLLM's fused projections are shared as llm-compressor's oneshot does
(its fused weight observers): the siblings of `qformats.algorithms.shared_scales.FUSED_GROUPS` (q/k/v_proj,
gate/up_proj, q_a_proj/kv_a_proj_with_mqa, w1/w3) take the smallest of their global scales, i.e. 448*6/amax over
the group (`shared_scales.shared_global_scale`; fuse_global_scales). A group only partly quantized gets a warning.

Never silent: where llm-compressor 0.14 refuses a layer (GROUP / TENSOR_GROUP weights whose group size does not
divide the columns: `qformats.plan.group_indivisible`, its rule, plus columns < group size, which
compressed-tensors' quantize refuses), `quantize_checkpoint` raises one CheckpointError naming every such layer,
its shape and the ways out (ignore them, a `:gN` group size that divides them, or `skip_indivisible=True`, which
leaves exactly those dense, adds them to `ignore` and lists them in the summary). An empty target weight is an
error too. BLOCK weights with a partial last block are quantized (scales by ceiling division).

Streaming: the output tensor list is planned from the header alone (shapes and dtypes of every compressed
tensor), so each shard's header is written first and each tensor goes to disk as soon as it is produced
(`converters.formats.shard_writer.ShardedWriter` with a plan); one tensor is read (memory-mapped), quantized, written
and dropped before the next, and the source pages are released (MADV_DONTNEED) as we go. Peak memory is about the largest tensor
times a small constant, whatever the model or shard size. Same-shape weights reuse one jit-compiled quantize
(qformats.quantize is jitted on shape, dtype and scheme).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

import numpy as np

from converters.formats.compressed_tensors.config import format_for
from converters.formats.compressed_tensors.write import CompressedWriter, qarray_to_tensors
from converters.formats.moe_layout import experts_text, linearized_experts, router_modules
from converters.formats.safetensors_io import open_checkpoint, parse_size, read_json
from converters.formats.shard_writer import TensorSpec
from converters.units import size_text
from qformats.algorithms.shared_scales import shared_global_scales
from qformats.errors import CheckpointError, QFormatsError
from qformats.formats import IntFormat
from qformats.grouping import expected_shapes
from qformats.kv_cache import kv_cache_name, parse_kv_cache
from qformats.matching import Matcher
from qformats.plan import (Candidate, Plan, divisible_group_scheme, group_indivisible, group_paths,
                           paths_text, plan_quantization, wrap_list)
from qformats.presets import parse_scheme
from qformats.qarray import QArray
from qformats.quantize import quantize
from qformats.schemes import SchemeSet

__all__ = ["QuantizeSummary", "checkpoint_plan", "model_linear_modules", "module_kind", "packed_specs",
           "quantize_checkpoint"]

_FLOAT_DTYPES = ("F32", "BF16", "F16")


def _components(module: str) -> List[str]:
    return [p.lower() for p in module.split(".")] if module else []


def module_kind(module: str) -> str:
    """The module class of a 2-D floating `<module>.weight` told from its name (no torch model here):
    "Embedding" when a path component contains 'embed', "Norm" when one contains 'norm', else "Linear"."""
    comps = _components(module)
    if any("embed" in c for c in comps):
        return "Embedding"
    return "Norm" if any("norm" in c for c in comps) else "Linear"


def model_linear_modules(hf_config: Dict[str, Any]) -> "tuple[Optional[set], str]":
    """(the module names that are Linear layers by the model definition, how that was decided) for an architecture
    qformats defines (the decoder family: `qformats.models.decoder.params.hf_tensor_names`; BERT:
    `qformats.models.minilm.torch_to_flax`, the tensors it transposes), or (None, why not) otherwise."""
    mt = hf_config.get("model_type")
    if mt == "bert":
        from qformats.models.minilm import MiniLMConfig, torch_to_flax

        try:
            table = torch_to_flax(MiniLMConfig.from_dict(hf_config))
        except QFormatsError as e:
            return None, f"not a BERT qformats defines ({e})"
        return {n[:-len(".weight")] for n, (_, t) in table.items() if t}, "the BERT model definition"
    from qformats.models.decoder import SUPPORTED_MODEL_TYPES, DecoderConfig
    from qformats.models.decoder.params import hf_tensor_names

    if mt not in SUPPORTED_MODEL_TYPES:
        return None, f"no model definition for model_type {mt!r}" if mt else "no model_type in config.json"
    try:
        cfg = DecoderConfig.from_hf(hf_config)
    except QFormatsError as e:
        return None, f"config.json does not describe a {mt} model qformats can build: {e}"
    names = hf_tensor_names(cfg)
    return {n[:-len(".weight")] for n, s in names.items() if s.transpose}, f"the {mt} model definition"


def checkpoint_plan(infos: Dict[str, Any], scheme: Optional[SchemeSet], targets: Sequence[str],
                    ignore: Sequence[str], linear: Optional[set] = None, routers: Optional[set] = None) -> Plan:
    """The plan (`qformats.plan`) over every 2-D floating `<module>.weight` of a checkpoint (tensor name ->
    TensorInfo), with compressed-tensors' targets and ignore (`qformats.matching.Matcher.from_targets`).

    A module's kind (what a "Linear" / "Embedding" target selects) is "Router" for the MoE routers in `routers`
    (`converters.formats.moe_layout.router_modules`: transformers 5's `*TopKRouter`, not an nn.Linear, so a
    "Linear" target leaves them dense as llm-compressor does; a `re:` target or exact path still selects them);
    it comes from the model definition where `linear` (`model_linear_modules`) names it a Linear; any other
    module's kind is told from its name (`module_kind`) and marked so in the plan (`Candidate.how`), which the
    summary reports. Per-expert weights (`<P>.experts.{e}.<proj>.weight`) are Linears like any other."""
    cands = []
    routers = routers or set()
    for name in sorted(infos):
        mod, _, local = name.rpartition(".")
        info = infos[name]
        if local == "weight" and len(info.shape) == 2 and info.dtype in _FLOAT_DTYPES:
            if mod in routers:
                cands.append(Candidate(mod, int(info.shape[1]), "Router", "moe layout"))
            elif linear is not None and mod in linear:
                cands.append(Candidate(mod, int(info.shape[1]), "Linear", "model"))
            else:
                cands.append(Candidate(mod, int(info.shape[1]), module_kind(mod), "name heuristic"))
    return plan_quantization(cands, Matcher.from_targets(scheme, targets, ignore), unmatched="not targeted")


@dataclasses.dataclass
class QuantizeSummary:
    src: str
    dst: str
    scheme: str
    quantized: int
    dense_tensors: int
    src_bytes: int
    dst_bytes: int
    quantized_dense_bytes: int
    quantized_stored_bytes: int
    seconds: float
    skipped: List[str] = dataclasses.field(default_factory=list)  # left dense by skip_indivisible
    by_name: List[str] = dataclasses.field(default_factory=list)  # selected by a class target, kind told by name
    kinds_from: str = ""  # where module kinds came from: a model definition, or why none applied
    experts: str = ""  # the expert weights among the quantized ones (moe_layout.experts_text), "" for none
    routers: List[str] = dataclasses.field(default_factory=list)  # MoE routers left dense (and in ignore)
    linearized: bool = False  # fused 3-D experts (gpt-oss) written as per-expert Linears

    @property
    def ratio(self) -> float:
        return self.src_bytes / max(self.dst_bytes, 1)

    def text(self) -> str:
        return (f"quantized {self.quantized} weights with {self.scheme} ({self.dense_tensors} other tensors kept): "
                f"{size_text(self.src_bytes)} -> {size_text(self.dst_bytes)} (x{self.ratio:.2f}; quantized weights "
                f"{size_text(self.quantized_dense_bytes)} -> {size_text(self.quantized_stored_bytes)}, "
                f"x{self.quantized_dense_bytes / max(self.quantized_stored_bytes, 1):.2f}) in {self.seconds:.1f}s "
                f"-> {self.dst}"
                + (f"\nexperts quantized: {self.experts}" + (" (split from the fused gate_up_proj / down_proj "
                   "tensors into per-expert Linears, as llm-compressor does)" if self.linearized else "")
                   if self.experts else "")
                + (f"\n{len(self.routers)} MoE router{'s' if len(self.routers) > 1 else ''} kept dense (listed in "
                   f"ignore): {', '.join(paths_text(self.routers))}" if self.routers else "")
                + ("\n" + wrap_list(f"left dense by --skip-indivisible ({len(self.skipped)}; their "
                                                     f"columns are not a multiple of the group size): ",
                                                     paths_text(self.skipped)) if self.skipped else "")
                + ("\n" + textwrap.fill(f"{len(self.by_name)} of them taken as Linear by their names (2-D, no "
                                         f"'embed' / 'norm' in the path; {self.kinds_from}): pass targets "
                                         f"(--targets) to choose exactly", 100, subsequent_indent="    ")
                   if self.by_name else ""))


class _Progress:
    """A one-line text progress bar on stderr: tensors done / total and bytes read."""

    def __init__(self, total_tensors: int, total_bytes: int, stream: Optional[TextIO], width: int = 30):
        self.n, self.b = 0, 0
        self.tn, self.tb = total_tensors, total_bytes
        self.stream = stream
        self.width = width
        self.t0 = time.monotonic()
        self._last = 0.0

    def update(self, nbytes: int, force: bool = False) -> None:
        self.n += 1
        self.b += nbytes
        if self.stream is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1 and self.n < self.tn:
            return
        self._last = now
        frac = self.b / self.tb if self.tb else 1.0
        fill = int(round(frac * self.width))
        rate = self.b / max(now - self.t0, 1e-9)
        self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {self.n}/{self.tn} tensors "
                          f"{size_text(self.b)}/{size_text(self.tb)} {size_text(rate)}/s")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def _fit_error(scheme, shape) -> Optional[str]:
    """Why a torch-layout [out, in] weight cannot take `scheme` (None when it can)."""
    if 0 in shape:
        return "empty tensor"
    return group_indivisible(shape[-1], scheme)


def _zero_qarray(scheme, shape, dtype) -> QArray:
    """A QArray of zeros with the parts (shapes, dtypes) that quantize gives a [out, in] weight along axis 1."""
    exp = expected_shapes(scheme, shape, 1)
    f = scheme.format
    cdt = np.int8 if isinstance(f, IntFormat) and f.bits == 8 and f.signed else np.uint8
    sdt = {"input": dtype, "e8m0": np.uint8, "fp8_e4m3fn": _ml("float8_e4m3fn"), "float32": np.float32,
           "bfloat16": _ml("bfloat16"), "float16": np.float16}[scheme.scale_format]
    z = lambda part, dt: None if exp[part] is None else np.zeros(exp[part], dt)  # noqa: E731
    return QArray(z("codes", cdt), z("scale", sdt), z("zero_point", np.int8), z("global_scale", np.float32),
                  scheme=scheme, shape=shape, dtype=dtype, axis=1)


def _ml(name: str):
    import ml_dtypes
    return np.dtype(getattr(ml_dtypes, name))


def _misfits(ck, infos, chosen: List[str], ss: SchemeSet) -> Dict[str, Tuple[tuple, str, str]]:
    """module -> (its weight's shape, its file name, why it cannot take the scheme), for every chosen module that
    cannot (`_fit_error`)."""
    out = {}
    for mod in chosen:
        name = f"{mod}.weight" if mod else "weight"
        why = _fit_error(ss.weights, infos[name].shape)
        if why is not None:
            out[mod] = (tuple(infos[name].shape), Path(ck.file_of(name)).name, why)
    return out


def _misfit_lines(misfits: Dict[str, Tuple[tuple, str, str]], mods: Sequence[str]) -> List[str]:
    """One line per group of `mods` that share shape and reason and differ only in their layer numbers
    (`qformats.plan.group_paths`): "  - model.layers.{0..29}.self_attn.q_proj (30 layers, weight [576, 576] in
    model.safetensors): columns=576 not divisible by group_size=128"."""
    by: Dict[Tuple[tuple, str], List[str]] = {}
    for m in mods:
        shape, _, why = misfits[m]
        by.setdefault((shape, why), []).append(m)
    lines = []
    for (shape, why), group in by.items():
        for pattern, members in group_paths(group, "."):
            n = len(members)
            files = sorted({misfits[m][1] for m in members})
            where = ", ".join(files) if len(files) <= 2 else f"{len(files)} files"
            lines.append(f"  - {pattern} ({f'{n} layers, ' if n > 1 else ''}weight {list(shape)} in {where}): {why}")
    return lines


def packed_specs(ss: SchemeSet, module: str, shape, dtype, cache: Optional[Dict[Any, List[Any]]] = None
                 ) -> List[TensorSpec]:
    """The tensors (names, dtypes, shapes, in `CompressedWriter.add_qarray`'s order) that module `module`'s
    [out, in] weight of `dtype` takes once quantized with `ss`: what a planned writer needs before the values.
    `cache` (optional dict) keeps the parts per (shape, dtype) between calls."""
    cache = {} if cache is None else cache
    key = (tuple(shape), np.dtype(dtype))
    if key not in cache:
        q0 = _zero_qarray(ss.weights, tuple(shape), np.dtype(dtype))
        fmt = format_for(ss.weights, ss.input_activations)
        cache[key] = [(k, a.dtype, a.shape) for k, a in qarray_to_tensors(q0, fmt, f"{module}.weight").items()]
    return [TensorSpec(f"{module}.{k}" if module else k, dt, sh) for k, dt, sh in cache[key]]


def _plan(infos, chosen_set, ss: SchemeSet) -> List[TensorSpec]:
    """The output tensors, in write order, from the source header alone (every chosen module fits the scheme)."""
    plan: List[TensorSpec] = []
    cache: Dict[Any, List[Any]] = {}
    for name in sorted(infos):
        mod, _, local = name.rpartition(".")
        info = infos[name]
        if local == "weight" and mod in chosen_set:
            plan.extend(packed_specs(ss, mod, info.shape, info.numpy_dtype, cache))
        else:
            plan.append(TensorSpec(name, info.numpy_dtype, info.shape))
    return plan


def _fused_global_scales(ck, infos, plan: Plan, ss: SchemeSet) -> Dict[str, Any]:
    """module -> the shared NVFP4 global scale of its fused group (`qformats.plan.Plan.fused_groups`, the scale
    of `qformats.algorithms.shared_scales`), for groups whose members are all quantized; a group only partly
    quantized gets a warning."""
    w = ss.weights
    if w.strategy != "tensor_group":
        return {}
    def where(mods):
        return mods[0].rpartition(".")[0], ", ".join(m.rpartition(".")[2] for m in mods)

    def partial(mods, inside):
        parent, names = where(mods)
        warnings.warn(f"{parent}: {names} are fused siblings (vLLM runs them as one matmul, with one NVFP4 "
                      f"global scale) but only {', '.join(inside)} take {ss.name}; their global scales are "
                      f"not shared", stacklevel=6)

    def mismatch(mods):
        parent, names = where(mods)
        dtypes = [infos[m + ".weight"].dtype for m in mods]
        warnings.warn(f"{parent}: {names} hold different dtypes ({', '.join(dtypes)}); their NVFP4 global "
                      f"scales are not shared (vLLM fuses them into one matmul)", stacklevel=5)

    def load(m):  # one weight in memory at a time: the previous member's pages go first
        ck.drop_pages()
        return ck.get(m + ".weight")

    groups = plan.fused_groups(".", partial=partial)
    out = shared_global_scales(groups, load, {m: (w, infos[m + ".weight"].numpy_dtype, ()) for g in groups
                                              for m in g}, mismatch=mismatch)
    ck.drop_pages()
    return out


def _as_scheme_set(scheme: "str | SchemeSet") -> SchemeSet:
    if isinstance(scheme, SchemeSet):
        return scheme
    try:
        return parse_scheme(scheme)
    except QFormatsError as e:
        raise CheckpointError(str(e)) from None


def quantize_checkpoint(src: "str | os.PathLike", dst: "str | os.PathLike", scheme: "str | SchemeSet",
                        ignore: Sequence[str] = ("lm_head",), targets: Sequence[str] = ("Linear",),
                        max_shard_size: "int | str" = "5GB", overwrite: bool = False,
                        progress: "bool | TextIO" = True, fuse_global_scales: bool = True,
                        skip_indivisible: bool = False, rotate: Optional[str] = None, rotate_seed: int = 0,
                        rotations: Sequence[str] = ("R1", "R2"), transform: Any = None,
                        kv_cache: Any = None) -> QuantizeSummary:
    """Quantize the Linear weights of the dense safetensors checkpoint `src` into a compressed-tensors
    checkpoint at `dst` (see the module docstring for the selection rule).

    Args:
      scheme: a scheme string (`qformats.presets.parse_scheme`: a preset name such as "W4A16", "NVFP4A16" or
        our FPx ones, with ":gN" for weight groups of N, ":w" for weights only) or a SchemeSet. Weights are quantized data-free (min-max); static activation scales
        (FP8, NVFP4 input) need calibration and are not written.
      ignore / targets: see the module docstring. max_shard_size: e.g. "5GB", "500MiB".
      overwrite: replace an existing dst (atomically) instead of refusing.
      progress: True for a progress bar on stderr, False for none, or a text stream.
      fuse_global_scales: share NVFP4 global scales across fused siblings (see the module docstring).
      skip_indivisible: leave the targeted weights whose columns the scheme's groups do not divide dense (added
        to `ignore`, listed in the summary's `skipped`) instead of refusing them.
      rotate: "hadamard" or "random-hadamard": SpinQuant's `rotations` (default R1 + R2, fused into the weights)
        of that kind with random signs from `rotate_seed`, applied to a dense copy of `src` in a temporary
        directory before quantizing (`converters.pipelines.rotate.rotate_checkpoint`; lm_head untied), and recorded in
        quantization_config.transform_config as llm-compressor's SpinQuantModifier records them.
      transform: a `converters.pipelines.rotate.Rotated` whose rotations `src` already carries (what rotate_checkpoint
        returned for it): its transform_config is recorded and its online tensors written (dense).
      kv_cache: a dynamic FP8 KV-cache scheme ("fp8:dynamic" or a `qformats.kv_cache.KVCacheScheme`), recorded as
        quantization_config.kv_cache_scheme (no tensors: scales are computed as the cache is written). Static
        ("fp8", "fp8:head") scales are calibrated from data: `converters.pipelines.calibrate.quantize_calibrated_lm`.
    Returns a QuantizeSummary (its `.text()` is printed at the end when progress is on).

    Raises:
      CheckpointError: unknown scheme, a non-dense SRC, an existing DST, no targeted weight, or targeted
        weights that do not fit the scheme (all of them named, with the ways out; see the module docstring).
    """
    if rotate is not None:
        import tempfile

        from converters.pipelines.rotate import rotate_checkpoint

        if transform is not None:
            raise CheckpointError("quantize_checkpoint: pass rotate or transform, not both")
        if Path(dst).exists() and not overwrite:  # before the rotation work
            raise CheckpointError(f"{dst}: expected a new path for the checkpoint, found it exists "
                                  f"(pass overwrite=True to replace it)")
        _as_scheme_set(scheme)
        with tempfile.TemporaryDirectory(prefix="qformats-rotated-") as tmp:
            rotated = Path(tmp) / "rotated"
            rec = rotate_checkpoint(src, rotated, rotate, seed=rotate_seed, rotations=rotations)
            try:
                summary = quantize_checkpoint(rotated, dst, scheme, ignore=ignore, targets=targets,
                                              max_shard_size=max_shard_size, overwrite=overwrite, progress=progress,
                                              fuse_global_scales=fuse_global_scales,
                                              skip_indivisible=skip_indivisible, transform=rec, kv_cache=kv_cache)
            except CheckpointError as e:
                raise CheckpointError(f"{src} rotated ({rotate}, {'+'.join(rec.rotations)}): "
                                      f"{str(e).replace(str(rotated), 'the rotated copy')}") from None
        summary.src = str(src)
        return summary
    t0 = time.monotonic()
    ss = _as_scheme_set(scheme)
    if ss.weights is None:
        raise CheckpointError(f"scheme {ss.name!r} quantizes no weights")
    if isinstance(kv_cache, str):
        try:
            kv_cache = parse_kv_cache(kv_cache)
        except QFormatsError as e:
            raise CheckpointError(str(e)) from None
    if kv_cache is not None and not kv_cache.dynamic:
        raise CheckpointError(f"KV-cache scheme {kv_cache_name(kv_cache)!r} has static k_scale / v_scale, which need "
                              f"calibration data (a data-free quantize has no keys or values to measure): calibrate "
                              f"(converters.pipelines.calibrate.quantize_calibrated_lm) or use the dynamic "
                              f"'fp8:dynamic'")
    for role, act in (("input", ss.input_activations), ("output", ss.output_activations)):
        if act is not None and act.dynamic is not True:
            raise CheckpointError(f"scheme {ss.name!r} has static {role} activation scales, which need calibration "
                                  f"data (a data-free quantize cannot write {role}_scale); use a weight-only or "
                                  f"dynamic-activation scheme such as FP8_DYNAMIC, W4A16, NVFP4A16, MXFP4A16")
    for t in targets:
        if not isinstance(t, str):
            raise CheckpointError(f"targets: expected strings, found {t!r}")
    src = Path(src)
    dst = Path(dst)
    parse_size(max_shard_size)
    stream = sys.stderr if progress is True else (progress or None)
    src_dir = src if src.is_dir() else src.parent
    cfg_path = src_dir / "config.json"
    base_cfg = read_json(cfg_path, src_dir) if os.path.lexists(cfg_path) else {}
    if not isinstance(base_cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object, found {type(base_cfg).__name__}")
    if base_cfg.get("quantization_config"):
        raise CheckpointError(f"{cfg_path}: expected a dense checkpoint, found a quantization_config "
                              f"(quant_method {base_cfg['quantization_config'].get('quant_method')!r})")
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst}: expected a new path for the checkpoint, found it exists "
                              f"(pass overwrite=True to replace it)")
    with open_checkpoint(src) as raw:
        ck = linearized_experts(raw, base_cfg)  # gpt-oss's fused experts as per-expert Linears
        infos = {n: ck.info(n) for n in ck.keys()}
        linear, kinds_from = model_linear_modules(base_cfg)
        routers = router_modules(infos)
        qplan = checkpoint_plan(infos, ss, list(targets), list(ignore), linear, routers)
        chosen = [d.path for d in qplan.quantized]
        ignored = [d.path for d in qplan.dense if d.selector is not None]
        unused_ignore = [s.entry for s in qplan.unused if s.role == "ignore"]
        unused_targets = [s.entry for s in qplan.unused if s.role == "target"]
        if base_cfg.get("tie_word_embeddings") and not any(n.rpartition(".")[0] == "lm_head" for n in infos):
            # A tied lm_head is a Linear module in torch with no tensor of its own here: compressed-tensors
            # would target it on load unless `ignore` names it, as llm-compressor writes it.
            tied = Matcher.from_targets(ss, ["lm_head"], list(ignore))
            if tied.match("lm_head")[1] is not None:
                raise CheckpointError(f"{src}: lm_head is tied to the embedding (tie_word_embeddings), so it has no "
                                      f"weight of its own to quantize; add 'lm_head' to ignore")
            ignored = ignored + ["lm_head"]
            covered = {s.entry for s in tied.selectors if s.role == "ignore"} - {s.entry for s in tied.unused()}
            unused_ignore = [p for p in unused_ignore if p not in covered]
        if routers:  # llm-compressor's MoE recipes ignore the routers ("re:.*mlp.gate$"), which no "Linear" targets
            by_router = Matcher.from_targets(ss, ["Router"], list(ignore))
            for r in routers:
                by_router.match(r, "Router")
            covered = ({s.entry for s in by_router.selectors if s.role == "ignore"}
                       - {s.entry for s in by_router.unused()})
            unused_ignore = [p for p in unused_ignore if p not in covered]
        for p in unused_ignore if tuple(ignore) != ("lm_head",) else ():  # the default may match nothing
            warnings.warn(f"{src}: ignore entry {p!r} matches no targeted module", stacklevel=2)
        for t in unused_targets:
            warnings.warn(f"{src}: target {t!r} matches no weight", stacklevel=2)
        if not chosen:
            raise CheckpointError(f"{src}: no weight matches targets {list(targets)} (minus ignore "
                                  f"{list(ignore)}); nothing to quantize")
        misfits = _misfits(ck, infos, chosen, ss)
        empty = [m for m, (_, _, why) in misfits.items() if why == "empty tensor"]
        if empty or (misfits and not skip_indivisible):
            bad = empty or list(misfits)
            fit = divisible_group_scheme([(misfits[m][0][-1], ss.weights, ss) for m in bad]) if not empty else None
            raise CheckpointError(
                f"{src}: {len(bad)} of the {len(chosen)} targeted weights do not fit scheme {ss.name!r} "
                f"({ss.weights.describe()}; GROUP / TENSOR_GROUP weights need columns % group_size == 0, as "
                f"llm-compressor 0.14 and compressed-tensors require).\n"
                + ("Ways out: skip_indivisible=True keeps exactly these dense and lists them in the summary; a group "
                   "size that divides their columns" + (f" (scheme={fit!r})" if fit else "") + "; or leave them "
                   "dense with ignore=[...]. The weights:\n" if not empty else
                   "Leave them out with ignore=[...]. The weights:\n")
                + "\n".join(_misfit_lines(misfits, bad)))
        skipped = sorted(misfits)
        qplan = qplan.leave_dense({m: "columns not a multiple of the group size; skip_indivisible=True" for m in misfits})
        chosen = [m for m in chosen if m not in misfits]
        if not chosen:
            raise CheckpointError(f"{src}: none of the targeted weights fits scheme {ss.name!r} ({len(skipped)} "
                                  f"skipped: {', '.join(skipped[:6])}{' ...' if len(skipped) > 6 else ''}); "
                                  f"nothing written")
        chosen_set = set(chosen)
        dense_routers = sorted(r for r in routers if r not in chosen_set)
        ignored = ignored + [r for r in dense_routers if r not in ignored]  # vLLM types routers "Linear"
        shared_g = _fused_global_scales(ck, infos, qplan, ss) if fuse_global_scales else {}
        src_bytes = sum(i.nbytes for i in infos.values())
        prog = _Progress(len(infos), src_bytes, stream)
        qdense = qstored = 0
        nq = 0
        plan = _plan(infos, chosen_set, ss)
        online = {} if transform is None else dict(transform.online)
        clash = sorted(set(online) & set(infos))
        if clash:
            raise CheckpointError(f"{src}: already holds transform tensors {clash[:4]}")
        plan += [TensorSpec(n, np.asarray(a).dtype, np.shape(a)) for n, a in sorted(online.items())]
        with CompressedWriter(dst, max_shard_size, overwrite=overwrite, plan=plan, sources=(src,)) as w:
            for name in sorted(infos):
                mod, _, local = name.rpartition(".")
                info = infos[name]
                if local == "weight" and mod in chosen_set:
                    q = quantize(ck.get(name), ss.weights, axis=-1, global_scale=shared_g.get(mod))
                    w.add_qarray(mod, q, ss)
                    qdense += info.nbytes
                    qstored += q.nbytes
                    nq += 1
                    del q
                else:
                    w.add_dense(name, ck.get(name))
                ck.drop_pages()
                prog.update(info.nbytes)
            for n, a in sorted(online.items()):  # online rotations (transform_config), float64 as compressed-tensors
                w.add_dense(n, a)
            prog.close()
            w.finish(base_cfg, ignore=sorted(ignored + skipped), targets=list(targets), copy_from=src_dir,
                     transform_config=None if transform is None else transform.transform_config,
                     kv_cache_scheme=kv_cache)
    dst_bytes = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    summary = QuantizeSummary(str(src), str(dst), ss.name, nq, len(infos) - nq, src_bytes, dst_bytes, qdense,
                              qstored, time.monotonic() - t0, skipped,
                              [d.path for d in qplan.quantized if d.candidate.how != "model"
                               and d.selector.role == "target" and d.selector.entry[:1].isupper()], kinds_from,
                              experts_text(chosen), dense_routers, ck is not raw)
    if stream is not None:
        stream.write(summary.text() + "\n")
        stream.flush()
    return summary

