"""`lora_delta`, the LoRA term of a product, against the per-token definition
x[t] @ A[slot_t] @ B[slot_t] (zero for a token of the base model), for each kind of spec the
layers use: one input and one output dim, several output dims (q/k/v), several input dims (o)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers.lora import LoRABatch, lora_delta


@pytest.mark.parametrize("spec, in_shape, out_shape", [
    ("te,ef->tf", (6,), (10,)),
    ("te,ehd->thd", (6,), (3, 4)),
    ("thd,hde->te", (3, 4), (6,)),
])
def test_each_token_gets_its_own_slots_product(spec, in_shape, out_shape):
    T, S, R = 7, 3, 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, *in_shape)).astype(np.float32)
    a = rng.standard_normal((S, *in_shape, R)).astype(np.float32)
    b = rng.standard_normal((S, R, *out_shape)).astype(np.float32)
    slots = np.array([1, 3, 0, 2, 2, 3, 1], np.int32)  # 0: the base model
    onehot = LoRABatch.of([{"w": (a, b)}], jnp.asarray(slots)).onehot
    got = np.asarray(lora_delta(spec, jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), onehot))
    want = np.zeros((T, *out_shape), np.float32)
    for t, s in enumerate(slots):
        if s:
            xa = x[t].reshape(-1) @ a[s - 1].reshape(-1, R)
            want[t] = (xa @ b[s - 1].reshape(R, -1)).reshape(out_shape)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
