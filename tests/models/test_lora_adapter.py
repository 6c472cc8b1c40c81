"""PEFT adapter directories: what is served (targets, rank, scaling, rsLoRA) and what is refused
by name (DoRA, unknown modules, a rank above the maximum, layers the model lacks)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.lora import LoRAAdapterError, load_adapter, read_config


@pytest.fixture()
def cfg(data_dir):
    return ArchConfig.from_hf(json.loads((data_dir / "arch" / "llama" / "config.json").read_text()))


def _copy(data_dir, tmp_path, name="b"):
    dst = tmp_path / name
    shutil.copytree(data_dir / "lora" / "llama" / name, dst)
    return dst


def _edit_config(path, **changes):
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))


def test_weights_in_our_layout_with_rslora_scale(data_dir, cfg):
    path = data_dir / "lora" / "llama" / "b"  # r=8, alpha=16, rsLoRA: q, v, gate, up, down
    adapter = load_adapter(path, cfg, max_rank=8)
    assert adapter.rank == 8 and adapter.scale == pytest.approx(16 / math.sqrt(8))
    assert {t for _, t in adapter.weights} == {"wq", "wv", "w_gate", "w_up", "w_down"}
    raw = load_file(str(path / "adapter_model.safetensors"))
    a, b = adapter.weights[(1, "wq")]
    assert a.shape == (64, 8) and b.shape == (8, 4, 16)  # [E, r] and [r, Hq, D]
    pre = "base_model.model.model.layers.1.self_attn.q_proj"
    np.testing.assert_allclose(a, raw[f"{pre}.lora_A.weight"].T)
    np.testing.assert_allclose(
        b.reshape(8, 64), raw[f"{pre}.lora_B.weight"].T * adapter.scale, rtol=1e-6
    )
    plain = load_adapter(data_dir / "lora" / "llama" / "a", cfg, max_rank=8)  # r=4, alpha=8
    assert plain.scale == 2.0


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(r=16), "rank 16, above max_lora_rank 8"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "IA3"),
    ],
)
def test_unsupported_configs_are_named(data_dir, tmp_path, change, message):
    path = _copy(data_dir, tmp_path)
    _edit_config(path, **change)
    with pytest.raises(LoRAAdapterError, match=message):
        read_config(path, max_rank=8)


def test_unknown_tensors_and_layers_are_named(data_dir, tmp_path, cfg):
    path = _copy(data_dir, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    extra = dict(tensors)
    extra["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((8, 128), np.float32)
    save_file(extra, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="embed_tokens"):
        load_adapter(path, cfg, max_rank=8)
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(renamed, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="layer 7 does not exist"):
        load_adapter(path, cfg, max_rank=8)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json does not exist"):
        read_config(tmp_path / "nowhere", max_rank=8)


def test_host_copies_padded_to_the_slot_and_kept_in_an_lru(data_dir, cfg):
    import jax

    from jaxserve.config import LoRAConfig
    from jaxserve.lora_request import LoRARequest
    from jaxserve.models.sharding import single_device_mesh
    from jaxserve.runner.lora_weights import LoRAWeights

    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    slots = LoRAWeights(cfg, config, np.float32, single_device_mesh())
    reqs = [LoRARequest(n, i, str(data_dir / "lora" / "llama" / n)) for i, n in enumerate("abc", 1)]
    values = slots.host_copy(reqs[0])  # rank 4 on q/k/v/o
    tree = jax.tree.unflatten(slots.treedef, values)
    a, b = tree[1]["wq"]
    assert a.shape == (64, 8) and b.shape == (8, 4, 16)
    assert np.abs(a[:, :4]).sum() > 0 and not a[:, 4:].any() and not b[4:].any()
    assert not tree[1]["w_down"][0].any()  # not a target of this adapter
    assert slots.host_copy(reqs[0]) is values  # kept
    slots.host_copy(reqs[1])
    slots.host_copy(reqs[2])  # past max_cpu_loras: the least recently used ("a") goes
    assert slots.host_copy(reqs[0]) is not values
