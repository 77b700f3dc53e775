"""converters.process: glibc malloc tuning, the XLA_FLAGS edit of a calibration run (restored after), and the restart
under huge-page malloc."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from converters import process


def test_lean_malloc_and_trim_malloc_on_glibc():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt and malloc_trim are glibc's")
    assert process.lean_malloc() is True  # every option accepted (mallopt returns 1)
    assert process.trim_malloc() is True


def test_lean_malloc_sets_the_three_thresholds(monkeypatch):
    calls = []

    class _Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(process.ctypes, "CDLL", lambda name: _Libc())
    assert process.lean_malloc() is True
    # glibc's M_MMAP_THRESHOLD (-3), M_TRIM_THRESHOLD (-1), M_ARENA_MAX (-8): the defaults
    assert calls == [(-3, 1 << 20), (-1, 16 << 20), (-8, 2)]
    calls.clear()
    assert process.lean_malloc(mmap_threshold=4 << 20, arena_max=1, trim_threshold=8 << 20) is True
    assert calls == [(-3, 4 << 20), (-1, 8 << 20), (-8, 1)]


def test_lean_compile_sets_the_codegen_flag_only_while_it_runs(monkeypatch):
    def flags_inside():
        with process.lean_compile():
            return os.environ.get("XLA_FLAGS")

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert flags_inside() == "--xla_cpu_parallel_codegen_split_count=1" and "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert flags_inside() == "--xla_force_host_platform_device_count=2 --xla_cpu_parallel_codegen_split_count=1"
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_parallel_codegen_split_count=4")  # the caller's choice is kept
    assert flags_inside() == "--xla_cpu_parallel_codegen_split_count=4"


def test_lean_compile_restores_the_flags_when_the_block_raises(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    with pytest.raises(ValueError):
        with process.lean_compile():
            raise ValueError("inside")
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_lean_calibration_yields_the_between_phases_callback(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with process.lean_calibration() as between_phases:
        assert os.environ["XLA_FLAGS"] == "--xla_cpu_parallel_codegen_split_count=1"
        assert between_phases() is (platform.libc_ver()[0] == "glibc")  # hands free pages back where it can
    assert "XLA_FLAGS" not in os.environ


def _glibc_235():
    lib, version = platform.libc_ver()
    return lib == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (2, 35)


@pytest.mark.parametrize("mode", ["always [madvise] never", "[always] madvise never"])
def test_hugepage_malloc_env_adds_the_tunable(tmp_path, mode):
    thp = tmp_path / "enabled"
    thp.write_text(mode + "\n")
    env = process.hugepage_malloc_env({"A": "1"}, thp_path=str(thp))
    if not _glibc_235():
        assert env is None
        return
    assert env == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = process.hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.check=0"}, thp_path=str(thp))
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.hugetlb=1"}  # other tunables kept


def test_hugepage_malloc_env_changes_nothing_where_it_would_not_help(tmp_path):
    thp = tmp_path / "enabled"
    thp.write_text("always madvise [never]\n")
    assert process.hugepage_malloc_env({}, thp_path=str(thp)) is None  # THP off
    assert process.hugepage_malloc_env({}, thp_path=str(tmp_path / "missing")) is None  # no THP in this kernel
    thp.write_text("always [madvise] never\n")
    for tunables in ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=1", "glibc.malloc.check=0:glibc.malloc.hugetlb=2"):
        assert process.hugepage_malloc_env({"GLIBC_TUNABLES": tunables}, thp_path=str(thp)) is None  # caller's choice


def test_reexec_with_hugepage_malloc_restarts_the_command_once():
    """The same command line runs again under the tunable (output written before the restart is flushed, not lost),
    and the restarted process does not restart again."""
    code = ("import os\nprint('start', os.environ.get('GLIBC_TUNABLES'))\n"
            "from converters.process import reexec_with_hugepage_malloc\nreexec_with_hugepage_malloc()\n"
            "print('done', os.environ.get('GLIBC_TUNABLES'))\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                       cwd=str(Path(__file__).resolve().parents[2]))
    if process.hugepage_malloc_env(env) is None:
        assert r.stdout.splitlines() == ["start None", "done None"]
    else:
        assert r.stdout.splitlines() == ["start None", "start glibc.malloc.hugetlb=1", "done glibc.malloc.hugetlb=1"]
    env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=0"  # the way to keep malloc as it is
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                       cwd=str(Path(__file__).resolve().parents[2]))
    assert r.stdout.splitlines() == ["start glibc.malloc.hugetlb=0", "done glibc.malloc.hugetlb=0"]
