"""Preset scheme sets under compressed-tensors' names (plus the FPx ones the torch side dropped) and scheme strings."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Dict, Iterator

from qformats.errors import SchemeError
from qformats.schemes import QuantScheme, SchemeSet


def _int_w(bits: int, group: int = 128, symmetric: bool = True) -> QuantScheme:
    return QuantScheme(f"int{bits}", "group", group_size=group, symmetric=symmetric, scale_format="input")


def _int_tok(bits: int) -> QuantScheme:
    return QuantScheme(f"int{bits}", "token", scale_format="input", dynamic=True)


def _mx(fmt: str, dynamic: bool = False) -> QuantScheme:
    return QuantScheme(fmt, "group", group_size=32, scale_format="e8m0", scale_rule="ct", dynamic=dynamic)


_FP8 = "fp8_e4m3fn"
_NVFP4_W = QuantScheme("fp4_e2m1", "tensor_group", group_size=16, scale_format="fp8_e4m3fn")
_NVFP4_A = QuantScheme("fp4_e2m1", "tensor_group", group_size=16, scale_format="fp8_e4m3fn", dynamic="local")


def _build() -> Dict[str, SchemeSet]:
    p: Dict[str, SchemeSet] = {}

    def add(name, w=None, a=None):
        p[name] = SchemeSet(name, weights=w, input_activations=a)

    # -- compressed-tensors 0.20 PRESET_SCHEMES, same names and semantics --
    add("W4A16_ASYM", _int_w(4, symmetric=False))
    w8a8 = (QuantScheme("int8", "channel", scale_format="input"), _int_tok(8))
    add("W8A8", *w8a8)
    add("INT8", *w8a8)
    add("W4AFP8", _int_w(4), QuantScheme(_FP8, "token", scale_format="input", dynamic=True))
    add("FP8", QuantScheme(_FP8, "tensor", scale_format="input"), QuantScheme(_FP8, "tensor", scale_format="input"))
    add("FP8_DYNAMIC", QuantScheme(_FP8, "channel", scale_format="input"),
        QuantScheme(_FP8, "token", scale_format="input", dynamic=True))
    add("FP8_BLOCK", QuantScheme(_FP8, "block", block=(128, 128), scale_format="input"),
        QuantScheme(_FP8, "group", group_size=128, scale_format="input", dynamic=True))
    add("NVFP4A16", _NVFP4_W)
    add("NVFP4", _NVFP4_W, _NVFP4_A)
    add("MXFP4A16", _mx("fp4_e2m1"))
    add("MXFP4", _mx("fp4_e2m1"), _mx("fp4_e2m1", dynamic=True))
    add("MXFP4XFP8", _mx("fp4_e2m1"), QuantScheme(_FP8, "group", group_size=128, scale_format="input", dynamic=True))
    add("MXFP6A16", _mx("fp6_e2m3"))
    add("MXFP6A8", _mx("fp6_e2m3"), _mx(_FP8, dynamic=True))
    add("MXFP8A16", _mx(_FP8))
    add("MXFP8", _mx(_FP8), _mx(_FP8, dynamic=True))
    for wb in range(2, 9):
        add(f"W{wb}A16", _int_w(wb))
        for ab in (4, 8):
            if wb <= ab and (wb, ab) != (8, 8):  # W8A8 is the channel-wise INT8 preset above
                add(f"W{wb}A{ab}", _int_w(wb), _int_tok(ab))
    # -- FPx weight-only (Quant-LLM / torchao fpx, removed from torchao in Jan 2026) --
    # per-output-channel scale = amax / max_elem, stored in the weight's dtype; _G32/_G128 group variants.
    for name, fmt in (("FP8_E4M3", _FP8), ("FP6_E3M2", "fp6_e3m2"), ("FP6_E2M3", "fp6_e2m3"),
                      ("FP5_E2M2", "fp5_e2m2"), ("FP5_E3M1", "fp5_e3m1"), ("FP4_E2M1", "fp4_e2m1"),
                      ("FP4_E3M0", "fp4_e3m0")):
        add(name, QuantScheme(fmt, "channel", scale_format="input"))
        for g in (32, 128):
            add(f"{name}_G{g}", QuantScheme(fmt, "group", group_size=g, scale_format="input"))
    return p


class Presets(Mapping):
    """Read-only mapping preset name -> SchemeSet; names are case-insensitive; unknown names raise SchemeError."""

    def __init__(self, table: Dict[str, SchemeSet]):
        self._t = table

    def __getitem__(self, name: str) -> SchemeSet:
        key = str(name).upper()
        if key not in self._t:
            close = difflib.get_close_matches(key, list(self._t), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close[:-1]) + ' or ' if close[1:] else ''}{close[-1]}? " if close else ""
            raise SchemeError(f"unknown preset {name!r}; {hint}valid presets: {', '.join(sorted(self._t))}")
        return self._t[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def __contains__(self, name) -> bool:
        return str(name).upper() in self._t


presets = Presets(_build())


# Group sizes fixed by the format's definition: MX (OCP MX v1.0) scales 32 elements, NVFP4 16; another size would
# be neither format (and no longer a compressed-tensors / vLLM one).
_FIXED_GROUPS = {"e8m0": ("MX", 32), "tensor_group": ("NVFP4", 16)}


def parse_scheme(text: str) -> SchemeSet:
    """A scheme string -> SchemeSet: a preset name with optional suffixes, each at most once, in any order:

      ":w"    the preset's weight scheme alone (float activations), e.g. "FP8_BLOCK:w";
      ":gN"   group size N (a positive integer) for the weight scheme's groups, e.g. "W4A16:g64";
              the weights' scale groups become N consecutive input columns; activations are unchanged.

    "W4A16:g64:w" and "W4A16:w:g64" are the same scheme; the returned SchemeSet's name is the canonical
    "NAME[:gN][:w]" (NAME as the preset table spells it).

    Raises:
      SchemeError: an unknown preset or suffix, a repeated suffix, ":gN" on a preset whose weights have no
        groups (channel, tensor or block scales), or on an MX / NVFP4 preset with N other than the format's
        own group size (32 / 16), or on a preset without weights.
    """
    if not isinstance(text, str):
        raise SchemeError(f"expected a scheme string such as 'W4A16' or 'W4A16:g64', got {type(text).__name__}")
    base, *suffixes = text.strip().split(":")
    ss = presets[base]
    name = next(k for k in presets if k == base.upper())
    weights_only, group = False, None
    for suf in suffixes:
        s = suf.strip().lower()
        if s == "w" and not weights_only:
            weights_only = True
        elif re.fullmatch(r"g[0-9]+", s) and group is None:
            group = int(s[1:])
            if group < 1:
                raise SchemeError(f"scheme {text!r}: the group size of ':{suf}' must be a positive integer")
        else:
            seen = "repeated " if s == "w" or re.fullmatch(r"g[0-9]+", s) else ""
            raise SchemeError(f"scheme {text!r}: {seen}suffix ':{suf}'; expected NAME with ':w' (weights only) "
                              f"and/or ':gN' (weight group size N), each at most once")
    w = ss.weights
    if group is not None:
        if w is None:
            raise SchemeError(f"scheme {text!r}: preset {name} quantizes no weights, so ':g{group}' has no groups "
                              f"to size")
        if w.strategy not in ("group", "tensor_group"):
            raise SchemeError(f"scheme {text!r}: the weights of {name} ({w.describe()}) have {w.strategy} scales, "
                              f"not groups; ':gN' applies to group presets such as W4A16, W4A16_ASYM, FP6_E3M2_G128")
        fixed = _FIXED_GROUPS.get(w.scale_format) or _FIXED_GROUPS.get(w.strategy)
        if fixed is not None and group != fixed[1]:
            raise SchemeError(f"scheme {text!r}: {fixed[0]} scales groups of {fixed[1]} by definition "
                              f"({name}: {w.describe()}); ':g{group}' would make another format")
        w = dataclasses.replace(w, group_size=group)
        name += f":g{group}"
    if weights_only:
        return SchemeSet(f"{name}:w", weights=w)
    return dataclasses.replace(ss, name=name, weights=w)
