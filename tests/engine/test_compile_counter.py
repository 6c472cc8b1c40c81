from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.runner.compile import CompileCounter


def test_counts_only_its_own_compilations():
    a, b = CompileCounter(), CompileCounter()
    with a.active():
        jax.jit(lambda x: x * 3 + 1)(jnp.ones(3)).block_until_ready()
    assert a.num_compiles >= 1 and b.num_compiles == 0
    a.mark_warm()
    jax.jit(lambda x: x - 7)(jnp.ones(5)).block_until_ready()  # outside any engine: not counted
    assert a.recompiles == 0
    with a.active():
        jax.jit(lambda x: x * 11)(jnp.ones(7)).block_until_ready()
    assert a.recompiles >= 1 and b.num_compiles == 0
