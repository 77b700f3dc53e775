"""QuantScheme: element format + granularity + scale format and rule, a frozen, hashable description."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from qformats.errors import SchemeError
from qformats.formats import E8M0Format, FloatFormat, Format, IntFormat, get_format

STRATEGIES = ("tensor", "channel", "group", "block", "token", "tensor_group")
SCALE_FORMATS = ("input", "float32", "bfloat16", "float16", "fp8_e4m3fn", "e8m0")
SCALE_RULES = ("absmax", "floor", "rceil", "ceil", "even", "ct", "torchao")
POW2_RULES = ("floor", "rceil", "ceil", "even", "ct")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How to quantize one tensor.

    Args:
      format: element format (a Format or a name such as "fp8_e4m3fn", "fp6_e3m2", "int4").
      strategy: "tensor" (one scale), "channel" (one per row of the contraction axis, i.e. per output
        channel), "group" (one per `group_size` consecutive elements along the contraction axis), "block"
        (one per `block` = (rows, cols) tile of a 2-D tensor laid out [out, in]), "token" (one per row of
        an activation, same layout as channel), "tensor_group" (NVFP4: groups with fp8 scales under one
        fp32 global scale).
      group_size: elements per group for "group"/"tensor_group".
      block: (rows, cols) for "block".
      symmetric: symmetric (no zero point) or asymmetric (integer formats only).
      scale_format: storage of scales: "input" (the input's dtype: compressed-tensors' rule), "float32",
        "bfloat16", "float16", "fp8_e4m3fn", "e8m0" (power-of-two MX scales).
      scale_rule: "absmax": s = amax / ((qmax - qmin) / 2) (= amax / max for floats, amax / 127.5 for
        int8, as compressed-tensors computes it); for e8m0 scales the power-of-two rule: "floor" (OCP:
        2^(floor(log2 amax) - emax_elem)), "rceil" (NVIDIA: 2^ceil(log2(amax / max_elem))), "ceil"
        (2^(ceil(log2 amax) - emax_elem)), "even" (round amax's mantissa to the element's precision,
        then floor), "ct" (compressed-tensors' MX rule: round amax to a power of two at the element's
        mantissa threshold, then 127 + floor(log2) - floor(log2 max_elem)); for "tensor_group" also
        "torchao" (torchao's `nvfp4_quantize` arithmetic, all in float32: s = fp8(clamp((amax_G / 6) /
        (amax / 2688), 2^-6, 448)), elements x * ((1 / pts) / s)) besides compressed-tensors' "absmax".
      dynamic: activations quantized at run time (True) or with static calibrated scales (False);
        "local" (NVFP4 activations): group scales at run time under a static, calibrated global scale.
    """

    format: Format
    strategy: str = "channel"
    group_size: Optional[int] = None
    block: Optional[Tuple[int, int]] = None
    symmetric: bool = True
    scale_format: str = "float32"
    scale_rule: str = "absmax"
    dynamic: "bool | str" = False

    def __post_init__(self):
        if self.dynamic not in (True, False, "local"):
            raise SchemeError(f"QuantScheme: dynamic must be True, False or 'local', got {self.dynamic!r}")
        fmt = get_format(self.format)
        object.__setattr__(self, "format", fmt)
        if isinstance(fmt, E8M0Format):
            raise SchemeError("QuantScheme: e8m0 is a scale format, not an element format")
        if self.strategy not in STRATEGIES:
            raise SchemeError(f"QuantScheme: strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy in ("group", "tensor_group"):
            if not isinstance(self.group_size, int) or self.group_size < 1:
                raise SchemeError(f"QuantScheme: strategy {self.strategy!r} needs a positive int group_size, "
                                  f"got {self.group_size!r}")
        elif self.group_size is not None:
            raise SchemeError(f"QuantScheme: group_size={self.group_size} given for strategy {self.strategy!r}")
        if self.strategy == "block":
            blk = tuple(self.block) if self.block is not None else None
            if blk is None or len(blk) != 2 or not all(isinstance(b, int) and b > 0 for b in blk):
                raise SchemeError(f"QuantScheme: strategy 'block' needs block=(rows, cols), got {self.block!r}")
            object.__setattr__(self, "block", blk)
        elif self.block is not None:
            raise SchemeError(f"QuantScheme: block={self.block} given for strategy {self.strategy!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise SchemeError(f"QuantScheme: scale_format must be one of {SCALE_FORMATS}, "
                              f"got {self.scale_format!r}")
        if self.scale_rule not in SCALE_RULES:
            raise SchemeError(f"QuantScheme: scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")
        if (self.scale_format == "e8m0") != (self.scale_rule in POW2_RULES):
            raise SchemeError(f"QuantScheme: scale_rule {self.scale_rule!r} does not fit scale_format "
                              f"{self.scale_format!r}: e8m0 scales take one of {POW2_RULES}, others 'absmax'")
        if self.scale_format == "e8m0" and not isinstance(fmt, FloatFormat):
            raise SchemeError(f"QuantScheme: e8m0 (MX) scales need a float element format, got {fmt.name}")
        if not self.symmetric and not isinstance(fmt, IntFormat):
            raise SchemeError(f"QuantScheme: asymmetric quantization needs an integer format, got {fmt.name}")
        if self.scale_rule == "torchao" and self.strategy != "tensor_group":
            raise SchemeError(f"QuantScheme: scale_rule 'torchao' is NVFP4's ('tensor_group'), got {self.strategy!r}")
        if self.strategy == "tensor_group" and self.scale_format != "fp8_e4m3fn":
            raise SchemeError("QuantScheme: 'tensor_group' (NVFP4) stores fp8_e4m3fn group scales, "
                              f"got scale_format {self.scale_format!r}")

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def half_range(self) -> float:
        """(qmax - qmin) / 2: the divisor of amax in the absmax rule (max for floats, 127.5 for int8)."""
        f = self.format
        if isinstance(f, IntFormat):
            return (f.qmax - f.qmin) / 2
        return f.max

    def describe(self) -> str:
        """Short human description, e.g. 'fp4_e2m1 group32 scale=e8m0/floor'."""
        g = {"group": f"group{self.group_size}", "tensor_group": f"tensor_group{self.group_size}",
             "block": f"block{self.block[0]}x{self.block[1]}" if self.block else ""}.get(self.strategy,
                                                                                         self.strategy)
        asym = "" if self.symmetric else " asym"
        return f"{self.format.name} {g}{asym} scale={self.scale_format}/{self.scale_rule}"


@dataclasses.dataclass(frozen=True)
class SchemeSet:
    """What a preset quantizes in a Linear: weights, input activations, output activations (each optional)."""

    name: str
    weights: Optional[QuantScheme] = None
    input_activations: Optional[QuantScheme] = None
    output_activations: Optional[QuantScheme] = None
