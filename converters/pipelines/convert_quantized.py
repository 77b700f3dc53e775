"""A quantized checkpoint of another format (HF FP8, gpt-oss MXFP4, ModelOpt NVFP4, AutoGPTQ, AutoAWQ:
`converters.formats.quantized`; a GGUF file's block types: `convert_gguf_compressed`) written as the compressed-tensors
checkpoint that holds the same values, without a detour through float."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Dict, List, Mapping, Set, Tuple

from qformats.errors import CheckpointError

__all__ = ["GGUFConversion", "GGUF_OFFSET_TYPES", "convert_gguf_compressed", "convert_quantized", "gguf_ct_qarray"]


def convert_quantized(src: "str | os.PathLike", dst: "str | os.PathLike", *, max_shard_size: "int | str" = "5GB",
                      overwrite: bool = False) -> Path:
    """Read `src` with its format's reader (`converters.formats.quantized.read_quantized`: codes and scales as
    stored, in QArrays of the equivalent compressed-tensors schemes) and write them with the compressed-tensors
    writer: each quantized module under its config group's scheme, every other tensor as is, the other files
    copied, config.json with the compressed-tensors quantization_config in place of the source's. Returns `dst`.

    Raises:
      CheckpointError: `src` is dense or already compressed-tensors, its quant_method has no reader, or the
        reader refuses something it cannot hold exactly (naming the tensor)."""
    from converters.formats.compressed_tensors.write import write_compressed
    from converters.formats.quantized import quant_method, read_quantized
    from converters.formats.safe_files import read_json

    src = Path(src)
    cfg_path = (src if src.is_dir() else src.parent) / "config.json"
    method = quant_method(read_json(cfg_path)) if os.path.lexists(cfg_path) else "dense"
    if method in ("dense", "compressed-tensors", "sparseml"):
        raise CheckpointError(f"{cfg_path}: expected a quantized checkpoint of another format to convert "
                              f"(quant_method fp8, mxfp4, modelopt, gptq, awq), found {method}")
    if method == "mxfp4":  # bytes copied, never decoded: subnormal groups are held exactly too
        from converters.formats.hf_mxfp4 import read_hf_mxfp4

        cm = read_hf_mxfp4(src, computed=False)
    else:
        cm = read_quantized(src)
    tensors = {f"{m}.{local}" if m else local: a for m, t in cm.modules.items() for local, a in t.items()}
    by_name = {g.name: g for g in cm.quant.groups}
    schemes = {m: by_name[name].scheme_set for m, name in cm.groups.items()}  # targets may be regexes
    config = {k: v for k, v in cm.config.items() if k != "quantization_config"}
    return write_compressed(dst, tensors, schemes, ignore=list(cm.quant.ignore), config=config,
                            copy_from=src if src.is_dir() else src.parent, max_shard_size=max_shard_size,
                            overwrite=overwrite)


# ---- GGUF -> compressed-tensors -------------------------------------------------------------------------------------
@dataclasses.dataclass
class GGUFConversion:
    """What `convert_gguf_compressed` wrote: `path`, and GGML type -> HF tensor names for the Linear weights kept
    quantized (`quantized`, with the compressed-tensors format of each type in `formats`), the Linear weights
    written dense because compressed-tensors cannot hold their type (`dequantized`, only with dequantize=True), and
    the other tensors written dense (`dense`: embeddings, norms, biases, float-stored weights)."""

    path: Path
    quantized: Dict[str, List[str]]
    formats: Dict[str, str]
    dequantized: Dict[str, List[str]]
    dense: Dict[str, List[str]]
    num_bits: Dict[str, int] = dataclasses.field(default_factory=dict)
    widened: Dict[str, int] = dataclasses.field(default_factory=dict)  # GGML type -> its bits, written as num_bits 8

    def summary(self) -> List[str]:
        """One line per GGML type and outcome, for people (the CLI prints these)."""
        lines = []
        for t, n in self.quantized.items():
            fmt, bits = self.formats[t], self.num_bits.get(t)
            note = ""
            if fmt == "pack-quantized" and bits not in VLLM_WNA16_BITS:
                note = (f" (num_bits {bits}: transformers + compressed-tensors load it; vLLM's compressed-tensors "
                        f"WNA16 scheme takes num_bits {' and '.join(map(str, VLLM_WNA16_BITS))} only; --widen "
                        f"writes num_bits 8)")
            elif t in self.widened:
                note = (f" (its {self.widened[t]}-bit integers widened to num_bits 8 for vLLM's WNA16: the same "
                        f"values, 8 bits per weight)")
            lines.append(f"{t}: {len(n)} Linear weight(s) kept quantized as {fmt}{note}")
        if not self.quantized:
            lines.append("no Linear weight kept quantized: the checkpoint is dense (no quantization_config)")
        lines += [f"{t}: {len(n)} Linear weight(s) written dense (float32, gguf's dequantization; "
                  f"compressed-tensors cannot hold {t} exactly)" for t, n in self.dequantized.items()]
        lines += [f"{t}: {len(n)} other tensor(s) written dense (float32)" for t, n in self.dense.items()]
        return lines


#: num_bits of the pack-quantized weights vLLM's compressed-tensors WNA16 scheme serves (its WNA16_SUPPORTED_BITS).
VLLM_WNA16_BITS = (4, 8)

#: GGML types whose float offset (w = d q + m) compressed-tensors' integer zero point cannot hold.
GGUF_OFFSET_TYPES = ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")


def gguf_ct_qarray(q, widen: bool = False):
    """The compressed-tensors form of a GGUF QArray without an offset (`converters.formats.gguf_packed.gguf_qarray`),
    the same codes and scales under the scheme compressed-tensors 0.20 names:

      integer types (Q8_0, Q4_0, Q5_0, Q6_K, Q3_K): `pack-quantized`, type int, num_bits b,
        symmetric, strategy group (32, or 16 for Q6_K / Q3_K), scale_dtype torch.float32. The codes are the
        file's u = q + 2^(b-1) packed densely little-endian, which is compressed-tensors' own packing
        (`pack_to_int32` of q + 2^(b-1)); its decompression computes (q) * s in the scale's dtype, float32, where
        every product is exact (`gguf_packed`'s module docstring), so w = q s equals gguf's dequantization bit
        for bit. (float16 scales would hold Q4_0 / Q8_0's d exactly but round d (q - 8) in float16.)
      MXFP4: `mxfp4-pack-quantized`, E2M1 codes and the E8M0 exponent codes as stored: w = v 2^(e - 127).
      IQ4_NL / IQ4_XS (the 16-entry table format `qformats.formats.IQ4_NL`, whose values are integers in
        [-127, 113]): `pack-quantized` int8, the table's values q = kvalues[c] as int8 codes (8 bits per weight),
        the same scales: q s is the same product, so the same values bit for bit.

    `widen`: an integer type of b bits outside `VLLM_WNA16_BITS` (Q3_K, Q5_0, Q6_K) is written with num_bits 8: the
    same integers q (|q| <= 2^(b-1) <= 32, inside int8) as int8 codes, the same scales, so compressed-tensors'
    decompression q s gives the same values bit for bit (the products are the same real numbers, exact in float32),
    at 8 bits per weight in place of b.

    Returns None for a QArray with an offset (GGUF_OFFSET_TYPES): compressed-tensors cannot hold it."""
    import jax.numpy as jnp

    from qformats.formats import IntFormat, TableFormat
    from qformats.qarray import QArray
    from qformats.schemes import QuantScheme

    if q.offset is not None:
        return None
    s = q.scheme
    if s.format.name == "fp4_e2m1":
        scheme = QuantScheme("fp4_e2m1", "group", group_size=32, scale_format="e8m0", scale_rule="ct")
    else:
        table = isinstance(s.format, TableFormat)  # compressed-tensors has no table: its int8 values
        bits = 8 if table or (widen and s.bits not in VLLM_WNA16_BITS) else s.bits
        scheme = QuantScheme(IntFormat(bits, signed=True), "group", group_size=s.group_size, symmetric=True,
                             scale_format="float32")
    codes = q.codes
    if scheme.bits != s.bits or scheme.format != s.format:  # the element values q, re-stored as int8 codes (8-bit signed ints are stored as is)
        codes = q.element_values(jnp.float32).astype(jnp.int8)
    scale = q.scale if scheme.scale_format == "e8m0" else q.scale.astype("float32")  # float16 d: exact in float32
    return QArray(codes, scale, None, None, scheme=scheme, shape=q.shape, dtype=q.dtype, axis=q.axis)


def _gguf_plan(g) -> Tuple[Dict[str, str], Set[str]]:
    """(HF name -> GGML type, the names that are Linear weights) of an open GGUF model."""
    from qformats.models import decoder

    cfg = decoder.DecoderConfig.from_hf(g.config)
    linear = {n for n, slot in decoder.hf_tensor_names(cfg).items() if slot.transpose}
    return {n: g.tensor_type(n) for n in g.keys()}, linear


def _grouped(names_by_type: Mapping[str, List[str]], shown: int = 4) -> str:
    return "; ".join(f"{t} ({len(n)}): {', '.join(n[:shown])}" + (" ..." if len(n) > shown else "")
                     for t, n in names_by_type.items())


def convert_gguf_compressed(src: "str | os.PathLike", dst: "str | os.PathLike", *, dequantize: bool = False,
                            tokenizer: bool = True, max_shard_size: "int | str" = "5GB",
                            overwrite: bool = False, progress: bool = False, widen: bool = False) -> GGUFConversion:
    """Write a GGUF causal LM (`converters.formats.gguf_convert.open_gguf`: llama / mistral / qwen2 / qwen3) as a
    compressed-tensors checkpoint at `dst` that holds the file's values exactly, as transformers + compressed-tensors
    load it (`AutoModelForCausalLM.from_pretrained`; `CompressedTensorsConfig(run_compressed=False)` decompresses).

    Each Linear weight (q/k/v/o, gate/up/down, an untied lm_head) in a block type without a float offset keeps the
    file's codes and scales (`gguf_ct_qarray`: Q8_0 / Q4_0 / Q5_0 / Q6_K / Q3_K / IQ4_NL / IQ4_XS ->
    pack-quantized int groups with float32 scales, MXFP4 -> mxfp4-pack-quantized; llama's Q/K rows un-permuted as
    transformers expects), so its decompressed weight equals `gguf.quants.dequantize` bit for bit. Every other
    tensor (embedding, norms, biases, float-stored weights) is written dense as float32 (`GGUFModel.get`, exact).
    Config groups: one scheme targets "Linear", with the Linear modules written dense and a tied lm_head in
    `quantization_config.ignore`; several schemes (a file mixing types) give one group per scheme targeting its
    modules by name (`re:^module$`), format "mixed-precision". transformers loads both with its default compressed
    path (each module decompressed under its own group's scheme); its `CompressedTensorsConfig(dequantize=True)`
    path (transformers 5.24, `get_dense_scheme`) applies the first group's scheme to every dense module, so it
    loads the one-scheme checkpoints only. pack-quantized num_bits other than 4 and 8 (Q5_0, Q6_K, Q3_K) load in
    transformers + compressed-tensors but not in vLLM's WNA16 scheme (`VLLM_WNA16_BITS`; the summary says so); with
    `widen` they are written with num_bits 8 instead (`gguf_ct_qarray(widen=True)`: the same values bit for bit,
    8 bits per weight; vLLM's Marlin kernels also want groups of 32 / 64 / 128, which Q6_K / Q3_K's 16 are not).
    Other files: config.json (`GGUFModel.config` + quantization_config),
    generation_config.json, the tokenizer files (with `tokenizer`). Atomic (a temp directory renamed into place).

    A Linear weight whose type compressed-tensors cannot hold (`GGUF_OFFSET_TYPES`, w = d q + m, since its zero
    point is an integer in code units; or a type not packed exactly, such as the IQ1/IQ2/IQ3 grids) is refused
    before anything is written, the tensors named and grouped by type; with `dequantize` those weights are written
    dense instead (float32, gguf's dequantization) and the others stay quantized. Returns a `GGUFConversion`
    (`.summary()` says which tensors went which way).

    Raises:
      CheckpointError: an unreadable / unsupported GGUF file, a type compressed-tensors cannot hold without
        `dequantize`, or a destination that exists (without `overwrite`) or lies inside the source.
    """
    import json
    import sys
    import tempfile

    from converters.formats.compressed_tensors.write import CompressedWriter
    from converters.formats.gguf_convert import open_gguf
    from converters.formats.gguf_packed import DENSE_TYPES, PACKED_TYPES

    g = open_gguf(src)
    types, linear = _gguf_plan(g)
    quantized: Dict[str, List[str]] = {}
    refused: Dict[str, List[str]] = {}
    dense: Dict[str, List[str]] = {}
    for n, t in types.items():
        if n in linear and t not in DENSE_TYPES:
            kept = t in PACKED_TYPES and t not in GGUF_OFFSET_TYPES
            (quantized if kept else refused).setdefault(t, []).append(n)
        else:
            dense.setdefault(t, []).append(n)
    if refused and not dequantize:
        raise CheckpointError(
            f"{src}: pass --dequantize (dequantize=True) to write these Linear weights dense (float32, gguf's "
            f"dequantization) and keep the others quantized, or convert with --dense: compressed-tensors cannot hold "
            f"their values exactly (" + ", ".join(sorted(refused)) + ": "
            + ("a float offset w = d q + m, which its integer zero point cannot store"
               if set(refused) <= set(GGUF_OFFSET_TYPES) else "types with a float offset or a non-linear grid")
            + f"): {_grouped(refused)}")
    formats: Dict[str, str] = {}
    bits: Dict[str, int] = {}
    widened: Dict[str, int] = {}
    kept = {n for v in quantized.values() for n in v}
    # every Linear module left dense, and lm_head when it is tied (no tensor of its own) or dense: the config
    # groups target their modules by name, and ignore tells transformers which Linear modules hold plain weights
    ignore = sorted({n[: -len(".weight")] for n in linear if n in types and n not in kept}
                    | ({"lm_head"} if "lm_head.weight" not in kept else set()))
    src_p = Path(src)
    files = g.tokenizer_files() if tokenizer else {}
    with tempfile.TemporaryDirectory(prefix="qformats-gguf-") as extra:
        (Path(extra) / "generation_config.json").write_text(json.dumps(g.generation_config(), indent=2))
        for filename, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False)
            (Path(extra) / filename).write_text(text, encoding="utf-8")
        with CompressedWriter(dst, max_shard_size, overwrite=overwrite, sources=(src_p,)) as w:
            names = list(types)
            for i, n in enumerate(names):
                t = types[n]
                if n in kept:
                    pq = g.get_packed(n)
                    ct = gguf_ct_qarray(pq, widen=widen)
                    if ct.scheme.bits != pq.scheme.bits and pq.scheme.format.kind == "int":  # not a table's
                        widened[t] = pq.scheme.bits
                    formats[t] = w.add_qarray(n[: -len(".weight")], ct)
                    bits[t] = ct.scheme.bits
                else:
                    w.add_dense(n, g.get(n))
                if progress:
                    print(f"\r  {i + 1}/{len(names)} tensors", end="", file=sys.stderr, flush=True)
            if progress:
                print(file=sys.stderr)
            config = {k: v for k, v in g.config.items() if k != "quantization_config"}
            w.finish(config, ignore=ignore, copy_from=extra)
    dequantized = refused if dequantize else {}
    return GGUFConversion(Path(dst), quantized, formats, dequantized, dense, bits, widened)
