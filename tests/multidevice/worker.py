"""Multi-device checks run in a fresh interpreter (the CPU device count must be set before JAX starts).

    python tests/multidevice/worker.py CASE DEVICES WORKDIR [PROCESS_ID NUM_PROCESSES PORT]

prints one JSON line of results for tests/multidevice/test_*.py to assert on. Cases: "tp" (random decoder,
tensor-parallel forward / generate / HLO / quantize_model), "load" (checkpoints onto a mesh, RssAnon
transient), "smollm2" (SmolLM2 at N devices), "multiprocess" (one of several jax.distributed processes).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time


def _setup(devices: int):
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    return jax


CFG = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=16, num_key_value_heads=8, head_dim=16, tie_word_embeddings=False,
           rms_norm_eps=1e-5, max_position_embeddings=64)
COLLECTIVE = re.compile(r"=\s*(\w+)\[([\d,]*)\][^=]*?\b(all-gather|all-reduce|reduce-scatter|all-to-all|"
                        r"collective-permute|collective-broadcast)(-start)?\(")


def collectives(hlo: str):
    """[(op, dtype, shape)] of every collective in a compiled HLO module's text."""
    out = []
    for m in COLLECTIVE.finditer(hlo):
        shape = [int(d) for d in m.group(2).split(",") if d]
        out.append((m.group(3), m.group(1), shape))
    return out


def leaf_shapes(model):
    """Global and per-device shapes of every parameter leaf (packed leaves included)."""
    import jax
    from flax import nnx

    shapes = set()
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        shapes.add(tuple(leaf.shape))
        shapes.add(tuple(leaf.sharding.shard_shape(leaf.shape)))
    return sorted(list(s) for s in shapes if len(s) >= 1)


def save_dense(model, hf, path):
    from converters.formats.safetensors_io import save_file
    from qformats.models.decoder import hf_tensors

    path.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(model), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(hf))


def case_tp(n: int, workdir: str):
    jax = _setup(n)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from converters.pipelines.mesh_load import tensor_parallel_setup
    from qformats.models.decoder import CausalLM, DecoderConfig, quantization_rules, tensor_parallel_rules
    from qformats.models.decoder.scan import scan_layers
    from qformats.models.generate import generate
    from qformats.nn import quantize_model
    from qformats.presets import parse_scheme
    from qformats.qarray import QArray
    from qformats.nn.sharding import param_bytes_per_device, param_shardings, shard_model

    mesh = tensor_parallel_setup(n)
    cfg = DecoderConfig.from_hf(CFG)
    rules = tensor_parallel_rules(cfg)
    ids = jnp.array([[1, 5, 9, 33, 2], [7, 7, 100, 3, 4]], jnp.int32)
    res = {}
    for scheme in (None, "W4A16:g16", "NVFP4A16"):
        def build():
            m = CausalLM(cfg, rngs=nnx.Rngs(0))
            if scheme:
                quantize_model(m, quantization_rules(parse_scheme(scheme)))
            return m
        single = build()
        ref = np.asarray(generate(single, ids, 6))
        total = sum(param_bytes_per_device(single).values())
        tp = shard_model(build(), mesh, rules)
        out = np.asarray(generate(tp, ids, 6))
        per = param_bytes_per_device(tp)
        gd, st = nnx.split(tp)
        hlo = jax.jit(lambda s, i: nnx.merge(gd, s)(i)[0]).lower(st, ids).compile().as_text()

        def prefill(s, i):
            m = nnx.merge(gd, s)
            return m(i, m.init_cache(2, 8))[1]
        cache = jax.jit(prefill)(st, ids)
        cache_spec = [json.dumps(list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec)))
                      for a in cache.keys + cache.values]
        replicated = sum(a.nbytes for a in jax.tree.leaves(nnx.state(tp, nnx.Param)) if a.sharding.is_fully_replicated)
        # the same sharded model with its layers scanned: each stacked leaf keeps its layer's layout (layer axis
        # replicated), the cache is stacked per run and split by KV heads, the tokens are the same
        sc = scan_layers(shard_model(build(), mesh, rules))
        spec = lambda a: list(a.sharding.spec) + [None] * (a.ndim - len(a.sharding.spec))  # noqa: E731
        layout_kept = all(spec(st) == [None] + spec(lt) for st, lt in zip(
            jax.tree.leaves(nnx.state(sc.model.layers.runs[0].layer)), jax.tree.leaves(nnx.state(tp.model.layers[0]))))
        gd2, st2 = nnx.split(sc)
        cache2 = jax.jit(lambda s, i: (lambda m: m(i, m.init_cache(2, 8))[1])(nnx.merge(gd2, s)))(st2, ids)
        scanned = dict(out=np.asarray(generate(sc, ids, 6)).tolist(), layout_kept=layout_kept,
                       cache_spec=sorted({json.dumps(spec(a)) for a in cache2.keys + cache2.values}))
        res[scheme or "dense"] = dict(scanned=scanned, ref=ref.tolist(), out=out.tolist(), total=total, replicated=replicated,
                                      per_device=sorted(per.values()), devices=len(per),
                                      collectives=collectives(hlo), leaf_shapes=leaf_shapes(tp),
                                      cache_spec=sorted(set(cache_spec)))
    # quantize_model on a sharded float model: packed leaves land where the float weights' rules put them
    m = shard_model(CausalLM(cfg, rngs=nnx.Rngs(0)), mesh, rules)
    kernel_shardings = {p: v.get_value().sharding for p, v in _variables(m) if p.endswith("kernel")}
    with jax.transfer_guard_device_to_device("disallow"):
        quantize_model(m, quantization_rules(parse_scheme("W4A16:g16")))
    want = param_shardings(m, mesh, rules)
    placed, mismatched = 0, []
    for path, v in _variables(m):
        q = v.get_value()
        if not isinstance(q, QArray):
            continue
        for part in ("codes", "scale"):
            got, exp = getattr(q, part).sharding, getattr(want[path], part)
            placed += 1
            if not got.is_equivalent_to(exp, getattr(q, part).ndim):
                mismatched.append(f"{path}.{part}: {got} vs {exp}")
    res["quantize_sharded"] = dict(checked=placed, mismatched=mismatched,
                                   float_kernels=len(kernel_shardings))
    return res


