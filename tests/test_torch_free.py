"""The torch-free core: qformats, its layers, the decoder model and the CLI import, and the tests of qformats and
kernels_pallas collect, in a process where torch (and the torch-based reference libraries) cannot be imported."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# sys.modules[name] = None makes `import name` raise ImportError (ModuleNotFoundError), as if not installed
BLOCK = textwrap.dedent("""
    import sys
    for name in ("torch", "torchao", "compressed_tensors", "transformers", "sentence_transformers"):
        sys.modules[name] = None
""")


def _run(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_CORE_"))}
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_core_imports_without_torch():
    r = _run("""
        import qformats, qformats.nn, qformats.models.decoder, converters.cli
        loaded = sorted(n for n in ("torch", "torchao", "compressed_tensors", "transformers")
                        if sys.modules.get(n) is not None)
        assert not loaded, loaded
    """)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow  # collects ~1000 tests in a fresh process
def test_core_tests_collect_without_torch():
    r = _run("""
        import pytest
        sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/qformats",
                              "tests/kernels_pallas"]))
    """)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    summary = [line for line in r.stdout.splitlines() if line.strip()][-1]
    assert "collected" in summary and "error" not in summary, summary
    assert "ERROR collecting" not in out, out
