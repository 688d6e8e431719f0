"""The autotuner picks the fastest working candidate; the cache round-trips through disk."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

import jattn
from jattn._src import backends
from jattn._src.gemm import api
from jattn._src.gemm.config import MatmulConfig, heuristic_config, search_space
from jattn._src.tuning import autotune, cache


def test_autotune_picks_fastest_and_skips_failures():
    def make_run(delay):
        if delay is None:
            raise RuntimeError("does not compile")
        return lambda: time.sleep(delay)

    best, timings = autotune.autotune([0.004, None, 0.0005, 0.002], make_run, desc="test")
    assert best == 0.0005
    assert timings[1][1] == float("inf")


def test_autotune_raises_when_everything_fails():
    with pytest.raises(RuntimeError, match="every candidate config failed"):
        autotune.autotune([None], lambda _: (_ for _ in ()).throw(RuntimeError()), desc="x")


def test_cache_round_trip_feeds_config_choice(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    interpret = backends.implementations("matmul")["interpret"]

    def choose(op="matmul", dtype=jnp.bfloat16):
        return api.choose_config(op, interpret, None, 1000, 1000, 1000, dtype)

    assert choose() == heuristic_config(1000, 1000, 1000, jnp.bfloat16)
    tuned = MatmulConfig(block_m=64, block_n=64, block_k=32, num_stages=5)
    # 1000 and 1024 share a shape bucket, so the tuned entry serves both.
    cache.store("matmul", api._cache_key(interpret, 1024, 1024, 1024, jnp.bfloat16),
                tuned.__dict__)
    assert choose() == tuned
    assert choose(dtype=jnp.float32) != tuned
    assert choose(op="mm_plus_mm") != tuned  # each op keeps its own tuning results
    xla = backends.implementations("matmul")["xla"]
    assert api._cache_key(xla, 1024, 1024, 1024, jnp.bfloat16) != api._cache_key(
        interpret, 1024, 1024, 1024, jnp.bfloat16)
    assert api._cache_key(interpret, 1024, 1024, 1024, jnp.float8_e4m3fn) != api._cache_key(
        interpret, 1024, 1024, 1024, jnp.float8_e4m3fn, fast_accum=True)
    assert (tmp_path / "autotune.json").exists()


def test_mm_plus_mm_autotune_times_mm_plus_mm(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    timed = []

    def one_candidate(candidates, make_run, *, desc):
        assert all(c.split_k == 1 for c in candidates)
        timed.append(jax.make_jaxpr(make_run(candidates[0]))())
        return candidates[0], [(candidates[0], 1.0)]

    monkeypatch.setattr(autotune, "autotune", one_candidate)
    a = jnp.ones((32, 16), jnp.float32)
    jattn.mm_plus_mm(a, a.T, a, a.T, config="autotune", implementation="interpret")
    assert "jattn_mm_plus_mm" in str(timed[0])
    assert list(json.loads((tmp_path / "autotune.json").read_text())) == ["mm_plus_mm"]


def test_bmm_autotune_times_the_whole_batch_and_keys_it(tmp_path, monkeypatch):
    """A bmm's tuning times its batch of products in one call and caches the winner apart
    from a single product's (a batch fills the GPU with smaller tiles)."""
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    timed = []

    def one_candidate(candidates, make_run, *, desc):
        timed.append(jax.make_jaxpr(make_run(candidates[0]))())
        return candidates[0], [(candidates[0], 1.0)]

    monkeypatch.setattr(autotune, "autotune", one_candidate)
    a, b = jnp.ones((6, 32, 16), jnp.float32), jnp.ones((6, 16, 8), jnp.float32)
    jattn.bmm(a, b, config="autotune", implementation="interpret")
    jattn.matmul(a[0], b[0], config="autotune", implementation="interpret")
    batched, single = (str(jaxpr) for jaxpr in timed)
    assert "f32[6,32,8]" in batched and "f32[6,32,8]" not in single
    stored = json.loads((tmp_path / "autotune.json").read_text())
    assert [key.endswith("|batch8") for key in stored["bmm"]] == [True]
    assert [key.endswith("|batch8") for key in stored["matmul"]] == [False]


@pytest.mark.parametrize("m,n,k,dtype", [(8192, 8192, 8192, jnp.bfloat16), (16, 8192, 8192,
                                          jnp.bfloat16), (100, 70, 90, jnp.float32)])
def test_search_space_is_valid_and_fits_shared_memory(m, n, k, dtype):
    space = search_space(m, n, k, dtype)
    assert len(space) == len(set(space)) > 4
    itemsize = jnp.dtype(dtype).itemsize
    assert all(c.shared_memory_bytes(itemsize) <= 227 * 1024 for c in space)
