"""The HLO collective parser on a hand-made shard_map program with known counts and bytes,
and on the other textual forms XLA prints (iota and mesh replica groups, async pairs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.tools.hlo_collectives import parse_collectives, shape_bytes, summarize


def _program():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def f(x):
        for i in range(3):
            with jax.named_scope(f"layer_{i}"):
                # psum of each device's [16, 8] float32 block over the 4-way model axis: one
                # all-reduce of 512 B per layer
                x = jax.shard_map(lambda a: jax.lax.psum(a, "model"), mesh=mesh, in_specs=P(None, "model"),
                                  out_specs=P(None, "model"), check_vma=False)(x)
        # one all-gather over the 2-way data axis outside the layers: [8, 8] -> [16, 8] float32
        return jax.shard_map(lambda a: jax.lax.all_gather(a, "data", tiled=True), mesh=mesh,
                             in_specs=P("data", "model"), out_specs=P(None, "model"), check_vma=False)(x)

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    return jax.jit(f).lower(x).compile()


def test_counts_and_bytes_of_a_shard_map_program():
    assert len(jax.devices()) >= 8
    ops = parse_collectives(_program().as_text(), num_devices=8)
    reduces = [c for c in ops if c.kind == "all-reduce"]
    gathers = [c for c in ops if c.kind == "all-gather"]
    assert len(reduces) == 3 and len(gathers) == 1 and len(ops) == 4
    assert sorted(c.layer for c in reduces) == [0, 1, 2] and gathers[0].layer is None
    assert all(c.bytes == 16 * 8 * 4 and c.group_size == 4 for c in reduces)
    assert gathers[0].bytes == 16 * 8 * 4 and gathers[0].group_size == 2
    s = summarize(ops, num_layers=3)
    assert s["total"]["all-reduce"]["count"] == 3 and s["total"]["all-reduce"]["bytes"] == 3 * 512
    assert s["per_layer"]["all-reduce"]["count"] == 1 and s["per_layer"]["all-reduce"]["bytes"] == 512
    assert s["other"] == {"all-gather": {"count": 1, "bytes": 512, "wire_bytes": 256, "group_sizes": [2]}}
    assert s["count"] == 4 and s["bytes"] == 4 * 512
    # ring estimates: all-reduce 2 (n-1)/n S over 4 devices, all-gather (n-1)/n S_out over 2
    assert s["wire_bytes"] == round(3 * 2 * 3 / 4 * 512 + 1 / 2 * 512)


def test_textual_forms():
    hlo = """
  %ar = bf16[128,512]{1,0:T(8,128)(2,1)} all-reduce(%fusion), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/layer_7/mlp/dot_general"}
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(step)/lm_head/dot"}
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  %ars = (f32[10]{0}, s32[3]{0}) all-reduce-start(%a, %b), replica_groups={}, to_apply=%add
  %ard = (f32[10]{0}, s32[3]{0}) all-reduce-done(%ars)
  %cp = f32[2,2]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  ROOT %rs = f32[4]{0} reduce-scatter(%y), replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
"""
    ops = {c.name: c for c in parse_collectives(hlo, num_devices=8)}
    assert set(ops) == {"ar", "ags", "ars", "cp", "rs"}
    assert (ops["ar"].bytes, ops["ar"].group_size, ops["ar"].layer) == (128 * 512 * 2, 4, 7)
    assert (ops["ags"].kind, ops["ags"].is_async, ops["ags"].bytes, ops["ags"].group_size) == ("all-gather", True, 512, 4)
    assert (ops["ars"].bytes, ops["ars"].group_size) == (52, 8)
    assert (ops["cp"].bytes, ops["rs"].bytes, ops["rs"].group_size) == (16, 16, 2)
    assert ops["rs"].wire_bytes == 16
    assert shape_bytes("(bf16[2,3]{1,0}, (s8[4]{0}, pred[]))") == 12 + 4 + 1


def test_custom_calls_outside_pallas_are_counted_by_kind():
    """XLA's own custom calls (one per gather on TPUs) are one report line with their count,
    not one line per instance; a Pallas kernel keeps its traced name."""
    from jaxserve.tools import hlo_ops

    hlo = "\n".join([
        "ENTRY %main {",
        '  %custom-call.1000 = s32[8]{0} custom-call(s32[8]{0} %p), custom_call_target="AssumeGatherIndicesInBound"',
        '  %custom-call.1002 = s32[8]{0} custom-call(s32[8]{0} %q), custom_call_target="AssumeGatherIndicesInBound"',
        '  %ragged-dot-none.12 = f32[8,4]{1,0} custom-call(f32[8,4]{1,0} %r), custom_call_target="tpu_custom_call"',
        '  %custom-call.7 = f32[8]{0} custom-call(f32[8]{0} %s), custom_call_target="tpu_custom_call", '
        'metadata={op_name="jit(step)/layer_0/ragged_paged_attention/pallas_call"}',
        "}",
    ])
    _, kernels = hlo_ops.parse(hlo)
    assert hlo_ops.kernel_counts(kernels) == {
        "custom-call (AssumeGatherIndicesInBound)": 2,
        "ragged-dot-none (tpu_custom_call)": 1,
        "ragged_paged_attention (tpu_custom_call)": 1,
    }


def test_the_report_groups_the_2026_models_weights():
    """gpt-oss's stacked experts and their biases, sinks, DeepSeek's MLA projections, shared
    experts and MTP layer each land in their group, not in "other"."""
    from jaxserve.tools.plan_compile import param_group

    assert {p: param_group(p, n) for p, n in [
        ("layers.3.x_gate", 3), ("layers.3.b_x_up", 2), ("layers.3.router_bias", 1),
        ("layers.3.e_bias", 1), ("layers.3.sinks", 1), ("layers.2.w_uk", 3), ("layers.2.wkv_a", 2),
        ("layers.2.s_gate", 2), ("mtp.block.x_up", 3), ("layers.0.w_gate", 2), ("layers.0.w_gate", 3),
    ]} == {
        "layers.3.x_gate": "moe", "layers.3.b_x_up": "moe", "layers.3.router_bias": "moe",
        "layers.3.e_bias": "moe", "layers.3.sinks": "attention", "layers.2.w_uk": "attention",
        "layers.2.wkv_a": "attention", "layers.2.s_gate": "mlp", "mtp.block.x_up": "mtp",
        "layers.0.w_gate": "moe",
    }
    assert param_group("layers.0.w_gate", 2) == "mlp"
