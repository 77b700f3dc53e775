"""Mixture-of-experts layouts of HF checkpoints, told from tensor names: routers, per-expert Linears, fused 3-D experts.

No torch model is built; the layouts are those transformers 5 writes (`save_pretrained` reverts its in-memory
fused experts to the on-disk names) and llm-compressor 0.14 reads and writes:

  - per-expert Linears, one 2-D `[out, in]` weight each: `<P>.experts.{e}.{gate,up,down}_proj.weight` (Qwen2-MoE,
    Qwen3-MoE, DeepSeek-V3, OLMoE, ...) and `<P>.experts.{e}.{w1,w2,w3}.weight` (Mixtral's `block_sparse_moe`);
  - the router of a block: `<P>.gate` (Qwen, Mixtral, DeepSeek) or `<P>.router` (gpt-oss), a `[E, hidden]`
    weight next to `<P>.experts`. In transformers 5 it is a `*TopKRouter` module, not an `nn.Linear`, so a
    "Linear" target does not select it (llm-compressor's default plan leaves it dense); compressed-tensors 0.19+
    types it "Linear" for vLLM (`get_vllm_module_type`: "Router" / "Gate" class names), so it is listed in the
    config's `ignore`. A Qwen2-MoE `shared_expert_gate` (`[1, hidden]`) is an `nn.Linear` and is quantized by a
    "Linear" target, as llm-compressor's default does (its recipes ignore it: `re:.*shared_expert_gate$`);
  - gpt-oss's fused 3-D experts: `<P>.experts.gate_up_proj` `[E, hidden, 2·inter]` (gate and up interleaved:
    gate in the even columns, up in the odd), `gate_up_proj_bias` `[E, 2·inter]`, `down_proj` `[E, inter,
    hidden]`, `down_proj_bias` `[E, hidden]`. llm-compressor 0.14 linearizes them before quantizing
    (`llmcompressor.modeling.moe.gpt_oss.GptOssExpertMLP`) and its checkpoint carries per-expert Linears:

        <P>.experts.{e}.gate_proj.weight = gate_up_proj[e][:, 0::2].T  [inter, hidden] .bias = gate_up_proj_bias[e, 0::2]
        <P>.experts.{e}.up_proj.weight   = gate_up_proj[e][:, 1::2].T  [inter, hidden] .bias = gate_up_proj_bias[e, 1::2]
        <P>.experts.{e}.down_proj.weight = down_proj[e].T             [hidden, inter] .bias = down_proj_bias[e]

    `linearized_experts` gives that view of a checkpoint (exact copies of the values), `fused_gpt_oss_experts` the
    inverse on per-expert modules (e.g. dequantized MXFP4 experts, `converters.formats.hf_mxfp4`). Fused expert tensors
    of any other layout are refused (`CheckpointError` naming them): never quantized as if they were 2-D, never
    skipped.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Set, Tuple

import numpy as np

from qformats.errors import CheckpointError

__all__ = ["EXPERT", "GPT_OSS_FUSED", "LinearizedExperts", "experts_text", "fused_expert_tensors",
           "fused_gpt_oss_experts", "linearized_experts", "router_modules"]

#: `<parent>.experts.{e}.<projection>`: (parent block, expert index, projection).
EXPERT = re.compile(r"^(?P<block>.*)\.experts\.(?P<e>\d+)\.(?P<proj>[^.]+)$")
_ROUTER_NAMES = ("gate", "router")
#: gpt-oss's fused expert tensors (local names under `<P>.experts`) and their ranks.
GPT_OSS_FUSED = {"gate_up_proj": 3, "gate_up_proj_bias": 2, "down_proj": 3, "down_proj_bias": 2}
_FLOAT = ("F32", "BF16", "F16")


def router_modules(infos: Mapping[str, Any]) -> Set[str]:
    """The router modules of a checkpoint (tensor name -> TensorInfo): `<P>.gate` / `<P>.router` holding a 2-D
    `weight` whose rows are the number of experts, where `<P>.experts.` tensors exist (per-expert or fused)."""
    blocks: Dict[str, Set[str]] = defaultdict(set)
    for name in infos:
        block, sep, rest = name.partition(".experts.")
        if sep:  # per-expert "<e>.<proj>.weight" or fused "gate_up_proj"
            blocks[block].add(rest.split(".")[0])
    out = set()
    for block, kids in blocks.items():
        n_experts = len([k for k in kids if k.isdigit()])
        for r in _ROUTER_NAMES:
            info = infos.get(f"{block}.{r}.weight")
            if info is not None and len(info.shape) == 2 and (n_experts == 0 or info.shape[0] == n_experts):
                out.add(f"{block}.{r}")
    return out


def fused_expert_tensors(infos: Mapping[str, Any]) -> List[str]:
    """The names of the floating tensors directly under a `<P>.experts` module (not under a numbered expert):
    fused expert weights and biases."""
    return sorted(n for n, i in infos.items()
                  if n.rpartition(".")[0].endswith(".experts") and i.dtype in _FLOAT)


def experts_text(modules: Iterable[str]) -> str:
    """How many experts a list of module paths holds, as "N layers × E experts × P projections (M weights)" (or
    one such phrase per distinct shape of the layout); "" when no path is an expert's."""
    by_block: Dict[str, Dict[str, Set[str]]] = defaultdict(lambda: defaultdict(set))
    for m in modules:
        x = EXPERT.match(m)
        if x:
            by_block[x["block"]][x["e"]].add(x["proj"])
    if not by_block:
        return ""
    shapes: Dict[Tuple[int, int], int] = defaultdict(int)
    total = 0
    for experts in by_block.values():
        projs = {len(p) for p in experts.values()}
        for p in projs:
            n_e = len([e for e in experts.values() if len(e) == p])
            shapes[(n_e, p)] += 1
            total += n_e * p
    parts = [f"{layers} layer{'s' if layers > 1 else ''} × {e} experts × {p} projection{'s' if p > 1 else ''}"
             for (e, p), layers in sorted(shapes.items())]
    return f"{' + '.join(parts)} ({total} expert weights)"


