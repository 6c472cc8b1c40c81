"""What preparing the weights costs at a start, per checkpoint kind, against reading them back
as prepared (the weight cache's entry: what `jaxserve compile --weights` writes).

For TPU/GPU targets the backend's `prepare_model` only marks weights (metadata: FP8 / int8
products, the quantized product kernel), so the start's work is the loader's (`create_model`):
read each tensor, dequantize (a GGUF file, first converted to a float32 directory by the GGUF
conversion cache), cast to the serving dtype, quantize at load (`--quantization`), pack int4,
pad heads (lane-dense KV pages), build act-order permutations, place. Each case builds a
checkpoint of Llama-3-8B's shape (hidden 4096, MLP 14336, 32/8 heads of 128) with 1 and with 2
decoder layers and a 16,384-token vocabulary, then times in one process, alternating:

- `prepare`: `create_model` from the checkpoint;
- `load`: `WeightCache.load` of the same weights stored as prepared (the header checked, every
  leaf's checksum, the copy into the device buffers);

each onto this host's CPU device (`*_device_s`) and on the host only (`*_host_s`: the device
transfer replaced by a host copy): what a TPU/GPU host pays besides the transfer to its
accelerator's memory, which both routes pay alike. A GGUF case also records the conversion
(`convert_s`: dequantized to a float32 directory, once per host by the GGUF conversion cache).

Files are in the page cache for both (a cold disk adds bytes / bandwidth to each: the bytes are
recorded). The 8B figure is scaled: the per-layer time (2 layers less 1) x 32, plus the rest
(embedding, LM head, norm: 1 layer less the per-layer time) x 128256/16384. The machine is
shared: compare `prepare` and `load` of one case (a ratio), not across runs.

    .venv/bin/python benchmarks/weight_prepare.py [--cases bf16,int8,...] [--repeat 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.models.gguf_fixtures writes the GGUF file

from results_log import append_results  # noqa: E402

VOCAB, FULL_VOCAB, FULL_LAYERS = 16384, 128256, 32
CASES = ("bf16", "bf16-pad16", "int8", "fp8", "int4", "gguf-q8_0", "gguf-q8_0-int8", "ct-w4a16")


# The test fixtures' GGUF vocabulary writer makes small vocabularies only: a GGUF case has 128
# tokens, and its 8B figure is the per-layer time x (32 + the embedding's and LM head's size in
# layers: 2 x 128256 x 4096 / a layer's 218M parameters).
GGUF_VOCAB = 128
LAYER_PARAMS = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
GGUF_LAYERS = FULL_LAYERS + 2 * FULL_VOCAB * 4096 / LAYER_PARAMS


def config(layers: int, vocab: int = VOCAB) -> dict:
    preset = json.loads((HERE.parent / "jaxserve/tools/arch_presets/llama3-8b.json").read_text())
    return {**preset, "num_hidden_layers": layers, "vocab_size": vocab, "torch_dtype": "bfloat16"}


def float_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A Llama's HF tensors of `cfg`, random, float32 (small values, as trained weights)."""
    h, m, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape):
        return (rng.random(shape, np.float32) - 0.5) * 0.05

    out = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "lm_head.weight": w(cfg["vocab_size"], h),
           "model.norm.weight": np.ones(h, np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                    p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                    p + "mlp.gate_proj.weight": w(m, h), p + "mlp.up_proj.weight": w(m, h),
                    p + "mlp.down_proj.weight": w(h, m), p + "input_layernorm.weight": np.ones(h, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float32)})
    return out


def write_safetensors(d: pathlib.Path, cfg: dict, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    import ml_dtypes
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 else v for k, v in tensors.items()},
              str(d / "model.safetensors"))
    return d


