"""benchmarks/step_anatomy.py: its HLO parser's rules on a hand-written module, the kernels and
parts it finds in the server's compiled decode step (CPU, and compile-only v6e and H100 where
libtpu / JAX's CUDA plugin are installed), and the step's invariants:

- no decode step copies or rewrites a buffer of the KV cache's size;
- the sampler moves at most 5 % of a decode step's bytes.

The model is tiny but keeps Llama-3-8B's proportions where the sampler's share depends on
them: a sampler pass over R rows of float32 logits is 2R/E of the LM head's bfloat16 weights
(E the hidden size), so hidden 128 with 8 sequences is the 8B model (E = 4096) at 256; the head
dim is 64 (the TPU kernel's smallest), so the attention is the target's kernel, as serving
takes it, and the KV cache is a server's (1 GiB; nothing is allocated)."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import sys
import tempfile

import pytest

# The compiled HLO is cached by the script; the tests compile into a folder of their own process
# rather than the user's cache.
os.environ.setdefault("JAXSERVE_STEP_ANATOMY_CACHE", tempfile.mkdtemp(prefix="step-anatomy-"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import step_anatomy as sa

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 448,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
SEQS, CONTEXT = 8, 256
# The sampling state of a server of 256 sequences (the benchmark's): large enough that a step
# copying or gathering its [slots, vocab] arrays breaks the sampler's share at once (they were
# copied whole every step, 12 % of a one-sequence Llama-3-8B decode step on H100).
SLOTS = 256
# A serving-sized cache (compile-only: no memory is allocated), far larger than a TPU's on-chip
# memory, which would hold a tiny cache whole.
KV_CACHE_MEMORY = 1 << 30

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU = all(importlib.util.find_spec(n) is not None for n in ("jax_cuda12_plugin", "nvidia"))
TARGETS = [
    "cpu",
    pytest.param(
        "v6e:1x1", marks=pytest.mark.skipif(not HAS_TPU, reason="libtpu is not installed")
    ),
    pytest.param(
        "h100:1x1",
        marks=pytest.mark.skipif(not HAS_GPU, reason="JAX's CUDA plugin is not installed"),
    ),
]

_records: dict[str, dict] = {}


def decode_record(target: str) -> dict:
    """The anatomy of the tiny model's decode step of SEQS sequences on `target`, with a
    sampling state of SLOTS slots (compiled once a module; the HLO is cached across runs, see
    the script)."""
    if target not in _records:
        (rec,) = sa.step_records(
            TINY,
            target,
            context=CONTEXT,
            decode=[SEQS],
            prefill=0,
            model_name="tiny",
            kv_cache_memory=KV_CACHE_MEMORY,
            max_num_seqs=SLOTS,
        )
        _records[target] = rec
    return _records[target]


# ------------------------------------------------------------------------ the parser's rules
HLO = """HloModule jit_step, is_scheduled=true, input_output_alias={ {0}: (1, {}, may-alias) }, entry_computation_layout={()}

%gather_body (p0: bf16[1000,64], p1: s32[8]) -> bf16[8,64] {
  %p0 = bf16[1000,64]{1,0} parameter(0)
  %p1 = s32[8]{0} parameter(1)
  ROOT %g = bf16[8,64]{1,0} gather(%p0, %p1), offset_dims={1}, slice_sizes={1,64}
}