def _variables(model):
    from flax import nnx

    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Variable):
            yield "/".join(str(x) for x in path), v


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakRss:
    """Samples RssAnon in a thread while the block runs (every ~0.2 ms)."""

    def __enter__(self):
        self.peak = _rss_anon()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        sys.setswitchinterval(1e-5)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, _rss_anon())
        sys.setswitchinterval(0.005)


def case_load(n: int, workdir: str):
    jax = _setup(n)
    import gc
    from pathlib import Path

    import numpy as np
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.pipelines.mesh_load import ReadStats, tensor_parallel_setup
    from converters.pipelines.quantize_checkpoint import quantize_checkpoint
    from qformats.models.decoder import CausalLM, DecoderConfig

    mesh = tensor_parallel_setup(n)
    wd = Path(workdir)
    res = {}
    # parity: every parameter of the sharded load equals the single-device load, dense and packed
    cfg = DecoderConfig.from_hf(CFG)
    save_dense(CausalLM(cfg, rngs=nnx.Rngs(1)), CFG, wd / "dense")
    quantize_checkpoint(wd / "dense", wd / "w4", "W4A16:g16", progress=False)
    quantize_checkpoint(wd / "dense", wd / "nvfp4", "NVFP4A16", progress=False)
    for name in ("dense", "w4", "nvfp4"):
        ref, _, _ = load_causal_lm(wd / name, tokenizer=False)
        st = ReadStats()
        got, _, _ = load_causal_lm(wd / name, mesh=mesh, tokenizer=False, stats=st)
        a = jax.tree.leaves(nnx.state(ref, nnx.Param))
        b = jax.tree.leaves(nnx.state(got, nnx.Param))
        res[name] = dict(leaves=len(a), same=len(a) == len(b) and all(
            x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b)),
            sharded=sum(1 for y in b if not y.sharding.is_fully_replicated), bytes_read=st.bytes)
    del ref, got, a, b
    # the checkpoint case_memory measures (tensors of MBs), written here so that its process starts clean
    big = dict(CFG, vocab_size=8192, hidden_size=512, intermediate_size=2048, num_attention_heads=16,
               num_key_value_heads=8, head_dim=32)
    bcfg = DecoderConfig.from_hf(big)
    save_dense(CausalLM(bcfg, rngs=nnx.Rngs(2)), big, wd / "big")
    return res


