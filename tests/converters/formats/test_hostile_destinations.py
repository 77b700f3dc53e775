"""Hostile destinations: a destination that is, lies inside or holds the source is refused before anything is
written (every pipeline, with or without overwrite); one writer per destination; SIGTERM and SIGHUP handled
like SIGINT; dead writers' temp directories removed by the next writer into the same folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import qformats as qf
from converters.formats import shard_writer
from converters.formats.compressed_tensors.write import write_compressed
from converters.pipelines.dequantize_checkpoint import dequantize_checkpoint
from converters.pipelines.quantize_checkpoint import quantize_checkpoint
from converters.formats.safe_files import check_destination
from converters.formats.safetensors_io import SINGLE_FILE, save_file
from converters.formats.shard_writer import ShardedWriter
from qformats.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[3]
W = (np.random.default_rng(0).standard_normal((32, 128)) * 0.1).astype(np.float32)


def _listing(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _dense(path: Path) -> Path:
    path.mkdir(parents=True)
    save_file({"model.layers.0.mlp.up_proj.weight": W, "model.norm.weight": np.ones(128, np.float32)},
              path / SINGLE_FILE)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "tokenizer.json").write_text("{}")
    return path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- DST apart from SRC ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["same", "inside", "holds", "link", "dotdot"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_destination_overlapping_the_source_is_refused_by_the_writer(tmp_path, where, overwrite):
    src = _dense(tmp_path / "a" / "src")
    before = _listing(tmp_path)
    (tmp_path / "lnk").symlink_to(src)
    dst = {"same": src, "inside": src / "sub", "holds": tmp_path / "a", "link": tmp_path / "lnk",
           "dotdot": src / "x" / ".." / "sub"}[where]
    with pytest.raises(CheckpointError) as e:
        ShardedWriter(dst, overwrite=overwrite, sources=(src,))
    assert str(dst) in str(e.value) and "expected a destination apart from the source" in str(e.value)
    (tmp_path / "lnk").unlink()
    assert _listing(tmp_path) == before  # nothing written: no temp dir, no lock, no sub-directory
    assert sorted(os.listdir(tmp_path)) == ["a"] and sorted(os.listdir(tmp_path / "a")) == ["src"]


def test_check_destination_on_files_and_hard_links(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    os.link(f, tmp_path / "hard.gguf")
    for dst in (f, tmp_path / "hard.gguf", f / "out"):
        with pytest.raises(CheckpointError, match="apart from the source"):
            check_destination(dst, [f])
    check_destination(tmp_path / "other", [f, None])  # apart: fine
    check_destination(tmp_path / "m.gguf2", [f])


@pytest.mark.parametrize("overwrite", [False, True])
def test_pipelines_refuse_to_write_over_their_source(tmp_path, overwrite):
    src = _dense(tmp_path / "dense")
    before = _listing(tmp_path)
    for dst in (src, src / "sub"):
        refusal = "apart from the source" if overwrite or not dst.exists() else "apart from the source|exists"
        with pytest.raises(CheckpointError, match=refusal):
            quantize_checkpoint(src, dst, "W8A16", overwrite=overwrite, progress=False)
    assert _listing(tmp_path) == before
    ct = tmp_path / "ct"
    write_compressed(ct, {"model.q_proj.weight": qf.quantize(W.T, qf.presets["W8A16"].weights, axis=0)},
                     qf.presets["W8A16"], config={"model_type": "tiny"})
    before = _listing(tmp_path)
    for dst in (ct, ct / "sub", tmp_path):
        refusal = "apart from the source" if overwrite or not dst.exists() else "apart from the source|exists"
        with pytest.raises(CheckpointError, match=refusal):
            dequantize_checkpoint(ct, dst, overwrite=overwrite)
    from converters.pipelines.calibrate import quantize_calibrated_lm
    with pytest.raises(CheckpointError, match="apart from the source" if overwrite else "apart from the source|exists"):
        quantize_calibrated_lm(src, src, "W4A16", tmp_path / "none.txt", overwrite=overwrite)
    assert _listing(tmp_path) == before


def test_convert_gguf_onto_itself_is_refused_by_the_cli(tmp_path, capsys):
    pytest.importorskip("gguf")
    from gguf_tiny import tiny_gguf

    from converters import cli
    path = tiny_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    (tmp_path / "ln.gguf").symlink_to(path)
    for dst in (path, tmp_path / "ln.gguf", path / "sub"):
        assert cli.main(["convert", str(path), str(dst), "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert f"qformats: error: {dst}: expected a destination apart from the source" in err, err
    assert path.read_bytes() == data and sorted(os.listdir(tmp_path)) == ["ln.gguf", "m.gguf"]


# ---- one writer per destination -----------------------------------------------------------------------------------
def test_second_writer_to_one_destination_fails(tmp_path):
    dst = tmp_path / "ck"
    first = ShardedWriter(dst)
    first.add("a", np.zeros(2, np.float32))
    with pytest.raises(CheckpointError, match=r"ck: expected no other writer to this destination.*\.ck\.lock"):
        ShardedWriter(dst, overwrite=True)
    other = ShardedWriter(tmp_path / "other")  # another destination in the same folder: fine
    other.abort()
    first.finish()
    assert os.listdir(dst) == [SINGLE_FILE] and sorted(os.listdir(tmp_path)) == ["ck"]
    with ShardedWriter(dst, overwrite=True) as w:  # free again
        w.add("b", np.ones(2, np.float32))
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# One interpreter (the import is the slow part), then two forked writers released at the same instant.
_RACE = r"""
import os, sys, time
import numpy as np
from converters.formats.shard_writer import ShardedWriter
from qformats.errors import CheckpointError
start = time.time() + 0.5
pids = []
for i in range(2):
    pid = os.fork()
    if pid == 0:
        while time.time() < start:
            pass
        try:
            with ShardedWriter(sys.argv[1], overwrite=True) as w:
                w.add("x", np.full(1 << 16, float(i), np.float32))
                time.sleep(0.3)
        except CheckpointError as e:
            print("LOST", e, flush=True)
            os._exit(1)
        os._exit(0)
    pids.append(pid)
