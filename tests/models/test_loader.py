"""HF safetensors directories: reading, errors, model resolution, dtypes, sharded placement."""

from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from jaxserve.models import loader
from jaxserve.models.safetensors_io import PlannedTensor, read_header, write_streaming

RNG = np.random.default_rng(0)


def _config(path: pathlib.Path) -> None:
    (path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})
    )


@pytest.fixture
def single_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    tensors = {
        "model.embed_tokens.weight": RNG.standard_normal((16, 8)).astype(np.float32),
        "model.norm.weight": RNG.standard_normal(8).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": RNG.standard_normal((12, 8)).astype(
            ml_dtypes.bfloat16
        ),
        "scalar": np.array(3, dtype=np.int32),
    }
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    _config(tmp_path)
    return tmp_path, tensors


@pytest.fixture
def sharded_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
    shards = {
        "model-00001-of-00002.safetensors": {
            "a.weight": RNG.standard_normal((4, 6)).astype(np.float32),
            "b.weight": RNG.standard_normal((3,)).astype(np.float32),
        },
        "model-00002-of-00002.safetensors": {
            "c.weight": RNG.standard_normal((2, 5)).astype(np.float16),
        },
    }
    weight_map = {}
    for file, tensors in shards.items():
        safetensors.numpy.save_file(tensors, tmp_path / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    _config(tmp_path)
    return tmp_path, {k: v for tensors in shards.values() for k, v in tensors.items()}


def test_single_file_checkpoint(single_dir):
    path, tensors = single_dir
    ckpt = loader.load_checkpoint(path)
    assert ckpt.config["hidden_size"] == 8
    assert ckpt.tensor_names() == sorted(tensors)
    for name, expected in tensors.items():
        got = ckpt.get_tensor(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        assert ckpt.tensor_info(name) == (expected.shape, expected.dtype)
    # a memory-mapped, read-only view: no copy of the file's data
    view = ckpt.get_tensor("model.embed_tokens.weight")
    assert not view.flags.writeable and not view.flags.owndata


def test_get_tensor_converts_dtype(single_dir):
    path, tensors = single_dir
    ckpt = loader.load_checkpoint(path)
    got = ckpt.get_tensor("model.layers.0.mlp.up_proj.weight", dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(
        got, tensors["model.layers.0.mlp.up_proj.weight"].astype(np.float32)
    )
    got = ckpt.get_tensor("model.embed_tokens.weight", dtype="bfloat16")
    np.testing.assert_array_equal(
        got, tensors["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    )


def test_sharded_checkpoint(sharded_dir):
    path, tensors = sharded_dir
    ckpt = loader.load_checkpoint(path)
    assert ckpt.tensor_names() == ["a.weight", "b.weight", "c.weight"]
    for name, expected in tensors.items():
        np.testing.assert_array_equal(ckpt.get_tensor(name), expected)


def test_sharded_missing_shard(sharded_dir):
    path, _ = sharded_dir
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="missing shard.*model-00002-of-00002"):
        loader.load_checkpoint(path)


def test_index_names_a_tensor_its_shard_lacks(sharded_dir):
    path, _ = sharded_dir
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["d.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="d.weight"):
        loader.load_checkpoint(path)


def test_unsharded_multi_file_without_index(tmp_path):
    safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp_path / "part1.safetensors")
    safetensors.numpy.save_file({"y": np.ones(3, np.float32)}, tmp_path / "part2.safetensors")
    _config(tmp_path)
    ckpt = loader.load_checkpoint(tmp_path)
    assert ckpt.tensor_names() == ["x", "y"]


def test_missing_config(tmp_path):
    safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no config.json"):
        loader.load_checkpoint(tmp_path)


def test_no_safetensors(tmp_path):
    _config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="no \\*.safetensors.*pytorch_model.bin"):
        loader.load_checkpoint(tmp_path)


def test_unknown_tensor_name(single_dir):
    ckpt = loader.load_checkpoint(single_dir[0])
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        ckpt.get_tensor("nope")


@pytest.mark.parametrize(
    "corrupt",
    ["huge_length", "bad_json", "truncated_data", "bad_offsets", "too_short"],
)
def test_corrupt_safetensors_header(single_dir, corrupt):
    path, _ = single_dir
    file = path / "model.safetensors"
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    if corrupt == "huge_length":
        raw = struct.pack("<Q", 1 << 40) + raw[8:]
    elif corrupt == "bad_json":
        raw = raw[:8] + b"{" + b"x" * (n - 1) + raw[8 + n :]
    elif corrupt == "truncated_data":
        raw = raw[:-10]
    elif corrupt == "bad_offsets":
        header["model.norm.weight"]["data_offsets"][1] += 2
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        raw = struct.pack("<Q", len(text)) + text + raw[8 + n :]
    elif corrupt == "too_short":
        raw = raw[:5]
    file.write_bytes(raw)
    with pytest.raises(ValueError, match="model.safetensors"):
        loader.load_checkpoint(path)


def test_streaming_writer_is_read_by_safetensors(tmp_path):
    arrays = {
        "w": RNG.standard_normal((5, 7)).astype(np.float32),
        "h": RNG.standard_normal(9).astype(np.float16),
        "b": RNG.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
    }
    planned = [PlannedTensor(k, v.dtype, v.shape, lambda v=v: v) for k, v in arrays.items()]
    write_streaming(tmp_path / "x.safetensors", planned, metadata={"format": "pt"})
    loaded = safetensors.numpy.load_file(tmp_path / "x.safetensors")
    for k, v in arrays.items():
        np.testing.assert_array_equal(loaded[k], v)
    entries, metadata = read_header(tmp_path / "x.safetensors")
    assert metadata == {"format": "pt"} and set(entries) == set(arrays)


def test_streaming_writer_rejects_mismatch(tmp_path):
    planned = [
        PlannedTensor("w", np.dtype(np.float32), (2, 2), lambda: np.zeros((2, 3), np.float32))
    ]
    with pytest.raises(AssertionError, match="planned"):
        write_streaming(tmp_path / "x.safetensors", planned)


# ----------------------------------------------------------------------------- resolve_model


def test_resolve_hf_directory(single_dir):
    path, _ = single_dir
    assert loader.resolve_model(str(path)) == path.resolve()
    assert loader.resolve_model(path) == path.resolve()


def test_resolve_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json"):
        loader.resolve_model(tmp_path)


def test_resolve_rejects_a_missing_path():
    with pytest.raises(ValueError, match="not found on this machine, and it is not a Hugging Face"):
        loader.resolve_model("/no/such/dir")


def test_resolve_rejects_empty_name():
    with pytest.raises(ValueError, match="empty"):
        loader.resolve_model("")


def test_resolve_rejects_non_gguf_file(tmp_path):
    file = tmp_path / "weights.gguf"
    file.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        loader.resolve_model(file)


def test_load_tokenizer_requires_files(tmp_path):
    _config(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer"):
        loader.load_tokenizer(tmp_path)


# ----------------------------------------------------------------------------- dtypes


def test_convert_dtype():
    x = RNG.standard_normal(1000).astype(np.float32) * 100
    bf = loader.convert_dtype(x, "bfloat16")
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf, x.astype(ml_dtypes.bfloat16))
    half = x.astype(np.float16)
    # half -> bfloat16 rounds once, from the exact float32 value
    np.testing.assert_array_equal(
        loader.convert_dtype(half, "bf16"), half.astype(np.float32).astype(ml_dtypes.bfloat16)
    )
    np.testing.assert_array_equal(loader.convert_dtype(bf, np.float32), bf.astype(np.float32))
    assert loader.convert_dtype(x, np.float32) is x
    import jax.numpy as jnp

    assert loader.to_numpy_dtype(jnp.bfloat16) == np.dtype(ml_dtypes.bfloat16)
    assert loader.to_numpy_dtype("fp16") == np.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        loader.to_numpy_dtype("float7")


# ----------------------------------------------------------------------------- put_sharded


def test_put_sharded_reads_only_each_shard(single_dir):
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(1, n), ("data", "model"))
    sharding = NamedSharding(mesh, P("model", None))
    full = RNG.standard_normal((4 * n, 6)).astype(np.float32)

    seen: list[tuple[slice, ...]] = []

    def block(index):
        seen.append(index)
        return full[index]

    out = loader.put_sharded(block, sharding, "bfloat16", shape=full.shape)
    assert out.dtype == jax.numpy.bfloat16 and out.sharding == sharding
    np.testing.assert_array_equal(np.asarray(out), full.astype(ml_dtypes.bfloat16))
    for index in seen:  # never the whole array when there are several devices
        assert n == 1 or index[0] != slice(None)
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(
            np.asarray(shard.data), full[shard.index].astype(ml_dtypes.bfloat16)
        )

    # from a memory-mapped checkpoint tensor, and from a lazy zero-argument callable
    ckpt = loader.load_checkpoint(single_dir[0])
    emb = ckpt.get_tensor("model.embed_tokens.weight")
    rows = (
        NamedSharding(mesh, P(None, "model")) if emb.shape[1] % n == 0 else NamedSharding(mesh, P())
    )
    for source in (emb, lambda: ckpt.get_tensor("model.embed_tokens.weight")):
        placed = loader.put_sharded(source, rows, np.float32)
        np.testing.assert_array_equal(np.asarray(placed), emb)
