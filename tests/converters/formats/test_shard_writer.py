"""ShardedWriter: sharding and the index, the planned (streaming) mode, extra files, atomic finish, overwrite,
errors, and a writer killed (SIGKILL) at each step of a multi-shard write."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from converters.formats.safetensors_io import INDEX_FILE, SINGLE_FILE, open_checkpoint, read_json, save_file
from converters.formats.shard_writer import ShardedWriter, TensorSpec
from qformats.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[3]


def _bits(a):
    a = np.asarray(a)
    return np.ascontiguousarray(a).view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")


def _tensors():
    t = {f"layer.{i}.w": np.full((4, 8), i, np.float32) for i in range(5)}  # 128 bytes each
    t["head"] = np.arange(100, dtype=np.float32)  # 400 bytes: larger than a shard, gets its own
    t["tiny"] = np.arange(3, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return t


def _plan(tensors):
    return [TensorSpec(name, a.dtype, a.shape) for name, a in tensors.items()]


def _hidden(parent):
    return sorted(p for p in os.listdir(parent) if p.startswith("."))


def _listing(d):
    return {p.name: p.read_bytes() for p in Path(d).iterdir()}


# -- shards and the index ----------------------------------------------------------------------------


@pytest.mark.parametrize("planned", [False, True], ids=["buffered", "planned"])
def test_sharded_write_and_read(tmp_path, planned):
    tensors = _tensors()
    with ShardedWriter(tmp_path / "ckpt", max_shard_size=300, metadata={"format": "pt"},
                       plan=_plan(tensors) if planned else None) as w:
        for name, a in tensors.items():
            w.add(name, a)
        assert not (tmp_path / "ckpt").exists()  # nothing at dst until finish
    names = sorted(os.listdir(tmp_path / "ckpt"))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert names == sorted([*shards, INDEX_FILE]) and len(shards) == 5
    assert shards[0] == "model-00001-of-00005.safetensors"
    assert _hidden(tmp_path) == []
    index = read_json(tmp_path / "ckpt" / INDEX_FILE)
    assert index["metadata"] == {"total_size": 5 * 128 + 400 + 3}
    assert set(index["weight_map"]) == set(tensors)
    # one shard's tensors at a time, in insertion order: layer.0/1 | layer.2/3 | layer.4 | head | tiny
    wm = index["weight_map"]
    assert wm["layer.0.w"] == wm["layer.1.w"] == shards[0] and wm["layer.2.w"] == wm["layer.3.w"] == shards[1]
    assert (wm["layer.4.w"], wm["head"], wm["tiny"]) == tuple(shards[2:])
    with open_checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.keys() == sorted(tensors) and len(ckpt.files) == 5
        assert ckpt.metadata == {"format": "pt"}
        for name, want in tensors.items():
            np.testing.assert_array_equal(_bits(ckpt.get(name)), _bits(want))
            assert ckpt.file_of(name).name == wm[name]
            assert ckpt.info(name).shape == want.shape


@pytest.mark.parametrize("planned", [False, True], ids=["buffered", "planned"])
def test_single_shard_is_save_file_bytes(tmp_path, planned):
    # In safetensors' order (descending dtype rank, then name) both modes write save_file's exact bytes.
    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(4, np.float32),
               "i": np.arange(5, dtype=np.int8), "h": np.zeros(3, ml_dtypes.bfloat16)}
    order = ["a", "b", "h", "i"]  # F32 > BF16 > I8
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    plan = [TensorSpec(n, tensors[n].dtype, tensors[n].shape) for n in order] if planned else None
    w = ShardedWriter(tmp_path / "one", metadata={"format": "pt"}, plan=plan)
    for n in order:
        w.add(n, tensors[n])
    assert w.finish() == [tmp_path / "one" / SINGLE_FILE]
    assert os.listdir(tmp_path / "one") == [SINGLE_FILE]
    assert (tmp_path / "one" / SINGLE_FILE).read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("planned", [False, True], ids=["buffered", "planned"])
def test_empty_checkpoint(tmp_path, planned):
    with ShardedWriter(tmp_path / "e", plan=[] if planned else None):
        pass
    assert os.listdir(tmp_path / "e") == [SINGLE_FILE]
    with open_checkpoint(tmp_path / "e") as ck:
        assert ck.keys() == []


def test_planned_mode_streams_each_tensor_to_disk(tmp_path):
    a, b = np.arange(64, dtype=np.float32), np.arange(64, dtype=np.int32)
    w = ShardedWriter(tmp_path / "s", plan=[TensorSpec("a", a.dtype, a.shape), TensorSpec("b", b.dtype, b.shape)])
    w.add("a", a)
    assert _hidden(tmp_path) == [".s.lock", *(n for n in _hidden(tmp_path) if ".s.tmp-" in n)]  # the lock, the temp dir
    (tmp,) = [tmp_path / n for n in _hidden(tmp_path) if ".s.tmp-" in n]
    (part,) = list(tmp.iterdir())
    assert part.name == SINGLE_FILE
    # the header (both tensors) and a's bytes are written before b arrives
    size = part.stat().st_size
    assert size > 256 and size == 8 + int.from_bytes(part.read_bytes()[:8], "little") + 256
    assert part.read_bytes()[-256:] == a.tobytes()
    assert w.next_name == "b"
    w.add("b", b)
    w.finish()
    with open_checkpoint(tmp_path / "s") as ck:
        np.testing.assert_array_equal(ck.get("b"), b)


def test_planned_mode_errors(tmp_path):
    a = np.zeros(4, np.float32)
    plan = [TensorSpec("x", np.float32, (4,)), TensorSpec("y", np.float32, (4,))]
    for bad_plan, needle in [([TensorSpec("x", np.float32, (4,))] * 2, "'x' twice"),
                             ([TensorSpec("x", np.complex128, (4,))], "complex128"),
                             ([TensorSpec("x", ml_dtypes.float4_e2m1fn, (3,))], "whole bytes"),
                             ([TensorSpec("__metadata__", np.float32, (1,))], "__metadata__"),
                             ([("x", np.float32)], "name, dtype, shape")]:
        with pytest.raises(CheckpointError, match=needle):
            ShardedWriter(tmp_path / "p", plan=bad_plan)
    with pytest.raises(CheckpointError, match="metadata"):
        ShardedWriter(tmp_path / "p", metadata={"k": 1})
    assert os.listdir(tmp_path) == []  # refused before anything is created
    for name, arr, needle in [("y", a, "expected tensor 'x'.*found 'y'"),
                              ("x", np.zeros(4, np.float16), "F32 \\[4\\] next, found 'x' F16"),
                              ("x", np.zeros(5, np.float32), "\\[4\\] next, found 'x' F32 \\[5\\]")]:
        w = ShardedWriter(tmp_path / "p", plan=plan)
        with pytest.raises(CheckpointError, match=needle):
            w.add(name, arr)
        w.abort()
    w = ShardedWriter(tmp_path / "p", plan=plan)
    w.add("x", a)
    with pytest.raises(CheckpointError, match="expected 2 planned tensors, found 1 written \\(next: 'y'\\)"):
        w.finish()
    assert os.listdir(tmp_path) == []  # a failed finish removes the temp directory
    with ShardedWriter(tmp_path / "p", plan=plan) as w:
        w.add("x", a)
        w.add("y", a)
        with pytest.raises(CheckpointError, match="no more tensors"):
            w.add("z", a)
    assert sorted(open_checkpoint(tmp_path / "p").keys()) == ["x", "y"]


# -- other files ---------------------------------------------------------------------------------------


def test_json_and_extra_files(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name in ["tokenizer.json", "config.json", "model.safetensors", "pytorch_model.bin", "x.pt", "y.pth",
                 "model.safetensors.index.json", ".hidden", "README.md", "sub/vocab.txt"]:
        (src / name).write_text(name)
    with ShardedWriter(tmp_path / "dst") as w:
        w.add("a", np.zeros(2, np.float32))
        assert w.add_json("config.json", {"b": [1, 2], "a": None}) == tmp_path / "dst/config.json"
        w.add_file("README.md", "ours")
        assert w.copy_extra_files(src) == ["sub", "tokenizer.json"]
        assert w.copy_extra_files(tmp_path / "missing") == [] and w.copy_extra_files(None) == []
        for bad, needle in [("config.json", "added twice"), ("tokenizer.json", "added twice"),
                            ("a/b.json", "plain file name"), (".x", "plain file name"), ("..", "plain file name"),
                            ("", "plain file name"), ("w.safetensors", "weights file"), (INDEX_FILE, "weights file")]:
            with pytest.raises(CheckpointError, match=needle):
                w.add_file(bad, "x")
        with pytest.raises(CheckpointError, match="expected str or bytes to write, found int"):
            w.add_file("n.txt", 5)
        with pytest.raises(CheckpointError, match="JSON-serializable"):
            w.add_json("bad.json", {"a": object()})
    assert sorted(os.listdir(tmp_path / "dst")) == sorted(["README.md", "config.json", SINGLE_FILE, "sub",
                                                           "tokenizer.json"])
    assert (tmp_path / "dst/config.json").read_text() == json.dumps({"b": [1, 2], "a": None}, indent=2,
                                                                    sort_keys=True)
    assert (tmp_path / "dst/README.md").read_text() == "ours"
    assert (tmp_path / "dst/sub/vocab.txt").read_text() == "sub/vocab.txt"


# -- atomicity, overwrite, errors -----------------------------------------------------------------------


def test_abort_and_exceptions_leave_nothing(tmp_path):
    w = ShardedWriter(tmp_path / "one", max_shard_size="1MB")
    w.add("a", np.zeros(3))
    with pytest.raises(CheckpointError, match="'a'"):
        w.add("a", np.zeros(3))
    w.finish()
    with pytest.raises(CheckpointError, match="finish: expected an open writer, found it finished"):
        w.finish()
    with pytest.raises(CheckpointError) as e:
        ShardedWriter(tmp_path / "one")
    assert str(tmp_path / "one") in str(e.value) and "overwrite=True" in str(e.value)
    with pytest.raises(ValueError), ShardedWriter(tmp_path / "aborted", max_shard_size=8) as w:
        w.add("x", np.zeros(4))
        w.add("y", np.zeros(4))  # the first shard is on disk (in the temp directory) now
        w.add_json("config.json", {})
        raise ValueError("boom")
    assert sorted(os.listdir(tmp_path)) == ["one"]
    with pytest.raises(CheckpointError, match="aborted"):
        w.add("z", np.zeros(1))
    w.abort()  # a second abort does nothing


def test_overwrite_keeps_the_old_checkpoint_until_finish(tmp_path):
    dst = tmp_path / "ck"
    with ShardedWriter(dst) as w:
        w.add("old", np.ones(3, np.float32))
        w.add_json("config.json", {"v": 1})
    old = _listing(dst)
    with pytest.raises(RuntimeError), ShardedWriter(dst, overwrite=True) as w:
        w.add("new", np.zeros(3, np.float32))
        raise RuntimeError
    assert _listing(dst) == old and _hidden(tmp_path) == []
    w = ShardedWriter(dst, max_shard_size=8, overwrite=True)
    for i in range(3):
        w.add(f"new{i}", np.full(2, i, np.float32))
        assert _listing(dst) == old
    w.add_json("config.json", {"v": 2})
    assert _listing(dst) == old
    w.finish()
    assert sorted(os.listdir(dst)) == sorted(["config.json", INDEX_FILE, *(f"model-0000{i}-of-00003.safetensors"
                                                                             for i in (1, 2, 3))])
    assert read_json(dst / "config.json") == {"v": 2} and _hidden(tmp_path) == []
    # a file at dst is replaced as well; an empty directory is taken without overwrite
    (tmp_path / "f").write_text("x")
    with ShardedWriter(tmp_path / "f", overwrite=True) as w:
        w.add("a", np.zeros(1))
    assert os.listdir(tmp_path / "f") == [SINGLE_FILE]
    (tmp_path / "empty").mkdir()
    with ShardedWriter(tmp_path / "empty") as w:
        w.add("a", np.zeros(1))
    assert os.listdir(tmp_path / "empty") == [SINGLE_FILE]


def test_errors_are_checkpoint_errors_naming_the_path(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot create a temp directory"):
        ShardedWriter(tmp_path / "file" / "ck")
    # dst appears while writing (another writer): refused, nothing of ours left
    w = ShardedWriter(tmp_path / "race")
    w.add("a", np.zeros(1))
    (tmp_path / "race").mkdir()
    (tmp_path / "race/theirs").write_text("x")
    with pytest.raises(CheckpointError, match="race: expected a new path.*created while writing"):
        w.finish()
    assert os.listdir(tmp_path / "race") == ["theirs"] and _hidden(tmp_path) == []

    def failing_rename(a, b):
        raise OSError(5, "Input/output error")

    w = ShardedWriter(tmp_path / "io")
    w.add("a", np.zeros(1))
    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(CheckpointError) as e:
        w.finish()
    assert str(tmp_path / "io") in str(e.value) and "Input/output error" in str(e.value)
    assert not (tmp_path / "io").exists() and _hidden(tmp_path) == []


# -- a writer killed part-way ---------------------------------------------------------------------------

# Runs each scenario in a forked child that SIGKILLs itself at the chosen step; prints the wait statuses.
# (A fresh interpreter, so the fork happens before any JAX backend starts threads.)
_DRIVER = r"""
import ctypes, json, os, shutil, signal, sys
import numpy as np
from converters.formats.shard_writer import ShardedWriter, TensorSpec

