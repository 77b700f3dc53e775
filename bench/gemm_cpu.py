"""f32 GEMM throughput on this CPU: XLA (jax.jit) vs torch vs numpy, for the shapes a SmolLM2 calibration layer runs (python bench/gemm_cpu.py; needs torch)."""
import time
import numpy as np
import jax, jax.numpy as jnp
import torch
SHAPES = [("x@W gate/up  [2048,576]@[576,3072]", (2048, 576), (576, 3072), False),
          ("x@W down     [2048,1536]@[1536,576]", (2048, 1536), (1536, 576), False),
          ("H += x^T x   [1536,2048]@[2048,1536]", (2048, 1536), (2048, 1536), True),
          ("H += x^T x   [576,2048]@[2048,576]", (2048, 576), (2048, 576), True)]
def best(fn, n=7):
    fn(); ts = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return min(ts)
print(f"| shape | GFLOP | XLA ms | XLA GFLOP/s | torch({torch.get_num_threads()} thr) ms | torch GFLOP/s | numpy ms | XLA/torch time |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
rng = np.random.default_rng(0)
for name, sa, sb, tr in SHAPES:
    a = rng.standard_normal(sa, dtype=np.float32); b = rng.standard_normal(sb, dtype=np.float32)
    if tr:
        flops = 2 * sa[1] * sa[0] * sb[1]
        f = jax.jit(lambda x, y: x.T @ y)
        tf = lambda: torch.mm(ta.t(), tb)
        nf = lambda: a.T @ b
    else:
        flops = 2 * sa[0] * sa[1] * sb[1]
        f = jax.jit(lambda x, y: x @ y)
        tf = lambda: torch.mm(ta, tb)
        nf = lambda: a @ b
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    tx = best(lambda: f(ja, jb).block_until_ready())
    tt = best(tf)
    tn = best(nf)
    g = flops / 1e9
    print(f"| {name} | {g:.2f} | {tx*1e3:.1f} | {g/tx:.0f} | {tt*1e3:.1f} | {g/tt:.0f} | {tn*1e3:.1f} | {tx/tt:.2f} |", flush=True)