class _Virtual(NamedTuple):
    """A per-expert tensor cut from a fused one: `source`[expert] sliced by `cols` (None: all), transposed or not."""
    source: str
    expert: int
    cols: Optional[slice]
    transpose: bool


class _Info(NamedTuple):
    dtype: str
    shape: Tuple[int, ...]
    numpy_dtype: Any
    nbytes: int


class LinearizedExperts:
    """A view of an open checkpoint (`converters.formats.safetensors_io.open_checkpoint`) in which gpt-oss's fused
    expert tensors are replaced by llm-compressor's per-expert Linears (module docstring); every other tensor is
    the checkpoint's own. Same methods as the checkpoint: keys, info, get, file_of, drop_pages, path."""

    def __init__(self, ck, virtual: Dict[str, _Virtual]):
        self._ck = ck
        self._virtual = virtual
        hidden = {v.source for v in virtual.values()}
        self._keys = sorted([k for k in ck.keys() if k not in hidden] + list(virtual))
        self.path = ck.path

    def keys(self) -> List[str]:
        return list(self._keys)

    def info(self, name: str):
        v = self._virtual.get(name)
        if v is None:
            return self._ck.info(name)
        src = self._ck.info(v.source)
        shape = tuple(src.shape[1:])
        if v.cols is not None:
            shape = shape[:-1] + (len(range(*v.cols.indices(shape[-1]))),)
        if v.transpose:
            shape = shape[::-1]
        n = int(np.prod(shape)) * src.numpy_dtype.itemsize
        return _Info(src.dtype, shape, src.numpy_dtype, n)

    def get(self, name: str) -> np.ndarray:
        """The tensor's values: a copy cut from the fused tensor (exact) for a per-expert name."""
        v = self._virtual.get(name)
        if v is None:
            return self._ck.get(name)
        a = self._ck.get(v.source, rows=slice(v.expert, v.expert + 1))[0]
        if v.cols is not None:
            a = a[..., v.cols]
        return np.ascontiguousarray(a.T if v.transpose else a)

    def file_of(self, name: str):
        v = self._virtual.get(name)
        return self._ck.file_of(v.source if v is not None else name)

    def drop_pages(self) -> None:
        self._ck.drop_pages()


