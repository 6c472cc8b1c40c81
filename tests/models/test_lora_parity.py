"""LoRA products of tiny random Llama, Qwen3 and Gemma 3 models equal transformers + peft with
the adapter merged (float32 log-probs, 1e-4): three adapters and the base model in one ragged
batch, each row reading its own slot of the runner's LoRA slots.

The adapters and expected logits come from scripts/make_lora_fixtures.py; no torch here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxserve.config import LoRAConfig
from jaxserve.lora_request import LoRARequest
from jaxserve.models.layers.lora import LoRABatch
from jaxserve.models.sharding import single_device_mesh
from jaxserve.models.weights import create_model
from jaxserve.parallel.mesh import make_mesh
from jaxserve.runner.executable_cache import executable_scope
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.runner.lora_weights import LoRAWeights
from jaxserve.runner.step_inputs import StepRequest, pack_step
from tests.models.test_arch_parity import load_fixture

ADAPTERS = ("a", "b", "c")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("arch, tp", [("llama", 1), ("qwen3", 1), ("gemma3", 1), ("llama", 2)])
def test_mixed_batch_matches_merged_peft(arch, tp, data_dir):
    """tp=2: on two simulated devices, A and B split like the weights they adapt."""
    cfg, tensors, base = load_fixture(data_dir, arch)
    mesh = single_device_mesh() if tp == 1 else make_mesh(1, tp)
    model = create_model(cfg, dtype=jnp.float32, get_tensor=tensors.__getitem__, mesh=mesh)
    slots = LoRAWeights(
        cfg, LoRAConfig(enable_lora=True, max_loras=3, max_lora_rank=8), jnp.float32, mesh
    )
    if tp > 1:  # q_proj's B [S, R, Hq, D] over its heads, o_proj's A [S, Hq, D, R] too
        specs = {str(sh.spec) for sh in slots.shardings}
        assert "P(None, None, 'model', None)" in specs
        assert "P(None, 'model', None, None)" in specs
    slots.compile_writer(
        executable_scope(None, mesh.devices.flat), jax.sharding.NamedSharding(mesh, jax.P())
    )
    leaves = slots.zeros()
    expected = {}
    for slot, name in enumerate(ADAPTERS, start=1):
        path = data_dir / "lora" / arch / name
        leaves = slots.write(leaves, slot, slots.host_copy(LoRARequest(name, slot, str(path))))
        expected[slot] = load_file(str(path / "expected.safetensors"))
    tokens = expected[1]["tokens"].tolist()
    rows = [3, 0, 1, 2]  # each row's slot: adapters c, none, a, b
    reqs = [StepRequest(tokens, 0, list(range(1 + 4 * i, 5 + 4 * i))) for i in range(len(rows))]
    inputs = jax.tree.map(
        jnp.asarray, pack_step(reqs, num_tokens=64, num_reqs=4, pages_per_req=4, page_size=4)
    )
    kv = allocate_kv_cache(cfg, 1 + 4 * len(rows), 4, jnp.float32, mesh)
    token_slots = jnp.asarray(
        np.repeat(rows, len(tokens)).tolist() + [0] * (64 - len(rows) * len(tokens))
    )
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, kv, inputs, leaves, token_slots):
        m = nnx.merge(graphdef, state)
        lora = LoRABatch.of(jax.tree.unflatten(slots.treedef, leaves), token_slots)
        h, _ = m(inputs.input_ids, inputs.positions, kv, inputs.md, lora=lora)
        return m.compute_logits(h)

    logits = np.asarray(forward(state, kv, inputs, leaves, token_slots))
    n = len(tokens)
    for i, slot in enumerate(rows):
        want = base["logits_0"][:n] if slot == 0 else expected[slot]["logits"]
        np.testing.assert_allclose(
            _log_softmax(logits[i * n : (i + 1) * n]),
            _log_softmax(want),
            atol=1e-4,
            rtol=0,
            err_msg=f"{arch} row {i}",
        )
        if slot:  # the adapter changes the model
            assert np.abs(want - base["logits_0"][:n]).max() > 1e-2