TENSORS = {f"t{i}": np.full((64,), i, np.float32) for i in range(6)}  # 256 bytes each: 3 shards of 2

def run(dst, mode, overwrite, event, at):
    calls = {"n": 0}
    def hook(kind, fn):
        def wrapped(*a, **k):
            if kind == event:
                calls["n"] += 1
                if calls["n"] == at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*a, **k)
        return wrapped
    os.fsync = hook("fsync", os.fsync)
    os.rename = hook("rename", os.rename)
    shutil.rmtree = hook("rmtree", shutil.rmtree)
    if mode == "fallback":  # no renameat2: the rename-aside path
        def no_libc(*a, **k):
            raise OSError("no libc")
        ctypes.CDLL = no_libc
    array = hook("array", np.asarray)
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in TENSORS.items()] if mode == "planned" else None
    with ShardedWriter(dst, 600, overwrite=overwrite, plan=plan) as w:
        for name, a in TENSORS.items():
            w.add(name, array(a))
        w.add_json("config.json", {"new": True})

statuses = []
for dst, mode, overwrite, event, at in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        try:
            run(dst, mode, overwrite, event, at)
        finally:
            os._exit(3)
    statuses.append(os.waitpid(pid, 0)[1])
print(json.dumps(statuses))
"""

# (event, n-th call) -> what dst holds right after the kill: the write had not committed ("before") or had
# ("new"). Both modes make 7 fsyncs: 3 shards + config.json + the index + the temp directory, then (after
# the rename into place) the parent directory.
_POINTS = [(("array", 1), "before"), (("array", 4), "before"), *((("fsync", k), "before") for k in range(1, 7)),
           (("fsync", 7), "new")]


def _new_reference(tmp_path):
    refs = {}
    for mode in ("buffered", "planned"):
        tensors = {f"t{i}": np.full((64,), i, np.float32) for i in range(6)}
        plan = [TensorSpec(n, a.dtype, a.shape) for n, a in tensors.items()] if mode == "planned" else None
        with ShardedWriter(tmp_path / "ref" / mode, 600, plan=plan) as w:
            for name, a in tensors.items():
                w.add(name, a)
            w.add_json("config.json", {"new": True})
        refs[mode] = _listing(tmp_path / "ref" / mode)
        assert len([n for n in refs[mode] if n.endswith(".safetensors")]) == 3
    refs["fallback"] = refs["buffered"]
    return refs


def _write_old(dst):
    with ShardedWriter(dst, 300) as w:
        for i in range(3):
            w.add(f"old{i}", np.full((50,), -i, np.float32))
        w.add_json("config.json", {"old": True})
    return _listing(dst)


def test_killed_writer_leaves_the_old_checkpoint_or_nothing(tmp_path):
    new = _new_reference(tmp_path)
    scenarios, expect, olds = [], [], {}
    for mode in ("buffered", "planned"):
        for overwrite in (False, True):
            for (event, at), when in _POINTS:
                scenarios.append((mode, overwrite, event, at))
                expect.append(when)
    # overwriting: killed after the atomic swap, before the old checkpoint is deleted -> the new one is there
    scenarios += [("buffered", True, "rmtree", 1), ("planned", True, "rmtree", 1)]
    expect += ["new", "new"]
    # no atomic swap: killed between renaming the old checkpoint aside and the new one in -> nothing at dst
    # (the next writer puts the old one back)
    scenarios.append(("fallback", True, "rename", 2))
    expect.append("aside")
    jobs = []
    for i, (mode, overwrite, event, at) in enumerate(scenarios):
        dst = tmp_path / f"s{i}" / "ck"
        dst.parent.mkdir()
        if overwrite:
            olds[i] = _write_old(dst)
        jobs.append((str(dst), mode, overwrite, event, at))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(jobs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    statuses = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(statuses) == len(jobs)
    for i, ((mode, overwrite, event, at), when, status) in enumerate(zip(scenarios, expect, statuses)):
        what = f"{mode} overwrite={overwrite} killed at {event} #{at}"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, f"{what}: not killed (status {status})"
        dst = tmp_path / f"s{i}" / "ck"
        if when == "new":
            assert _listing(dst) == new[mode], what
        elif when == "aside" or not overwrite:
            assert not dst.exists(), f"{what}: {os.listdir(dst) if dst.is_dir() else 'a file'}"
        else:
            assert _listing(dst) == olds[i], what
        # a temp directory is left behind, except when killed after the commit and the clean-up
        assert bool(_hidden(dst.parent)) == (event != "fsync" or at != 7), what
        if when == "aside":
            # the next writer restores the old checkpoint first, so a plain write is refused ...
            with pytest.raises(CheckpointError, match="exists"):
                ShardedWriter(dst)
            assert _listing(dst) == olds[i] and _hidden(dst.parent) == [], what
        # ... and a new write to the same destination works and removes the stale temp directories
        with ShardedWriter(dst, overwrite=True) as w:
            w.add("again", np.arange(3, dtype=np.float32))
        assert os.listdir(dst) == [SINGLE_FILE] and os.listdir(dst.parent) == ["ck"], what