def linearized_experts(ck, config: Mapping[str, Any]):
    """`ck` itself when the checkpoint has no fused expert tensors; for gpt-oss's (config.json model_type
    "gpt_oss"), a `LinearizedExperts` view with llm-compressor's per-expert Linears (module docstring).

    Raises CheckpointError naming the tensors when fused expert tensors are not gpt-oss's exact layout (another
    model_type, a missing or extra tensor, or shapes that are not [E, hidden, 2·inter] / [E, 2·inter] /
    [E, inter, hidden] / [E, hidden]) -- they are never quantized as 2-D nor skipped."""
    infos = {n: ck.info(n) for n in ck.keys()}
    fused = fused_expert_tensors(infos)
    if not fused:
        return ck
    mt = config.get("model_type")
    by_block: Dict[str, Dict[str, str]] = defaultdict(dict)
    for n in fused:
        mod, _, local = n.rpartition(".")
        by_block[mod][local] = n
    where = f"{ck.path}"
    if mt != "gpt_oss":
        raise CheckpointError(
            f"{where}: fused 3-D expert tensors ({', '.join(fused[:4])}{' ...' if len(fused) > 4 else ''}; "
            f"model_type {mt!r}) are not supported: qformats splits only gpt-oss's fused experts (model_type "
            f"'gpt_oss': experts.gate_up_proj [E, hidden, 2*inter] interleaved, experts.down_proj [E, inter, hidden], "
            f"and their _bias) into per-expert Linears, as llm-compressor 0.14 does; per-expert checkpoints "
            f"(experts.{{e}}.gate_proj.weight ...) are quantized as they are")
    virtual: Dict[str, _Virtual] = {}
    for mod, t in sorted(by_block.items()):
        if set(t) != set(GPT_OSS_FUSED):
            raise CheckpointError(f"{where}: module {mod!r}: expected gpt-oss's fused expert tensors "
                                  f"{sorted(GPT_OSS_FUSED)}, found {sorted(t)}")
        gu, gub, dn, dnb = (infos[t[k]].shape for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                       "down_proj_bias"))
        ok = (len(gu) == 3 and len(dn) == 3 and len(gub) == 2 and len(dnb) == 2 and gu[2] % 2 == 0
              and dn[0] == gu[0] and tuple(gub) == (gu[0], gu[2]) and tuple(dn[1:]) == (gu[2] // 2, gu[1])
              and tuple(dnb) == (gu[0], gu[1]))
        if not ok:
            raise CheckpointError(
                f"{where}: module {mod!r}: expected gpt-oss's fused expert shapes gate_up_proj [E, hidden, 2*inter], "
                f"gate_up_proj_bias [E, 2*inter], down_proj [E, inter, hidden], down_proj_bias [E, hidden]; found "
                f"{list(gu)}, {list(gub)}, {list(dn)}, {list(dnb)}")
        for e in range(gu[0]):
            p = f"{mod}.{e}"
            for proj, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                virtual[f"{p}.{proj}.weight"] = _Virtual(t["gate_up_proj"], e, cols, True)
                virtual[f"{p}.{proj}.bias"] = _Virtual(t["gate_up_proj_bias"], e, cols, False)
            virtual[f"{p}.down_proj.weight"] = _Virtual(t["down_proj"], e, None, True)
            virtual[f"{p}.down_proj.bias"] = _Virtual(t["down_proj_bias"], e, None, False)
    return LinearizedExperts(ck, virtual)


def fused_gpt_oss_experts(modules: Mapping[str, Mapping[str, Any]], dense) -> Dict[str, Dict[str, Any]]:
    """The inverse of `linearized_experts` on a CompressedModel's modules (e.g. `converters.formats.hf_mxfp4`'s):
    each `<P>.experts.{e}.{gate,up,down}_proj` put back into gpt-oss's fused `<P>.experts` parameters, as
    transformers' Mxfp4Config(dequantize=True) loads them:

        gate_up_proj[e][:, 0::2] = dense(gate_proj kernel)   gate_up_proj[e][:, 1::2] = dense(up_proj kernel)
        down_proj[e] = dense(down_proj kernel)      (gate_up_proj [E, hidden, 2·inter], down_proj [E, inter, hidden])
        gate_up_proj_bias[e, 0::2] = gate bias, [e, 1::2] = up bias; down_proj_bias[e] = down bias

    `dense(q)` maps a QArray to its dense Flax kernel [in, out] (numpy). The fusing itself is the decoder's
    (`qformats.models.decoder.params.fuse_gpt_oss_experts`, on the dense kernels); this names the result as the
    checkpoint does. Other modules are passed through."""
    from qformats.models.decoder.params import fuse_gpt_oss_experts
    from qformats.qarray import QArray

    out: Dict[str, Dict[str, Any]] = {}
    blocks: Dict[str, Dict[int, Dict[str, Mapping[str, Any]]]] = {}
    for m, t in modules.items():
        x = EXPERT.match(m)
        if x and x["proj"] in ("gate_proj", "up_proj", "down_proj") and isinstance(t.get("weight"), QArray):
            blocks.setdefault(f"{x['block']}.experts", {}).setdefault(int(x["e"]), {})[x["proj"]] = t
        else:
            out[m] = dict(t)
    for mod, experts in blocks.items():
        n = len(experts)
        if sorted(experts) != list(range(n)) or any(set(v) != {"gate_proj", "up_proj", "down_proj"}
                                                     for v in experts.values()):
            raise CheckpointError(f"{mod}: expected experts 0..{n - 1} each with gate_proj, up_proj and down_proj")
        # torch layout [out, in] (a view of the dense kernel), as the fuser takes dense weights
        per_expert = [tuple({"weight": np.asarray(dense(experts[e][p]["weight"])).T, "bias": experts[e][p]["bias"]}
                            for p in ("gate_proj", "up_proj", "down_proj")) for e in range(n)]
        fused = fuse_gpt_oss_experts(mod, per_expert, expert_bias=True)
        gu, dn = fused[f"{mod}.gate_up_proj"], fused[f"{mod}.down_proj"]
        out[mod] = {"gate_up_proj": gu["weight"], "gate_up_proj_bias": gu["bias"], "down_proj": dn["weight"],
                    "down_proj_bias": dn["bias"]}
    return out
