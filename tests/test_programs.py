"""The program caches: bounded, least recently used dropped first, one program per key."""

import threading

from jattn._src.programs import ProgramCache


def test_least_recently_used_is_dropped():
    cache = ProgramCache("test", maxsize=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)


def test_first_program_stored_wins_across_threads():
    cache = ProgramCache("test")
    barrier = threading.Barrier(8)
    stored = []

    def make(i):
        barrier.wait()
        stored.append(cache.put("key", f"program {i}"))

    threads = [threading.Thread(target=make, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(stored)) == 1 and cache.get("key") == stored[0]


def test_clear_caches_empties_every_registered_cache():
    import jax.numpy as jnp

    import jattn
    from jattn._src.programs import cache_names

    q = jnp.ones((1, 2, 32, 16))
    jattn.flex_attention(q, q, q, jattn.mods.alibi(jnp.ones(2)))
    assert {"flex_attention.programs", "index_bounds.checked"} <= set(cache_names())
    from jattn._src.attention import api
    assert len(api._PROGRAMS) > 0
    jattn.clear_caches()
    assert len(api._PROGRAMS) == 0
    assert jattn.flex_attention(q, q, q).shape == q.shape  # and calls work on