def case_memory(n: int, workdir: str):
    """Transient host memory of a sharded load: peak RssAnon - (baseline + bytes of the placed arrays)."""
    jax = _setup(n)
    import gc
    from pathlib import Path

    import numpy as np
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.pipelines.mesh_load import ReadStats, place, tensor_parallel_setup

    mesh = tensor_parallel_setup(n)
    wd = Path(workdir)
    # warm up JAX's CPU runtime (first device_put, first make_array) so that the baseline holds it
    place((n, 4), np.float32, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp")),
          lambda ix: np.zeros((8, 4), np.float32)[ix])
    gc.collect()
    st = ReadStats()
    base = _rss_anon()
    with PeakRss() as pk:
        model, _, _ = load_causal_lm(wd / "big", mesh=mesh, tokenizer=False, stats=st)
    placed = sum(s.data.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))
                 for s in leaf.addressable_shards)
    return dict(baseline=base, peak=pk.peak, placed=placed, largest_slice=st.largest,
                transient=pk.peak - base - placed, after=_rss_anon() - base,
                file_bytes=(wd / "big" / "model.safetensors").stat().st_size)


def case_smollm2(n: int, workdir: str):
    jax = _setup(n)
    import numpy as np
    from flax import nnx

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.evaluation.embedded import smollm2_gguf
    from converters.pipelines.mesh_load import tensor_parallel_setup
    from qformats.models.decoder import quantization_rules, tensor_parallel_rules
    from qformats.models.generate import generate
    from qformats.nn import quantize_model
    from qformats.presets import parse_scheme
    from qformats.nn.sharding import param_bytes_per_device, shard_model

    mesh = tensor_parallel_setup(n)
    res = {}
    model, hf, tok = load_causal_lm(smollm2_gguf())
    ids = np.asarray([tok.encode("The capital of France is").ids], np.int32)
    # the packed variants from the unsharded float model first; the dense model itself is sharded last
    for scheme in ("W4A16:g64", "NVFP4A16", "dense"):
        m = model if scheme == "dense" else _copy_quantized(model, scheme, quantize_model, quantization_rules,
                                                            parse_scheme)
        assert all(a.sharding.is_fully_replicated and len(a.sharding.device_set) == 1
                   for a in jax.tree.leaves(nnx.state(m, nnx.Param)))  # one device
        ref = np.asarray(generate(m, ids, 8))
        total = sum(param_bytes_per_device(m).values())
        shard_model(m, mesh, tensor_parallel_rules(m.config))
        out = np.asarray(generate(m, ids, 8))
        res[scheme] = dict(ref=ref.tolist(), out=out.tolist(), total=total,
                           per_device=sorted(param_bytes_per_device(m).values()))
        del m
    return res


def _copy_quantized(model, scheme, quantize_model, quantization_rules, parse_scheme):
    from flax import nnx

    m = nnx.clone(model)
    quantize_model(m, quantization_rules(parse_scheme(scheme)))
    return m


def case_multiprocess(n: int, workdir: str, pid: int, nproc: int, port: int):
    jax = _setup(n)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)
    from pathlib import Path

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from converters.pipelines.causal_lm import load_causal_lm
    from converters.pipelines.mesh_load import ReadStats

    wd = Path(workdir)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    ids = np.array([[1, 5, 9, 33, 2], [7, 7, 100, 3, 4]], np.int32)
    res = {"global_devices": len(jax.devices()), "local_devices": len(jax.local_devices())}
    for name in ("dense", "w4"):
        st = ReadStats()
        model, _, _ = load_causal_lm(wd / name, mesh=mesh, tokenizer=False, stats=st)
        gids = multihost_utils.host_local_array_to_global_array(ids, mesh, jax.sharding.PartitionSpec())
        gd, state = nnx.split(model)
        logits = jax.jit(lambda s, x: nnx.merge(gd, s)(x)[0])(state, gids)
        full = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
        with jax.default_device(jax.local_devices()[0]):
            ref_model, _, _ = load_causal_lm(wd / name, tokenizer=False)
            ref = np.asarray(jax.jit(lambda x: ref_model(x)[0])(jnp.asarray(ids)))
        res[name] = dict(bytes_read=st.bytes, file_bytes=sum(f.stat().st_size for f in (wd / name).glob("*.safetensors")), max_abs_diff=float(np.max(np.abs(full - ref))),
                         argmax_equal=bool(np.array_equal(full.argmax(-1), ref.argmax(-1))))
    jax.distributed.shutdown()
    return res


def main(argv):
    case, n, workdir = argv[0], int(argv[1]), argv[2]
    if case == "multiprocess":
        res = case_multiprocess(n, workdir, int(argv[3]), int(argv[4]), int(argv[5]))
    else:
        res = {"tp": case_tp, "load": case_load, "memory": case_memory, "smollm2": case_smollm2}[case](n, workdir)
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1:])
