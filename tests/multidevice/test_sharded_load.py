"""Checkpoints loaded onto an 8-device CPU mesh (fresh interpreters): parameters equal the single-device load,
host memory bounded by one shard, and 2 jax.distributed processes x 4 devices each reading half the bytes."""

import pytest

from run_worker import run_case, run_processes

pytestmark = pytest.mark.slow  # a fresh multi-device interpreter per module fixture


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    wd = tmp_path_factory.mktemp("sharded_load")
    return wd, run_case("load", 8, wd)


@pytest.mark.parametrize("name", ["dense", "w4", "nvfp4"])
def test_sharded_load_equals_the_single_device_load(loaded, name):
    r = loaded[1][name]
    assert r["same"], r
    assert r["sharded"] >= 14  # 7 projections x 2 layers (+ embedding, lm_head) split over the mesh


def test_transient_host_memory_of_a_sharded_load_is_bounded_by_one_shard(loaded):
    r = run_case("memory", 8, loaded[0])
    # the measurement sees the placed arrays (RssAnon grew by about their bytes) ...
    assert r["after"] >= 0.8 * r["placed"], r
    assert r["placed"] >= r["file_bytes"] * 0.99  # every tensor placed (norms replicated 8 times on top)
    # ... and nothing beyond them but at most one shard on the host at a time
    assert r["largest_slice"] == 8192 * 512 * 4 // 8
    assert r["transient"] <= 1.2 * r["largest_slice"], r


def test_two_processes_read_their_own_shards_and_match_one_process(loaded):
    res = run_processes("multiprocess", 4, loaded[0], processes=2)
    for r in res:
        assert (r["global_devices"], r["local_devices"]) == (8, 4)
        for name in ("dense", "w4"):
            x = r[name]
            # each process read about half the stored bytes: its 4 devices' shards (norms read per device)
            assert 0.45 * x["file_bytes"] <= x["bytes_read"] <= 0.55 * x["file_bytes"], x
            # same logits up to the all-reduce's summation order
            assert x["max_abs_diff"] <= 1e-5 and x["argmax_equal"], x
    assert res[0]["dense"]["bytes_read"] == res[1]["dense"]["bytes_read"]