%write_body (c: bf16[100,16,64], u: bf16[1,16,64], i: s32[]) -> bf16[100,16,64] {
  %c = bf16[100,16,64]{2,1,0} parameter(0)
  %u = bf16[1,16,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[100,16,64]{2,1,0} dynamic-update-slice(%c, %u, %i, %z, %z), metadata={op_name="jit(step)/layer_0/attention/dus"}
}

%dot_body (a: bf16[8,64], w: bf16[64,256]) -> f32[8,256] {
  %a = bf16[8,64]{1,0} parameter(0)
  %w = bf16[64,256]{1,0} parameter(1)
  ROOT %dot = f32[8,256]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cheap (x: f32[8,256]) -> f32[8] {
  %x = f32[8,256]{1,0} parameter(0)
  %s = f32[8,256]{1,0} negate(%x), metadata={op_name="jit(step)/sampler/cond/branch_0_fun/neg"}
  ROOT %r = f32[8] slice(%s), slice={[0:8]}, metadata={op_name="jit(step)/sampler/cond/branch_0_fun/slice"}
}

%dear (x: f32[8,256]) -> f32[8] {
  %x = f32[8,256]{1,0} parameter(0)
  %e = f32[8,256]{1,0} exponential(%x), metadata={op_name="jit(step)/sampler/cond/branch_1_fun/exp"}
  %e2 = f32[8,256]{1,0} exponential(%e), metadata={op_name="jit(step)/sampler/cond/branch_1_fun/exp"}
  ROOT %r = f32[8] slice(%e2), slice={[0:8]}, metadata={op_name="jit(step)/sampler/cond/branch_1_fun/slice"}
}

ENTRY %main (embed: bf16[1000,64], cache: bf16[100,16,64], ids: s32[8], w: bf16[64,256], p: pred[]) -> (bf16[100,16,64], f32[8]) {
  %embed = bf16[1000,64]{1,0} parameter(0)
  %cache = bf16[100,16,64]{2,1,0} parameter(1)
  %ids = s32[8]{0} parameter(2)
  %w = bf16[64,256]{1,0} parameter(3)
  %p = pred[] parameter(4)
  %h = bf16[8,64]{1,0} fusion(%embed, %ids), kind=kLoop, calls=%gather_body, metadata={op_name="jit(step)/embed/gather"}
  %row = bf16[1,16,64]{2,1,0} bitcast(%h)
  %zero = s32[] constant(0)
  %written = bf16[100,16,64]{2,1,0} fusion(%cache, %row, %zero), kind=kLoop, calls=%write_body, metadata={op_name="jit(step)/layer_0/attention/dus"}
  %relaid = bf16[100,16,64]{1,2,0} copy(%written), metadata={op_name="jit(step)/layer_0/attention/copy"}
  %logits = f32[8,256]{1,0} fusion(%h, %w), kind=kOutput, calls=%dot_body, metadata={op_name="jit(step)/lm_head/dot_general"}
  %tok = f32[8] conditional(%p, %logits, %logits), branch_computations={%cheap, %dear}
  ROOT %out = (bf16[100,16,64]{2,1,0}, f32[8]) tuple(%relaid, %tok)
}
"""
CACHE_ELEMENTS = 100 * 16 * 64


def test_the_parser_applies_its_byte_and_part_rules():
    """On a hand-written module: the embedding's gather counts the rows it gathers (not the
    table), the in-place write its row, a cache-sized copy counts whole and as a cache copy,
    the dot is a matmul, a conditional takes its cheaper branch on the plain path and the dearer
    on the heavy one, and a cache argument the entry does not alias counts as a copy."""
    geo = sa.CacheGeometry(
        elements=CACHE_ELEMENTS, pages=100, pages_touched=8, tokens=1, row_elements=64
    )
    rec = sa.anatomy(HLO, geo, cache_params=[1])
    parts, heavy = rec["by_part"], rec["by_part_heavy"]
    gather = 8 * 64 * 2 + 8 * 4 + 8 * 64 * 2  # the rows read, the ids, the rows written
    copy = 2 * CACHE_ELEMENTS * 2  # the whole cache read and written
    assert parts["other"] == {"kernels": 2, "bytes": gather + copy}
    assert parts["kv_write"] == {
        "kernels": 1,
        "bytes": 2 * 16 * 64 * 2 + 4,
    }  # the row read and written in place
    assert parts["matmuls"] == {"kernels": 1, "bytes": 8 * 64 * 2 + 64 * 256 * 2 + 8 * 256 * 4}
    logits = 8 * 256 * 4
    assert parts["sampler"] == {"kernels": 2, "bytes": 2 * logits + 2 * 8 * 4}  # negate, slice
    assert heavy["sampler"] == {"kernels": 3, "bytes": 4 * logits + 2 * 8 * 4}  # exp, exp, slice
    assert (rec["kernels"], rec["kernels_heavy"]) == (6, 7)
    assert rec["sampler_bytes"] == parts["sampler"]["bytes"]
    assert rec["bytes_moved"] == sum(p["bytes"] for p in parts.values())
    assert rec["cache_copies"] == 1  # the copy; the cache argument is aliased
    assert (
        sa.anatomy(HLO.replace("{0}: (1, {}, may-alias)", ""), geo, cache_params=[1])[
            "cache_copies"
        ]
        == 2
    )


# ------------------------------------------------------------------------ the compiled step
@pytest.mark.parametrize("target", TARGETS)
def test_the_parser_finds_the_steps_kernels_and_parts(target):
    """The server's compiled decode step: its kernels sort into the parts, the matmuls read at
    least the layers' and LM head's weights, attention (and the KV write) at least the pages of
    the step's sequences, and the step moves at least its minimum."""
    rec = decode_record(target)
    parts = rec["by_part"]
    assert rec["kernels"] >= 10
    for part in ("matmuls", "attention", "sampler", "other"):
        assert parts[part]["kernels"] >= 1, (part, rec["largest_kernels"])
    m = rec["minimum"]
    assert parts["matmuls"]["bytes"] >= 0.9 * (
        m["weights_once"] - 2 * 8 * 128 * 2
    )  # all but the norms' weights
    assert parts["attention"]["bytes"] + parts["kv_write"]["bytes"] >= m["kv_read"]
    assert rec["bytes_moved"] >= m["total"]
    assert rec["bytes_moved_heavy"] >= rec["bytes_moved"]


# The invariants' violations measured on today's step (the work on the step's sampler and cache
# layout is to fix them): strict, so that
# a test turns red the moment its violation is gone and its mark must go too.
VIOLATIONS = {
    (
        "sampler",
        "cpu",
        "_heavy",
    ): "sampler 15.7 % of a CPU decode step's bytes on the branches a row with "
    "penalties or logprobs takes (the penalties' pass over the logits and the slot's count and "
    "bias rows, the masked logits the native kernels read, the native draw and raw logprobs; "
    "5 % is three passes over the logits here, and the dense penalties' pass alone moves four)",
    (
        "sampler",
        "v6e:1x1",
        "_heavy",
    ): "sampler 49.2 % of a v6e:1x1 decode step's bytes on the branches a row with penalties "
    "or logprobs takes (was 84.5 %: the value search counted at its bound of 100 probes, each a "
    "pass; now 8 passes, read twice each for top-p: XLA:TPU computes the probabilities into "
    "VMEM in a kernel of their own; the rest: the penalties' pass, block maxima and masses, "
    "the logprobs' and prompt logprobs' log-sum-exp and rank)",
    (
        "sampler",
        "h100:1x1",
        "_heavy",
    ): "sampler 31.8 % of an h100:1x1 decode step's bytes on the branches a "
    "row with penalties or logprobs takes (was 38.5 %; full-vocabulary passes: the penalties' "
    "pass, block maxima and masses, the top-p search's probe (its probabilities written and "
    "read back) and extraction, the masked logits of the logprobs, the logprobs' and prompt "
    "logprobs' log-sum-exp and rank)",
}


def _cases(kind: str, paths=(None,)):
    out = []
    for target in TARGETS:
        name, marks = (
            (target, []) if isinstance(target, str) else (target.values[0], list(target.marks))
        )
        for path in paths:
            reason = VIOLATIONS.get((kind, name) if path is None else (kind, name, path))
            xfail = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            values = (name,) if path is None else (name, path)
            out.append(
                pytest.param(
                    *values, marks=marks + xfail, id="-".join(v for v in values if v) or name
                )
            )
    return out


@pytest.mark.parametrize("target", _cases("copy"))
def test_no_cache_sized_copy_in_a_decode_step(target):
    rec = decode_record(target)
    assert rec["cache_copies"] == 0, rec["cache_copy_ops"]


@pytest.mark.parametrize(("target", "path"), _cases("sampler", ("", "_heavy")))
def test_the_sampler_moves_at_most_5_percent_of_a_decode_step(target, path):
    """The plain path (no row asks for penalties, masks or logprobs) and the heavy one."""
    rec = decode_record(target)
    assert rec[f"sampler_share{path}"] <= 0.05, rec[f"by_part{path}"]


@pytest.mark.skipif(not HAS_GPU, reason="JAX's CUDA plugin is not installed")
def test_a_gpu_decode_step_has_one_top_level_conditional_and_no_loop():
    """XLA:GPU reads a conditional's predicate (and a data-dependent loop's, every trip) back to
    the host before it launches the branch: a synchronisation inside the step. The sampler's
    optional features, the logprobs and the prompt logprobs share one top-level conditional
    (the features' own are nested in its branch), and the sampling state's reset is a scatter
    there, not a loop."""
    launches = decode_record("h100:1x1")["gpu_host_launches"]
    assert launches["conditionals"] <= 1, launches
    assert "kWhile" not in launches["outside"], launches


@pytest.mark.skipif(not HAS_GPU, reason="JAX's CUDA plugin is not installed")
def test_one_row_products_read_each_weight_once_on_a_gpu():
    """A one-sequence decode step's products have one row. XLA:GPU rewrites one with a small
    weight (every decoder-layer weight of SmolLM2-135M) as a broadcast multiply and a reduction
    and leaves most multiplies unfused: a float32 copy of the weight written and read back (a
    one-token SmolLM2-135M step on H100 moved 920 MB, its products 880 MB, its weights 269 MB).
    `dense` gives such a product two rows on a GPU, a GEMM kernel that reads the weight once.
    Compiled for H100: one decoder layer's products (the model's specs, SmolLM2-135M's shapes)
    on one token, as the layer chains them (the normalised input, the gated activation)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxserve.models.layers.linear import dense
    from jaxserve.models.layers.norm import rms_norm
    from jaxserve.models.llama import LAYER_SPECS
    from jaxserve.tools.chips import gpu_devices, parse_target

    E, F, H, HKV, D = 576, 1536, 9, 3, 64
    shapes = {"wq": (E, H, D), "wk": (E, HKV, D), "wv": (E, HKV, D), "wo": (H, D, E),
              "w_gate": (E, F), "w_up": (E, F), "w_down": (F, E)}

    def layer(x, w):
        h = rms_norm(x, None, 1e-5)
        q, k, v = (dense(LAYER_SPECS[n], h, w[n]) for n in ("wq", "wk", "wv"))
        x = x + dense(LAYER_SPECS["wo"], q + jnp.tile(k * v, (1, H // HKV, 1)), w["wo"])
        h = rms_norm(x, None, 1e-5)
        act = jax.nn.silu(dense(LAYER_SPECS["w_gate"], h, w["w_gate"]))
        return x + dense(LAYER_SPECS["w_down"], act * dense(LAYER_SPECS["w_up"], h, w["w_up"]),
                         w["w_down"])

    on_h100 = SingleDeviceSharding(gpu_devices(parse_target("h100:1x1"))[0])
    x = jax.ShapeDtypeStruct((1, E), jnp.float32, sharding=on_h100)
    w = {n: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=on_h100) for n, s in shapes.items()}
    text = jax.jit(layer).lower(x, w).compile().as_text()
    geo = sa.CacheGeometry(elements=1 << 40, pages=1, pages_touched=0, tokens=1, row_elements=1)
    moved = sa.anatomy(text, geo, cache_params=[])
    weights = sum(2 * math.prod(s) for s in shapes.values())
    assert moved["bytes_moved"] <= 1.1 * weights, (moved["bytes_moved"], weights,
                                                    moved["kernel_labels"])
