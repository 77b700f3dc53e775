"""The torch side of the perplexity benches: `qformats eval --text`'s protocol on a transformers model, and the
environment of the llm-compressor subprocesses that run it. Their `-c` scripts get the function's source
(`TORCH_PPL_SOURCE`) rather than this directory on sys.path: its module names (kernels.py) would shadow packages
transformers probes for."""

from __future__ import annotations

import inspect
import math
import os


def oneshot_env() -> dict:
    """os.environ + offline Hugging Face flags: the subprocesses never reach the hub."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def torch_perplexity(model, windows, batch: int = 4) -> tuple[float, int]:
    """(ppl, tokens) of a torch causal LM on `windows` (a [W, T] int64 tensor), each window run alone:
    ppl = exp(-sum_w sum_{t>=1} log p(w_t | w_<t) / (W (T - 1))), log-probabilities in float32, summed in float64."""
    import torch

    total = 0.0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            w = windows[i:i + batch]
            logits = model(w).logits.float()[:, :-1]
            lp = torch.log_softmax(logits, dim=-1).gather(-1, w[:, 1:, None])[..., 0]
            total += float(-lp.double().sum())
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    return math.exp(total / tokens), tokens


# prepended to the llm-compressor `-c` scripts, which call torch_perplexity
TORCH_PPL_SOURCE = "import math\n\n" + inspect.getsource(torch_perplexity) + "\n\n"
