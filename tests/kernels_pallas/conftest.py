"""Settings for the kernel tests: MLIR's failed look-ups of the Triton dialect's Python module answered at once."""

import importlib.util
import sys

# Lowering a Pallas kernel for Triton, MLIR's Python bindings look for a Python module of the `tt` dialect under each
# of their package prefixes whenever they build a value or type of it, and do not remember that none exists: ~220
# failed imports per lowering, each a walk of sys.meta_path and sys.path (a third of test_lowers_to_triton's time,
# py-spy). A None entry in sys.modules makes such an import raise ModuleNotFoundError at once, which is what the
# bindings get from the walk and skip. Only names that do not exist are entered, so nothing importable is hidden.
for _name in ("jaxlib.mlir.dialects.tt", "jaxlib.mosaic.python.tt", "jax.jaxlib"):  # the last a whole prefix
    try:
        _absent = importlib.util.find_spec(_name) is None
    except ImportError:  # a parent package is missing: nothing under it to hide
        _absent = False
    if _absent and _name not in sys.modules:
        sys.modules[_name] = None
