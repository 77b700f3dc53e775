"""Seeded fuzz of GGUF headers and calibration files: a few hundred mutated files, each read completely in a
child process under an address-space cap (RLIMIT_AS) and a per-case alarm. Every outcome must be a typed error
(a QFormatsError subclass) or a correct result -- never another exception, a hang or unbounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent

_DRIVER = r"""
import json, os, random, resource, signal, struct, sys, traceback
from pathlib import Path
import numpy as np
from gguf_tiny import tiny_gguf
from converters.evaluation.calibration_data import load_calibration
from converters.formats.gguf_convert import check_gguf_header, open_gguf
from qformats.errors import QFormatsError

work, seed, n_gguf, n_calib = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
base = tiny_gguf(work / "base.gguf", inter=64).read_bytes()
header_end = check_gguf_header(work / "base.gguf").data_offset
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # after the imports: the cases get 3 GiB in all

def on_alarm(signum, frame):
    raise TimeoutError("case took over 10 s")
signal.signal(signal.SIGALRM, on_alarm)

EXTREME = [0, 1, 2, 3, 4, 8, 9, 12, 31, 32, 255, 2**31 - 1, 2**32 - 1, 2**32, 2**40, 2**63 - 1, 2**63, 2**64 - 1]

def mutate_gguf(data):
    data = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.choice(["u64", "u32", "byte", "cut", "insert", "delete", "tail"])
        at = rng.randrange(4, header_end)
        if kind == "u64" and at + 8 <= len(data):
            data[at:at + 8] = struct.pack("<Q", rng.choice(EXTREME))
        elif kind == "u32" and at + 4 <= len(data):
            data[at:at + 4] = struct.pack("<I", rng.choice(EXTREME) & 0xFFFFFFFF)
        elif kind == "byte":
            data[at] = rng.randrange(256)
        elif kind == "cut":
            del data[rng.randrange(0, len(data)):]
        elif kind == "insert":
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8])))
        elif kind == "delete":
            del data[at:at + rng.choice([1, 4, 8])]
        else:
            data += bytes(rng.choice([1, 31, 32, 64]))
    return bytes(data)

def read_gguf(path):
    m = open_gguf(path)
    for name in m.keys():
        a = m.get(name)
        assert a.shape == m.shape(name) and a.dtype == np.float32, name
    m.tokenizer_files()
    json.dumps(m.config, allow_nan=False)  # a config that can be written as strict JSON
    return "ok"

def mutate_text(kind):
    pieces = ["hello world", "{", "}", "[", "]", '"', "\\", "\\ud800", "\\udc00", "\n", "\r", "\r\n", ":", ",",
              "text", '"text"', "null", "1e999", "NaN", "\xff", "\x00", "é", "[" * 300]
    if kind == "jsonl":
        lines = []
        for _ in range(rng.randrange(1, 8)):
            if rng.random() < 0.5:
                lines.append(json.dumps({"text": "".join(rng.choice(pieces[:1] + pieces[21:22]) for _ in range(3))}))
            else:
                lines.append('{"text": "' + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6))) + '"}')
        raw = "\n".join(lines).encode("utf-8", "surrogatepass")
    else:
        raw = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40))).encode("utf-8", "surrogatepass")
    if rng.random() < 0.3:
        raw = bytearray(raw)
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        raw = bytes(raw)
    return raw

def mutate_npy():
    a = np.arange(rng.randrange(1, 40), dtype=rng.choice([np.int8, np.int32, np.int64, np.uint16]))
    if rng.random() < 0.3:
        a = a.reshape(1, -1)
    p = work / "tmp.npy"
    np.save(p, a)
    data = bytearray(p.read_bytes())
    for _ in range(rng.choice([1, 2])):
        kind = rng.choice(["byte", "cut", "shape", "descr", "len"])
        if kind == "byte":
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == "cut":
            del data[rng.randrange(len(data)):]
        elif kind == "shape":
            data = bytearray(bytes(data).replace(b"'shape': (", b"'shape': (" + str(rng.choice(EXTREME)).encode()
                                                 + b", ", 1))
        elif kind == "descr":
            junk = rng.choice([b"O", b"|", b">", b"V"])
            data = bytearray(bytes(data).replace(b"'descr': '", b"'descr': '" + junk, 1))
        else:
            data[8:10] = struct.pack("<H", rng.randrange(65536))
    return bytes(data)

def check_calib(samples, seq_len, budget):
    assert all(s.dtype == np.int32 and 1 <= len(s) <= seq_len for s in samples)
    assert sum(len(s) for s in samples) <= budget
    return "ok"

results = []
cases = [("gguf", i) for i in range(n_gguf)] + [(rng.choice(["txt", "jsonl", "npy"]), i) for i in range(n_calib)]
for kind, i in cases:
    try:
        if kind == "gguf":
            path = work / f"case{i}.gguf"
            path.write_bytes(mutate_gguf(base))
        else:
            path = work / f"case{i}.{kind}"
            path.write_bytes(mutate_npy() if kind == "npy" else mutate_text(kind))
    except Exception as e:  # a generator bug, not a finding
        results.append([kind, i, "SKIP " + repr(e)[:200]])
        continue
    signal.alarm(10)
    try:
        if kind == "gguf":
            outcome = read_gguf(path)
        else:
            seq_len, budget = rng.choice([(4, 16), (8, 64), (1, 3)])
            outcome = check_calib(load_calibration(path, lambda s: [ord(c) % 1000 for c in s], seq_len=seq_len,
                                                   max_tokens=budget, seed=rng.choice([None, 0])), seq_len, budget)
    except QFormatsError as e:
        outcome = "typed" if str(path) in str(e) or kind != "gguf" else "UNNAMED " + str(e)[:300]
    except BaseException as e:
        outcome = "OTHER " + "".join(traceback.format_exception(type(e), e, e.__traceback__))[-1500:]
    finally:
        signal.alarm(0)
    results.append([kind, i, outcome])
    path.unlink()
print(json.dumps(results))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_mutated_gguf_and_calibration_files_are_typed_errors_or_read(tmp_path, seed):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _DRIVER, str(tmp_path), str(seed), "150", "100"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(results) == 250
    bad = [r for r in results if r[2] not in ("ok", "typed") and not r[2].startswith("SKIP")]
    assert not bad, "\n\n".join(f"{k} case {i}: {o}" for k, i, o in bad[:5])
    kinds = {(k, o) for k, _, o in results}
    assert ("gguf", "typed") in kinds and ("gguf", "ok") in kinds  # the mutations both break and spare files