def write_ct_w4a16(d: pathlib.Path, cfg: dict, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    """compressed-tensors' pack-quantized int4 (symmetric, groups of 32; llm-compressor's W4A16
    as tests/data/quant/w4a16 holds it): int32 words of 8 nibbles, bfloat16 scales, the shape."""
    import ml_dtypes
    from safetensors.numpy import save_file

    qc = json.loads((HERE.parent / "tests/data/quant/w4a16/config.json").read_text())["quantization_config"]
    out = {}
    for name, x in tensors.items():
        if x.ndim != 2 or "layers." not in name:
            out[name] = x.astype(ml_dtypes.bfloat16) if x.ndim == 2 else x
            continue
        rows, cols = x.shape
        g = x.reshape(rows, cols // 32, 32)
        scale = np.abs(g).max(-1) / 7.0 + 1e-12
        q = np.clip(np.round(g / scale[..., None]), -8, 7).astype(np.int32).reshape(rows, cols)
        nib = (q + 8).astype(np.uint32).reshape(rows, cols // 8, 8)
        words = np.zeros((rows, cols // 8), np.uint32)
        for k in range(8):
            words |= nib[..., k] << np.uint32(4 * k)
        base = name.removesuffix(".weight")
        out[base + ".weight_packed"] = words.view(np.int32)
        out[base + ".weight_scale"] = scale.astype(ml_dtypes.bfloat16)
        out[base + ".weight_shape"] = np.asarray([rows, cols], np.int64)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    save_file(out, str(d / "model.safetensors"))
    return d


def write_gguf_q8_0(path: pathlib.Path, cfg: dict, tensors: dict[str, np.ndarray]) -> pathlib.Path:
    import gguf

    from tests.models.gguf_fixtures import write_gguf

    hf = {**cfg, "rope_parameters": {"rope_theta": cfg["rope_theta"]}}
    return write_gguf(path, "llama", hf, tensors, gguf.GGMLQuantizationType.Q8_0)


def _bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in ([path] if path.is_file() else path.iterdir()) if f.is_file())


class _HostOnly:
    """JAX with `device_put` a host copy: the cache's read without the transfer both routes pay."""

    def __getattr__(self, name):
        import jax

        return getattr(jax, name)

    @staticmethod
    def device_put(host, sharding, may_alias=False):
        return np.array(host, copy=True)

    @staticmethod
    def block_until_ready(x):
        return x


def _host_put(source, sharding, dtype, *, shape=None):
    """`put_sharded` without the transfer: the shard read, converted and copied on the host."""
    from jaxserve.models.placement import _host_shard, to_numpy_dtype

    array = np.asarray(source() if callable(source) and not isinstance(source, np.ndarray) else source)
    return _host_shard(array, to_numpy_dtype(dtype))


def measure(case: str, ckpt_dir: pathlib.Path, work: pathlib.Path, repeat: int) -> dict:
    """Seconds of one checkpoint's `prepare` and `load` (the smallest of `repeat`, alternating),
    onto this host's CPU device (`*_device_s`) and on the host only (`*_host_s`: what a TPU/GPU
    host pays besides the transfer to the device, which both routes pay alike)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import weights
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.runner import weight_cache
    from jaxserve.runner.weight_cache import WeightCache

    quantization = {"int8": "int8", "fp8": "fp8", "int4": "int4", "gguf-q8_0-int8": "int8"}.get(case)
    ckpt = load_checkpoint(ckpt_dir)
    arch = ArchConfig.from_hf(ckpt.config)
    if case == "bf16-pad16":  # lane-dense KV pages' zero heads (as a 64-wide head's model gets them)
        arch = arch.with_kv_heads(2 * arch.num_kv_heads)
    dtype = jnp.bfloat16
    cache = WeightCache(work / "entries", max_bytes=1 << 40)
    times: dict[str, list[float]] = {}
    nbytes = 0

    def timed(name, fn):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(jax.tree.leaves(out))
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def prepare():
        return create(arch, dtype=dtype, get_tensor=ckpt.get_tensor, quantization=quantization)

    create = weights.create_model
    for i in range(repeat):
        model = timed("prepare_device_s", prepare)
        if i == 0:
            cache.store(case, model)
            nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(model))
        del model
        real_put, weights.put_sharded = weights.put_sharded, _host_put
        try:
            timed("prepare_host_s", prepare)
        finally:
            weights.put_sharded = real_put
        abstract = weights.sharded_abstract_model(arch, dtype=dtype, quantization=quantization)
        model = timed("load_device_s", lambda: cache.load(case, abstract))
        assert model is not None, "the stored entry did not load"
        del model
        real_jax, weight_cache.jax = weight_cache.jax, _HostOnly()
        try:
            assert timed("load_host_s", lambda: cache.load(case, abstract)) is not None
        finally:
            weight_cache.jax = real_jax
    return {**{k: min(v) for k, v in times.items()}, "prepared_bytes": nbytes}


def checkpoint(case: str, layers: int, root: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """The checkpoint directory of `case` with `layers` layers, and what making it cost."""
    cfg = config(layers, GGUF_VOCAB if case.startswith("gguf") else VOCAB)
    tensors = float_tensors(cfg, np.random.default_rng(layers))
    d = root / f"{case}-{layers}"
    extra: dict = {}
    if case.startswith("gguf"):
        from jaxserve.models.gguf_loader import convert_gguf

        src = write_gguf_q8_0(root / f"{case}-{layers}.gguf", cfg, tensors)
        extra["checkpoint_bytes"] = _bytes(src)
        t0 = time.perf_counter()
        convert_gguf(src, d)  # the conversion cache's work: once per host (dequantized to float32)
        extra["convert_s"] = time.perf_counter() - t0
        src.unlink()
    elif case == "ct-w4a16":
        write_ct_w4a16(d, cfg, tensors)
    else:
        write_safetensors(d, cfg, tensors)
    extra.setdefault("checkpoint_bytes", _bytes(d))
    return d, extra


def scaled(one: float, two: float, gguf: bool = False) -> float:
    """The 8B figure from the 1- and 2-layer ones (see the module's doc and GGUF_LAYERS)."""
    per_layer = max(two - one, 0.0)
    if gguf:
        return per_layer * GGUF_LAYERS
    return per_layer * FULL_LAYERS + max(one - per_layer, 0.0) * FULL_VOCAB / VOCAB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "weight_prepare.jsonl"))
    args = ap.parse_args()
    import jax

    jax.config.update("jax_platforms", "cpu")
    for case in args.cases.split(","):
        root = pathlib.Path(tempfile.mkdtemp(prefix="weight-prepare-"))
        try:
            by_layers = {}
            for layers in (1, 2):
                d, extra = checkpoint(case, layers, root)
                by_layers[layers] = {**measure(case, d, root / f"work-{layers}", args.repeat), **extra}
                shutil.rmtree(d, ignore_errors=True)
                shutil.rmtree(root / f"work-{layers}", ignore_errors=True)
            one, two = by_layers[1], by_layers[2]
            g = case.startswith("gguf")
            names = ("prepare_host_s", "load_host_s", "prepare_device_s", "load_device_s", "convert_s")
            record = {"benchmark": "weight_prepare", "case": case,
                      "shape": f"Llama-3-8B, vocab {GGUF_VOCAB if g else VOCAB}",
                      "layers": {str(k): {n: round(v, 3) if isinstance(v, float) else v for n, v in r.items()}
                                 for k, r in by_layers.items()},
                      "scaled_8b": {n: round(scaled(one[n], two[n], g), 1) for n in names if n in one},
                      **{f"scaled_8b_{n.split('_')[0]}_gib": round(scaled(one[n], two[n], g) / 2**30, 2)
                         for n in ("prepared_bytes", "checkpoint_bytes")}}
            append_results(args.out, record)  # case by case: a failure later keeps these
            print(json.dumps(record), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
