"""The qformats package: `import qformats` stays free of flax; `qformats.nn` loads on first use."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_qformats_does_not_import_flax_and_nn_is_lazy():
    code = ("import sys, qformats\n"
            "print('flax' in sys.modules, 'qformats.nn' in sys.modules)\n"
            "nn = qformats.nn\n"
            "print('flax' in sys.modules, nn is sys.modules['qformats.nn'], callable(nn.quantize_model))\n")
    assert _run(code).split("\n") == ["False False", "True True True"]


def test_unknown_attribute_is_an_attribute_error():
    import qformats
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qformats.nope  # noqa: B018
    assert "nn" in dir(qformats)


def test_core_and_algorithms_import_no_flax():
    """Every module of the numeric core and of qformats.algorithms imports without flax (nor qformats.nn /
    qformats.models): the Flax integration lives in qformats.nn and qformats.models only."""
    code = ("import pkgutil, sys, importlib, qformats, qformats.algorithms\n"
            "names = [m.name for m in pkgutil.iter_modules(qformats.__path__, 'qformats.') if not m.ispkg]\n"
            "names += [m.name for m in pkgutil.iter_modules(qformats.algorithms.__path__, 'qformats.algorithms.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "print(len(names) > 20, sorted(m for m in sys.modules if m == 'flax' or m.startswith(('flax.', "
            "'qformats.nn', 'qformats.models'))))\n")
    assert _run(code) == "True []"