print([os.WEXITSTATUS(os.waitpid(p, 0)[1]) for p in pids], flush=True)
"""


def test_concurrent_writers_cannot_both_succeed(tmp_path):
    dst = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _RACE, str(dst)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and sorted(json.loads(lines[-1])) == [0, 1], (p.stdout, p.stderr)
    assert "expected no other writer to this destination" in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["ck"] and os.listdir(dst) == [SINGLE_FILE]


# ---- signals ------------------------------------------------------------------------------------------------------
_SIGNAL = r"""
import json, os, signal, sys, time
import numpy as np
from converters.formats.shard_writer import ShardedWriter
# a run started with nohup or in a shell's background inherits SIGHUP / SIGINT ignored (the writer then leaves them
# ignored): the dispositions a terminal session gives
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
out = []
for dst, sig in json.loads(sys.argv[1]):
    try:
        with ShardedWriter(dst, overwrite=True) as w:
            w.add("new", np.zeros(4, np.float32))
            w.add_json("config.json", {"new": True})
            os.kill(os.getpid(), getattr(signal, sig))
            time.sleep(30)
        out.append("not interrupted")
    except KeyboardInterrupt as e:
        out.append(f"interrupted {e}")
print(json.dumps(out))
"""


def test_sigterm_and_sighup_keep_the_old_checkpoint(tmp_path):
    sigs = ["SIGTERM", "SIGHUP", "SIGINT"]
    olds, jobs = [], []
    for sig in sigs:
        dst = tmp_path / sig / "ck"
        with ShardedWriter(dst) as w:
            w.add("old", np.ones(3, np.float32))
        olds.append(_listing(dst))
        jobs.append((str(dst), sig))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _SIGNAL, json.dumps(jobs)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out[:2] == ["interrupted SIGTERM", "interrupted SIGHUP"] and out[2].startswith("interrupted"), out
    for sig, old in zip(sigs, olds):
        assert _listing(tmp_path / sig / "ck") == old and os.listdir(tmp_path / sig) == ["ck"], sig


def test_signal_handlers_are_restored(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    with ShardedWriter(tmp_path / "a") as w:
        w.add("a", np.zeros(1))
        if before[signal.SIGTERM] == signal.SIG_DFL:
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    assert {s: signal.getsignal(s) for s in before} == before
    with pytest.raises(RuntimeError), ShardedWriter(tmp_path / "b") as w:
        raise RuntimeError
    assert {s: signal.getsignal(s) for s in before} == before


# ---- dead writers' leftovers --------------------------------------------------------------------------------------
def test_dead_writers_leftovers_are_removed_by_a_writer_to_another_destination(tmp_path):
    host, dead, live = shard_writer._HOST, _dead_pid(), os.getppid()
    stale = tmp_path / f".x.tmp-{host}-{dead}-{'a' * 12}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"0" * 1000)
    foreign = tmp_path / f".y.tmp-{'0' * 8 if host != '0' * 8 else '1' * 8}-{dead}-{'b' * 12}"  # another host
    foreign.mkdir()
    alive = tmp_path / f".z.tmp-{host}-{live}-{'c' * 12}"  # a writer still running
    alive.mkdir()
    (tmp_path / ".x.lock").write_text(f"{host} {dead}\n")
    (tmp_path / ".z.lock").write_text(f"{host} {live}\n")
    aside = tmp_path / f".w.old-{host}-{dead}-{'d' * 12}"  # an old checkpoint renamed aside, no swap
    aside.mkdir()
    (aside / "keep").write_text("old")
    with ShardedWriter(tmp_path / "ck") as w:
        w.add("a", np.zeros(1))
    assert sorted(os.listdir(tmp_path)) == sorted(["ck", foreign.name, alive.name, ".z.lock", "w"])
    assert (tmp_path / "w" / "keep").read_text() == "old"
