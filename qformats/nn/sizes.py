"""Parameter byte counts of a Flax model (packed QArray leaves count at their stored size)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx


def param_bytes(model_or_state, filter=nnx.Param) -> int:
    """Bytes of all array leaves of `nnx.state(model, filter)` (or of a given state / pytree)."""
    state = nnx.state(model_or_state, filter) if isinstance(model_or_state, nnx.Module) else model_or_state
    return int(sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype")))
