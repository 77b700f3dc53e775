"""converters.process: glibc malloc tuning and the XLA_FLAGS edit of a calibration run, restored after."""

import os
import platform

import pytest

from converters import process


def test_lean_malloc_and_trim_malloc_on_glibc():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt and malloc_trim are glibc's")
    assert process.lean_malloc() is True  # every option accepted (mallopt returns 1)
    assert process.trim_malloc() is True


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
