"""compressed-tensors `quantization_config`: parse, validate, map to QuantSchemes, and serialize as 0.20 does.

A `quantization_config` (inside config.json) looks like

    {"config_groups": {"group_0": {"targets": ["Linear"], "weights": ARGS, "input_activations": ARGS | null,
                                   "output_activations": ARGS | null, "format": "pack-quantized"}},
     "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": null,
     "quant_method": "compressed-tensors", "quantization_status": "compressed", "version": "0.20.0",
     "global_compression_ratio": null, "moe_sparsity_config": null, "sparsity_config": {},
     "transform_config": {}}

with ARGS = QuantizationArgs: num_bits, type (int|float), symmetric, group_size, strategy, block_structure,
dynamic (true|false|"local"), actorder, scale_dtype / zp_dtype ("torch.uint8", ...), observer,
observer_kwargs. compressed-tensors 0.20 omits null actorder / block_structure / scale_dtype, an empty
observer_kwargs, and observer / zp_dtype unless set explicitly; json.dump(indent=2, sort_keys=True).

Mapping to qformats schemes (the inverse of `qformats.presets`):
  int N bits                      -> IntFormat(N), scale_format "input" (scale dtype = weight dtype)
  float 8 bits                    -> fp8_e4m3fn, scale "input"
  float 4, tensor_group, group 16 -> NVFP4: fp8_e4m3fn group scales under a float32 global scale
  float 4/6/8, group 32, scale_dtype torch.uint8 -> MX: fp4_e2m1 / fp6_e2m3 / fp8_e4m3fn, E8M0 scales, rule "ct"

Extension (qformats only; vLLM and compressed-tensors do not read it): `"format": "fpx-pack-quantized"` for
float element formats compressed-tensors lacks (FP6 E3M2, FP5 E2M2, FP4 E3M0, ...). Its weight args are
ordinary QuantizationArgs (`"type": "float"`, `num_bits`) plus `"exponent_bits"` and `"mantissa_bits"`
(and `"scale_dtype": "torch.uint8"` for E8M0 scales). Tensors: `weight_packed` uint8 `[N, ceil(K*bits/8)]`
(codes `sign|exponent|mantissa`, little-endian bit stream per row, as `qformats.packing.pack`),
`weight_scale` `[N, 1]` / `[N, K/g]` in the weight dtype (or uint8 E8M0), `weight_shape` int64 `[2]`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from qformats.matching import pattern_matches, target_list
from converters.formats.compressed_tensors.transforms import check_transform_config, parse_transform_config
from qformats.errors import CheckpointError, QFormatsError
from qformats.formats import FloatFormat, IntFormat, get_format
from qformats.kv_cache import KVCacheScheme
from qformats.schemes import QuantScheme, SchemeSet

__all__ = [
    "CT_VERSION",
    "FORMATS",
    "FPX_FORMAT",
    "ConfigGroup",
    "QuantConfig",
    "args_to_scheme",
    "format_for",
    "kv_cache_scheme_from_args",
    "kv_cache_scheme_to_args",
    "parse_quantization_config",
    "parse_version",
    "scheme_to_args",
    "serialize_quantization_config",
]

#: The version we write: our int32 packing is the dense layout compressed-tensors uses since 0.18.
CT_VERSION = "0.20.0"
FPX_FORMAT = "fpx-pack-quantized"
FORMATS = ("dense", "naive-quantized", "int-quantized", "float-quantized", "pack-quantized",
           "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp6-pack-quantized", "mxfp8-quantized",
           "mixed-precision", FPX_FORMAT)
STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group", "attn_head")
_ARG_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
             "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs",
             "exponent_bits", "mantissa_bits"}
_TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float8_e4m3fn": "fp8_e4m3fn", "torch.uint8": "e8m0", "torch.float8_e8m0fnu": "e8m0"}


def parse_version(text: Any) -> Optional[Tuple[int, ...]]:
    """'0.20.0' / '0.12.3.a20250101' -> (0, 20, 0) / (0, 12, 3); None when absent or unparsable."""
    if not isinstance(text, str):
        return None
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


# ---- args <-> schemes ---------------------------------------------------------------------------------------
def _err(where: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{where}: {msg}")


def _check_args(args: Any, where: str) -> Dict[str, Any]:
    if not isinstance(args, dict):
        raise _err(where, f"expected QuantizationArgs (an object), found {type(args).__name__}")
    unknown = sorted(set(args) - _ARG_KEYS)
    if unknown:
        raise _err(where, f"unknown QuantizationArgs keys {unknown}; expected a subset of {sorted(_ARG_KEYS)}")
    a = dict(args)
    nb = a.get("num_bits", 8)
    if isinstance(nb, bool) or not isinstance(nb, int) or not 1 <= nb <= 8:
        raise _err(where, f"expected num_bits an int in 1..8, found {nb!r}")
    typ = a.get("type", "int")
    if not isinstance(typ, str) or typ.lower() not in ("int", "float"):
        raise _err(where, f"expected type 'int' or 'float', found {typ!r}")
    a["type"], a["num_bits"] = typ.lower(), nb
    sym = a.get("symmetric", True)
    if not isinstance(sym, bool):
        raise _err(where, f"expected symmetric a bool, found {sym!r}")
    a["symmetric"] = sym
    gs = a.get("group_size")
    if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs < -1 or gs == 0):
        raise _err(where, f"expected group_size null, -1 or a positive int, found {gs!r}")
    st = a.get("strategy")
    if st is None:  # compressed-tensors' inference
        st = "tensor" if gs is None else ("group" if gs > 0 else "channel")
    if not isinstance(st, str) or st.lower() not in STRATEGIES:
        raise _err(where, f"unknown strategy {st!r}; expected one of {STRATEGIES}")
    a["strategy"] = st = st.lower()
    if st in ("group", "tensor_group") and not (isinstance(gs, int) and gs > 0):
        raise _err(where, f"strategy {st!r} needs a positive group_size, found {gs!r}")
    bs = a.get("block_structure")
    if isinstance(bs, str):  # legacy "128x128"
        try:
            bs = [int(v) for v in bs.split("x")]
        except ValueError:
            raise _err(where, f"expected block_structure [rows, cols], found {bs!r}") from None
    if bs is not None and not (isinstance(bs, list) and len(bs) == 2
                               and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bs)):
        raise _err(where, f"expected block_structure [rows, cols] of positive ints, found {bs!r}")
    if (st == "block") != (bs is not None):
        raise _err(where, f"strategy {st!r} with block_structure {bs!r}: a block structure goes with 'block' only")
    a["block_structure"] = bs
    dyn = a.get("dynamic", False)
    if isinstance(dyn, str):
        dyn = dyn.lower()
    if dyn not in (True, False, "local"):
        raise _err(where, f"expected dynamic true, false or 'local', found {dyn!r}")
    a["dynamic"] = dyn
    for key in ("scale_dtype", "zp_dtype"):
        v = a.get(key)
        if v is not None and not isinstance(v, str):
            raise _err(where, f"expected {key} a string like 'torch.uint8' or null, found {v!r}")
    return a


def args_to_scheme(args: Mapping[str, Any], where: str = "quantization_config", fpx: bool = False) -> QuantScheme:
    """QuantizationArgs (a dict as in config.json) -> QuantScheme; CheckpointError for what we cannot represent.

    `fpx`: the args come from an `fpx-pack-quantized` group and carry exponent_bits / mantissa_bits.
    """
    a = _check_args(args, where)
    nb, st, gs = a["num_bits"], a["strategy"], a.get("group_size")
    sd = a.get("scale_dtype")
    if sd is not None and sd not in _TORCH_DTYPES:
        raise _err(where, f"unsupported scale_dtype {sd!r}; expected one of {sorted(_TORCH_DTYPES)}")
    scale_format = _TORCH_DTYPES[sd] if sd is not None else "input"
    if st == "attn_head":
        raise _err(where, "strategy 'attn_head' (attention/KV-cache quantization) is not supported for weights")
    kw: Dict[str, Any] = {}
    if st in ("group", "tensor_group"):
        kw["group_size"] = gs
    if st == "block":
        kw["block"] = tuple(a["block_structure"])
    try:
        if a["type"] == "int":
            if scale_format == "e8m0":
                raise _err(where, "integer weights with E8M0 (torch.uint8) scales are not supported")
            return QuantScheme(IntFormat(nb, signed=True), st, symmetric=a["symmetric"],
                               scale_format=scale_format, dynamic=a["dynamic"], **kw)
        if fpx or "exponent_bits" in a or "mantissa_bits" in a:
            e, m = a.get("exponent_bits"), a.get("mantissa_bits")
            if not (isinstance(e, int) and isinstance(m, int)) or 1 + e + m != nb:
                raise _err(where, f"{FPX_FORMAT} args need exponent_bits and mantissa_bits with 1 + e + m = "
                                  f"num_bits ({nb}), found {e!r}, {m!r}")
            fmt = get_format(f"fp{nb}_e{e}m{m}" + ("fn" if nb == 8 and (e, m) == (4, 3) else ""))
        elif nb == 8:
            fmt = get_format("fp8_e4m3fn")
        elif nb == 4:
            fmt = get_format("fp4_e2m1")
        elif nb == 6:
            fmt = get_format("fp6_e2m3")
        else:
            raise _err(where, f"float weights of {nb} bits need the {FPX_FORMAT} extension "
                              f"(exponent_bits, mantissa_bits)")
        if scale_format == "e8m0":
            return QuantScheme(fmt, st, scale_format="e8m0", scale_rule="ct", dynamic=a["dynamic"], **kw)
        if st == "tensor_group":
            return QuantScheme(fmt, st, scale_format="fp8_e4m3fn", dynamic=a["dynamic"], **kw)
        return QuantScheme(fmt, st, symmetric=a["symmetric"], scale_format=scale_format,
                           dynamic=a["dynamic"], **kw)
    except CheckpointError:
        raise
    except QFormatsError as e:
        raise _err(where, f"QuantizationArgs {json.dumps(args, sort_keys=True, default=str)[:200]} do not form "
                          f"a valid scheme: {e}") from None


_SCALE_DTYPE_STR = {"fp8_e4m3fn": "torch.float8_e4m3fn", "e8m0": "torch.uint8", "float32": "torch.float32",
                    "bfloat16": "torch.bfloat16", "float16": "torch.float16"}


def is_ct_native(s: QuantScheme) -> bool:
    """True when compressed-tensors has a format for this weight scheme (else: the fpx extension)."""
    f = s.format
    if isinstance(f, IntFormat):
        return f.signed and s.scale_format != "e8m0"
    if s.scale_format == "e8m0":
        return s.strategy == "group" and s.group_size == 32 and s.scale_rule == "ct" and \
            f.name in ("fp4_e2m1", "fp6_e2m3", "fp8_e4m3fn")
    if s.strategy == "tensor_group":
        return f.name == "fp4_e2m1" and s.group_size == 16
    return f.name == "fp8_e4m3fn" and s.scale_format == "input"


def scheme_to_args(s: QuantScheme, role: str = "weights") -> Dict[str, Any]:
    """QuantScheme -> QuantizationArgs dict, exactly as compressed-tensors 0.20 serializes the equivalent args.

    `role`: "weights" or "input_activations" (static input activations carry compressed-tensors'
    `observer: "static_minmax"` as its FP8 / NVFP4 presets do).
    """
    f = s.format
    d: Dict[str, Any] = {
        "dynamic": s.dynamic,
        "group_size": s.group_size if s.strategy in ("group", "tensor_group") else None,
        "num_bits": f.bits,
        "strategy": s.strategy,
        "symmetric": s.symmetric,
        "type": "int" if isinstance(f, IntFormat) else "float",
    }
    if s.strategy == "block":
        d["block_structure"] = list(s.block)
    if s.scale_format != "input":
        d["scale_dtype"] = _SCALE_DTYPE_STR[s.scale_format]
    if role == "input_activations" and s.dynamic is not True:
        d["observer"] = "static_minmax"
    if isinstance(f, FloatFormat) and not is_ct_native(s):
        d["exponent_bits"], d["mantissa_bits"] = f.ebits, f.mbits
    return d


def format_for(weights: Optional[QuantScheme], input_activations: Optional[QuantScheme] = None) -> str:
    """The compression format compressed-tensors infers for a Linear with these schemes (its priority order)."""
    if weights is None:
        return "dense"
    f = weights.format
    if not is_ct_native(weights):
        return FPX_FORMAT
    if weights.scale_format == "e8m0":
        return {"fp4_e2m1": "mxfp4-pack-quantized", "fp6_e2m3": "mxfp6-pack-quantized",
                "fp8_e4m3fn": "mxfp8-quantized"}[f.name]
    if weights.strategy == "tensor_group":
        return "nvfp4-pack-quantized"
    if isinstance(f, IntFormat):
        return "int-quantized" if input_activations is not None else "pack-quantized"
    return "float-quantized" if input_activations is not None else "naive-quantized"


# ---- kv_cache_scheme ----------------------------------------------------------------------------------------
def kv_cache_scheme_from_args(args: Any, where: str = "quantization_config: kv_cache_scheme") -> KVCacheScheme:
    """`kv_cache_scheme` QuantizationArgs -> KVCacheScheme (`qformats.kv_cache`). Supported: what vLLM serves,
    FP8 e4m3 (`type: float`, `num_bits: 8`), symmetric, strategy "tensor" (static or dynamic) or "attn_head"
    (static), no group size, block or scale dtype. Anything else is a CheckpointError naming the field."""
    a = _check_args(args, where)
    if a["type"] != "float" or a["num_bits"] != 8:
        raise _err(where, f"only FP8 (type 'float', num_bits 8) KV caches are supported, found type {a['type']!r} "
                          f"num_bits {a['num_bits']}")
    if not a["symmetric"]:
        raise _err(where, "asymmetric KV-cache quantization is not supported (expected symmetric: true)")
    if a["strategy"] not in ("tensor", "attn_head"):
        raise _err(where, f"KV-cache strategy {a['strategy']!r} is not supported; expected 'tensor' or 'attn_head'")
    for key in ("group_size", "scale_dtype", "zp_dtype", "actorder"):
        if a.get(key) is not None:
            raise _err(where, f"{key} {a[key]!r} is not supported for a KV cache (expected null)")
    if a["dynamic"] not in (True, False):
        raise _err(where, f"dynamic {a['dynamic']!r} is not supported for a KV cache (expected true or false)")
    try:
        return KVCacheScheme(a["strategy"], bool(a["dynamic"]))
    except QFormatsError as e:
        raise _err(where, str(e)) from None


def kv_cache_scheme_to_args(s: KVCacheScheme) -> Dict[str, Any]:
    """KVCacheScheme -> the `kv_cache_scheme` dict compressed-tensors 0.20 serializes for the same args."""
    return {"dynamic": s.dynamic, "group_size": None, "num_bits": 8, "strategy": s.strategy, "symmetric": True,
            "type": "float"}


# ---- the whole config ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ConfigGroup:
    """One config group: targets, the format its modules are stored in, and the schemes of its args."""

    name: str
    targets: Tuple[str, ...]
    format: str
    weights: Optional[QuantScheme]
    input_activations: Optional[QuantScheme]
    output_activations: Optional[QuantScheme]
    raw: Dict[str, Any]

    @property
    def scheme_set(self) -> SchemeSet:
        return SchemeSet(self.name, self.weights, self.input_activations, self.output_activations)

    def matches(self, module: str) -> bool:
        """A `re:` target matches with re.match (compressed-tensors' rule); a plain target is a class name
        (which a checkpoint cannot tell: it matches any module) or an exact module name."""
        for t in self.targets:
            if t.startswith("re:"):
                if _re_match(t[3:], module):
                    return True
            elif t == module or not ("." in t or t.islower()):
                return True
        return False

    def matches_by_name(self, module: str) -> bool:
        return any((t.startswith("re:") and _re_match(t[3:], module)) or t == module for t in self.targets)


def _re_match(pattern: str, name: str) -> bool:
    # Patterns were compiled (and refused if unmatchable in bounded time) when the config was parsed.
    return pattern_matches(pattern, name, "quantization_config")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """A parsed `quantization_config`."""

    format: str
    groups: Tuple[ConfigGroup, ...]
    ignore: Tuple[str, ...]
    version: Optional[Tuple[int, ...]]
    kv_cache_scheme: Optional[Dict[str, Any]]
    quantization_status: Optional[str]
    raw: Dict[str, Any]

    @property
    def kv_cache(self) -> Optional[KVCacheScheme]:
        """The parsed kv_cache_scheme (validated when the config was parsed), or None."""
        return None if self.kv_cache_scheme is None else kv_cache_scheme_from_args(self.kv_cache_scheme)

    @property
    def dense_packing(self) -> Optional[bool]:
        """pack-quantized int32 layout: True (dense) from 0.18 on, False before, None when no version is
        recorded (the reader then tells the layout from the word count, dense on a tie)."""
        return None if self.version is None else self.version >= (0, 18)

    def is_ignored(self, module: str) -> bool:
        for t in self.ignore:
            if t.startswith("re:"):
                if _re_match(t[3:], module):
                    return True
            elif t == module:
                return True
        return False


def parse_quantization_config(qc: Any, where: str = "config.json") -> QuantConfig:
    """Validate and parse a `quantization_config` object; CheckpointError naming `where` and the key."""
    at = f"{where}: quantization_config"
    if not isinstance(qc, dict):
        raise _err(at, f"expected an object, found {type(qc).__name__}")
    qm = qc.get("quant_method", "compressed-tensors")
    if qm not in ("compressed-tensors", "sparseml"):
        raise _err(at, f"expected quant_method 'compressed-tensors', found {qm!r}")
    # offline rotations are already fused into the stored weights; online ones only where they are applied
    check_transform_config(qc.get("transform_config"), f"{at}: transform_config")
    sc = qc.get("sparsity_config")
    if sc not in (None, {}) and not (isinstance(sc, dict) and sc.get("format") in (None, "dense")):
        raise _err(at, f"sparsity_config: sparse checkpoints are not supported, found {json.dumps(sc)[:120]}")
    fmt = qc.get("format", "dense")
    if fmt is None:
        fmt = "dense"
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise _err(at, f"unknown format {fmt!r}; expected one of {FORMATS}")
    cg = qc.get("config_groups", {})
    if cg is None:
        cg = {}
    if not isinstance(cg, dict):
        raise _err(at, f"config_groups: expected an object, found {type(cg).__name__}")
    groups: List[ConfigGroup] = []
    for gname, g in cg.items():
        gat = f"{at}: config_groups.{gname}"
        if not isinstance(g, dict):
            raise _err(gat, f"expected a QuantizationScheme object, found {type(g).__name__}")
        targets = target_list(g.get("targets"), f"{gat}: targets")
        gfmt = g.get("format") or (fmt if fmt != "mixed-precision" else None)
        if gfmt is None:
            raise _err(gat, "expected a per-group format in a mixed-precision config, found none")
        if not isinstance(gfmt, str) or gfmt not in FORMATS or gfmt == "mixed-precision":
            raise _err(gat, f"unknown format {gfmt!r}; expected one of {FORMATS[:-2] + (FPX_FORMAT,)}")
        schemes = {}
        for role in ("weights", "input_activations", "output_activations"):
            args = g.get(role)
            if args is None:
                schemes[role] = None
                continue
            if role == "weights":
                schemes[role] = args_to_scheme(args, f"{gat}.{role}", fpx=gfmt == FPX_FORMAT)
            else:
                a = _check_args(args, f"{gat}.{role}")
                try:
                    schemes[role] = args_to_scheme(a, f"{gat}.{role}")
                except CheckpointError:
                    schemes[role] = None  # activations we cannot express are kept raw (g.raw)
        groups.append(ConfigGroup(gname, tuple(targets), gfmt, schemes["weights"], schemes["input_activations"],
                                  schemes["output_activations"], dict(g)))
    ignore = target_list(qc.get("ignore") or [], f"{at}: ignore", single=False)
    kv = qc.get("kv_cache_scheme")
    if kv is not None:
        kv_cache_scheme_from_args(kv, f"{at}: kv_cache_scheme")
    status = qc.get("quantization_status")
    if status is not None and not isinstance(status, str):
        raise _err(at, f"quantization_status: expected a string, found {status!r}")
    return QuantConfig(fmt, tuple(groups), tuple(ignore), parse_version(qc.get("version")), kv, status, dict(qc))


def serialize_quantization_config(groups: List[Tuple[List[str], SchemeSet]], ignore: List[str],
                                  version: str = CT_VERSION, kv_cache: Optional[KVCacheScheme] = None,
                                  transform_config: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The `quantization_config` compressed-tensors 0.20 writes for these (targets, SchemeSet) groups
    (and `kv_cache`, the KV-cache scheme, as its kv_cache_scheme; `transform_config`, the rotations'
    TransformConfig in JSON form (`converters.pipelines.rotate`), checked by `parse_transform_config`).

    Group names are group_0, group_1, ... in order; the global format is the groups' common format or
    "mixed-precision"; status "compressed". Write it with json.dump(indent=2, sort_keys=True).
    """
    cg: Dict[str, Any] = {}
    formats = []
    for i, (targets, ss) in enumerate(groups):
        fmt = format_for(ss.weights, ss.input_activations)
        formats.append(fmt)
        cg[f"group_{i}"] = {
            "format": fmt,
            "input_activations": scheme_to_args(ss.input_activations, "input_activations")
            if ss.input_activations is not None else None,
            "output_activations": scheme_to_args(ss.output_activations, "output_activations")
            if ss.output_activations is not None else None,
            "targets": list(targets),
            "weights": scheme_to_args(ss.weights) if ss.weights is not None else None,
        }
    uniq = sorted(set(f for f in formats if f != "dense"))
    gfmt = "dense" if not uniq else (uniq[0] if len(uniq) == 1 else "mixed-precision")
    return {
        "config_groups": cg,
        "format": gfmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None if kv_cache is None else kv_cache_scheme_to_args(kv_cache),
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {} if not transform_config else _checked_transform_config(transform_config),
        "version": version,
    }


def _checked_transform_config(tc: Dict[str, Any]) -> Dict[str, Any]:
    parse_transform_config(tc, "transform_config to write")
    return dict(tc)
