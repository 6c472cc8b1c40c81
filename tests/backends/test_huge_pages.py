from __future__ import annotations

import gc
import pathlib
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.backends.cpu.huge_pages import (
    HUGE_PAGE,
    advise_huge_pages,
    advise_in_background,
    host_ranges,
    place_on_huge_pages,
    thp_enabled,
)


def anon_huge_bytes(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr, from /proc/self/smaps."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def test_ranges_are_whole_aligned_huge_pages_inside_the_buffer():
    x = jnp.arange(5 * HUGE_PAGE // 4, dtype=jnp.float32)  # 5 huge pages of bytes
    ptr, n = x.unsafe_buffer_pointer(), x.nbytes
    ranges = host_ranges([x, jnp.ones(16)])  # the small one holds no whole huge page
    assert len(ranges) == 1
    start, length = ranges[0]
    assert start % HUGE_PAGE == 0 and length % HUGE_PAGE == 0
    assert ptr <= start and start + length <= ptr + n
    assert length >= n - 2 * HUGE_PAGE + HUGE_PAGE  # all but the two partial ends


def test_collapsing_keeps_contents_and_backs_the_buffer_with_huge_pages():
    x = jax.random.normal(jax.random.key(0), (4 * HUGE_PAGE // 4 + 123,), jnp.float32)
    before = np.asarray(x).copy()
    done = advise_huge_pages(host_ranges([x]))
    np.testing.assert_array_equal(np.asarray(x), before)
    np.testing.assert_array_equal(np.asarray(x * 2), before * 2)  # XLA still reads it right
    if not thp_enabled():
        assert done == 0
        return
    assert done >= 3 * HUGE_PAGE
    assert anon_huge_bytes(host_ranges([x])[0][0]) >= done


def test_the_background_advice_holds_no_array():
    """The advice thread is a daemon: were it to drop the last reference to an array while the
    interpreter exits, the array's destructor would end the thread inside C++ and abort the
    process. It is given the arrays' addresses only."""
    x = jnp.zeros(8 * HUGE_PAGE // 4, jnp.float32)
    alive = weakref.ref(x)
    thread = advise_in_background([x])
    assert thread.ranges == host_ranges([x])
    del x
    gc.collect()
    assert alive() is None  # freed at once, whether or not the thread is still advising
    thread.join()


def test_the_weight_arena_aliases_xla_buffers_and_keeps_them_alive():
    xs = [jax.random.normal(jax.random.key(i), (1000 + 777 * i, 96), dt)
          for i, dt in enumerate([jnp.float32, jnp.bfloat16, jnp.float32])]
    xs.append(jnp.zeros((0, 4)))
    ref = [np.asarray(x).copy() for x in xs]
    ys, moved = place_on_huge_pages(xs)
    del xs
    gc.collect()
    junk = [np.ones(1 << 20) for _ in range(20)]  # reuse freed memory, were anything freed
    del junk
    for y, r in zip(ys, ref):
        assert y.dtype == r.dtype and y.shape == r.shape
        np.testing.assert_array_equal(np.asarray(y), r)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 2)(y)), r * 2)
    if not thp_enabled():
        assert moved == 0
        return
    assert moved == sum(r.nbytes for r in ref)
    first, last = ys[0].unsafe_buffer_pointer(), ys[2].unsafe_buffer_pointer()
    assert first % HUGE_PAGE == 0 and anon_huge_bytes(first) >= last - first


def device_buffers(arrays) -> dict[int, int]:
    """Each buffer behind the arrays, by address: one per shard (other tests in this process
    leave arrays split over several host devices alive)."""
    return {s.data.unsafe_buffer_pointer(): s.data.nbytes for a in arrays for s in a.addressable_shards}


@pytest.mark.skipif(not thp_enabled(), reason="no transparent huge pages on this system")
def test_the_engine_puts_its_kv_cache_and_weights_on_huge_pages(small_engine_options):
    # Arrays alive before (other tests' engines in this process), held so that none is freed
    # and its buffer reused meanwhile.
    before = jax.live_arrays()
    # Each layer's K and V pages at least two huge pages long, so that each holds a whole aligned
    # one wherever it starts (the tests' default budget, 1/8 GiB, gives the default model's
    # 60 arrays ~2.1 MiB each: most hold none).
    llm = LLM(**{**small_engine_options, "kv_cache_memory_bytes": 300 << 20})
    runner = llm.engine.runner
    runner.host_placement.join()
    advised = sum(n for _, n in host_ranges([*runner.params, *runner.kv.k, *runner.kv.v]))
    # A host whose memory is fragmented (a long test run) may lack free huge pages for some of
    # them, at the arena's first touch as at the collapse: those the advice reported it could not
    # collapse stay small, in the cache as among the weights.
    not_collapsed = advised - runner.host_placement.collapsed
    start, length = max(host_ranges(runner.kv.k), key=lambda r: r[1])
    assert anon_huge_bytes(start) >= length - not_collapsed
    weights = [x.unsafe_buffer_pointer() for x in runner.params]
    lo, hi = min(weights), max(weights)  # one arena: every weight in one huge-page mapping
    assert anon_huge_bytes(lo) >= hi - lo - HUGE_PAGE - not_collapsed
    # XLA's own copies of the moved weights are gone: no weight is held twice.
    held = device_buffers(jax.live_arrays())
    ours = set(device_buffers([*runner.params, *runner.kv.k, *runner.kv.v, *before]))
    weight_bytes = sum(x.nbytes for x in runner.params)
    assert sum(n for p, n in held.items() if p not in ours) < 0.1 * weight_bytes
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
