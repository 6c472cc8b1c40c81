"""Executables compiled ahead for a target: the directory `jaxserve compile` writes and
`serve --executables DIR` (`LLM(..., executables=DIR)`) loads.

The executable cache (runner/executable_cache.py) keys an entry by the environment of the
devices that compiled it: their ids and kinds, the backend's version string, every JAX option and
XLA/TPU/JAX environment variable, and the runner's arguments with their shardings (whose text
names the devices). A host compiling for a TPU slice or GPU hosts it does not have sees other
values for most of these (a compile-only client, JAX_PLATFORMS=cpu), so its entries could never
be found on the real machine. This module keys a directory of executables by what the programs
are a function of that both hosts compute alike (`target_material`):

- the code traced (`code_fingerprint`) and the versions of the libraries that compile and run it,
  the platform's plugin included (libtpu; JAX's CUDA plugin and ptxas);
- the platform, the devices of the mesh in order (their kind, a TPU's coordinates) and the
  processes; what the backend adds (`Backend.fingerprint`: on a CPU its instruction sets and
  native kernels);
- the XLA flags (XLA_FLAGS, LIBTPU_INIT_ARGS), JAXSERVE_MLA_PREFILL and JAX's options, less those that name the
  platform to open (the compiling host sets JAX_PLATFORMS=cpu);
- the runner: generation's, or the pooling runner's with its pooling (last token or mean,
  normalized or not);
- the step's recipe (runner/recipe.py), field by field (the model's config.json, the device
  plan and the sampler's sizes entry by entry; a draft head by its config.json, not by the
  directory that holds it), less its bucket grid (each step is one entry: a
  bucket not in the directory is compiled), its decode blocks' K (each block is an entry named
  with its K) and the compile workers' target.

The directory is an executable cache (the same files, checksums and argument checks) plus
`manifest.json`, which holds these parts. A runner given the directory compares its own parts
with the manifest's: when all agree its scope looks there first (`ExecutableScope.prebuilt`);
otherwise one log line names each part that differs, with both values where they are short,
and the steps are compiled as without it. Loading still checks each entry's checksum and that
it takes exactly the runner's arguments, shardings included. The directory is read, never
written or pruned.

With `jaxserve compile --weights` it also holds the weights as the target's start prepares them
(`weights/`, one weight cache entry: runner/weight_cache.py's format and checks), keyed by
`weights_material` (the checkpoint by content, the dtype, the quantization at load, the device
plan, the rules, the model as served, the devices, the code and libraries), whose parts the
manifest's "weights" holds: a server whose parts differ names them in one log line and prepares
its weights from the checkpoint (`prebuilt_weights`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax

from jaxserve.runner.executable_cache import (FORMAT, ExecutableCache, ExecutableScope, _version, canonical,
                                              code_fingerprint)

if TYPE_CHECKING:
    from jaxserve.backends.base import Backend
    from jaxserve.runner.recipe import StepRecipe

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# The distributions that compile (and then run) a platform's programs, beside jax and jaxlib.
_PLUGINS = {"tpu": ("libtpu",), "gpu": ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12")}
# The environment that changes what is compiled: XLA's flags, and the MLA layer's prefill form
# (models/layers/mla.py, a switch for tests and benchmarks).
_FLAG_VARIABLES = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAXSERVE_MLA_PREFILL")
# JAX options that name where to run, not what to compile, or change nothing compiled.
_CONFIG_IGNORED = ("platform", "visible_devices", "cache", "log", "explain", "dump", "traceback", "pprint",
                   "source_url", "timeout", "transfer_guard", "thread_guard", "tracer_error")
_RECIPE_IGNORED = ("target", "token_buckets", "request_buckets", "num_decode_steps")
_SHORT = 400  # parts longer than this are kept as their hash


def _distribution(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def target_material(recipe: StepRecipe, devices: Iterable[Any], backend: Backend,
                    pooling: Any = None) -> dict[str, str]:
    """The parts that key a recipe's executables for `devices` (see the module's doc): equal on a
    host compiling for the devices without them and on their own host. `pooling`: the pooling
    runner's PoolingConfig (its executables: `--runner pooling`), None for generation's."""
    import dataclasses

    devices = list(devices)
    config = {k: v for k, v in sorted(jax.config.values.items()) if not any(w in k for w in _CONFIG_IGNORED)}
    parts = {
        **_host_parts(recipe.platform, devices, backend, _PLUGINS.get(recipe.platform, ())),
        "processes": str(len({d.process_index for d in devices})),
        "xla_flags": repr([(k, os.environ.get(k, "")) for k in _FLAG_VARIABLES]),
        "jax_config": repr(config),
        "runner": "generate" if pooling is None else f"pooling ({pooling.pooling}, normalize {pooling.normalize})",
    }
    for field in dataclasses.fields(recipe):
        if field.name in _RECIPE_IGNORED:
            continue
        value = getattr(recipe, field.name)
        if field.name == "draft_model":
            parts["recipe.draft_model"] = draft_identity(value)
            continue
        if dataclasses.is_dataclass(value):  # field by field, so that a difference is named
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping):
            parts.update({f"recipe.{field.name}.{k}": canonical(v) for k, v in value.items()})
        else:
            parts[f"recipe.{field.name}"] = canonical(value)
    return {k: v if len(v) <= _SHORT else "sha256:" + hashlib.sha256(v.encode()).hexdigest() for k, v in parts.items()}


def _host_parts(platform: str, devices: list, backend: Backend, plugins: Iterable[str] = ()) -> dict[str, str]:
    """The parts of a key that name the code, the libraries (and `plugins`, the platform's
    compiler distributions), the platform, its devices and the backend."""
    versions = [f"{m}={_version(m)}" for m in ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")]
    versions += [f"{d}={_distribution(d)}" for d in plugins]
    return {
        "format": f"{FORMAT}.{MANIFEST_FORMAT}",
        "code": code_fingerprint(),
        "versions": " ".join(versions),
        "platform": platform,
        "devices": repr([(d.device_kind, tuple(getattr(d, "coords", None) or ()) or None) for d in devices]),
        "backend": canonical(backend.fingerprint()),
    }


def draft_identity(directory: str) -> str:
    """A drafter (a head, a draft model) as the programs see it, whatever directory holds it on this host: its
    config.json (its structure, and so its weights' shapes), hashed; "none" without one."""
    if not directory:
        return "none"
    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return f"a drafter whose config.json hashes to {digest}"


def material_key(material: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(material):
        h.update(f"{name}\0{material[name]}\0".encode())
    return h.hexdigest()


def differences(manifest: Mapping[str, str], here: Mapping[str, str]) -> list[str]:
    """Each part that differs, named ("recipe.num_pages: 130 in the directory, 66 here")."""
    out = []
    for name in sorted(set(manifest) | set(here)):
        a, b = manifest.get(name), here.get(name)
        if a == b:
            continue
        if a is None or b is None:
            out.append(f"{name}: {'absent' if a is None else 'present'} in the directory, "
                       f"{'absent' if b is None else 'present'} here")
        elif a.startswith("sha256:") or b.startswith("sha256:"):
            out.append(f"{name} differs")
        else:
            out.append(f"{name}: {a} in the directory, {b} here")
    return out


def write_manifest(directory: str | os.PathLike[str], material: Mapping[str, str], **facts: Any) -> pathlib.Path:
    """The manifest of a directory of executables: the parts that key them and `facts` (the
    topology, the buckets, the entries, timings) for people."""
    path = pathlib.Path(directory) / MANIFEST
    body = {"manifest_format": MANIFEST_FORMAT, "key": material_key(material), **facts, "material": dict(material)}
    tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(directory: str | os.PathLike[str]) -> dict:
    return json.loads((pathlib.Path(directory) / MANIFEST).read_text())


def compile_scope(directory: str | os.PathLike[str], material: Mapping[str, str], devices: list[Any]) -> ExecutableScope:
    """The scope `jaxserve compile` stores a target's executables through (nothing is evicted)."""
    cache = ExecutableCache(directory, max_bytes=1 << 62)
    return ExecutableScope(cache, material_key(material), devices)


def prebuilt_scope(directory: str | os.PathLike[str] | None, material: Mapping[str, str],
                   devices: list[Any]) -> ExecutableScope | None:
    """A read-only scope of the executables in `directory` when its manifest's parts are
    `material`; else None, with one log line naming what differs (or why it cannot be read)."""
    if directory is None:
        return None
    try:
        manifest = read_manifest(directory)
        stored = manifest["material"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("executables in %s not used: no readable %s (%s: %s); compiling", directory, MANIFEST,
                       type(e).__name__, e)
        return None
    diff = differences(stored, material)
    if diff:
        logger.warning("executables in %s (compiled for %s) not used: %s; compiling", directory,
                       manifest.get("topology", "?"), "; ".join(diff))
        return None
    logger.info("executables compiled ahead in %s (%s, %d entries) match this engine", directory,
                manifest.get("topology", "?"), len(manifest.get("entries", ())))
    return ExecutableScope(ExecutableCache(directory, read_only=True), material_key(material), devices)


# ---------------------------------------------------------------------------- weights ahead
# `jaxserve compile --weights`: the weights as the target's start would prepare them (read,
# dequantized, cast, quantized at load, padded, laid out by the backend), in the weight cache's
# entry format (runner/weight_cache.py: header, checksums, page-aligned leaves) under
# DIR/weights/, keyed by `weights_material`; the manifest's "weights" holds those parts.

WEIGHTS_SUBDIR = "weights"


def weights_material(ckpt: Any, devices: Iterable[Any], backend: Backend, *, dtype: str,
                     quantization: str | None, plan: Any, rules: Any, arch: Any) -> dict[str, str]:
    """The parts the prepared weights of `ckpt` are a function of, equal on the compiling host
    and the serving one: the loader's code and the libraries that convert, the platform and
    the mesh's devices (kinds, a TPU's coordinates), the backend (on a CPU its kernels, which
    pack), the checkpoint by content (config.json; a converted checkpoint's checksums, else each
    weight file's name, size, first and last MiB: no modification time, which a copy changes),
    the dtype, the quantization at load, the device plan, the sharding rules and the model's
    structure as served (padded heads included)."""
    from jaxserve.runner.weight_cache import checkpoint_identity

    parts = {
        **_host_parts(backend.platform, list(devices), backend),
        "weights.checkpoint": "sha256:" + checkpoint_identity(ckpt.path, ckpt.config, mtime=False),
        "weights.dtype": str(dtype),
        "weights.quantization": str(quantization),
        "weights.plan": canonical(plan),
        "weights.rules": canonical(rules),
        "weights.arch": canonical(arch),
    }
    return {k: v if len(v) <= _SHORT else "sha256:" + hashlib.sha256(v.encode()).hexdigest() for k, v in parts.items()}


def write_weights(directory: str | os.PathLike[str], material: Mapping[str, str], model) -> dict[str, Any]:
    """Store `model`'s prepared weights in `directory`/weights under `material`'s key; returns
    the manifest's "weights" entry (its key, parts and size)."""
    from jaxserve.runner.weight_cache import WeightCache

    key = material_key(material)
    WeightCache(pathlib.Path(directory) / WEIGHTS_SUBDIR, max_bytes=1 << 62).store(key, model)
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(model))
    return {"key": key, "bytes": nbytes, "material": dict(material)}


def prebuilt_weights(directory: str | os.PathLike[str] | None, material: Mapping[str, str], abstract_model):
    """The prepared weights `jaxserve compile --weights` wrote into `directory` when its
    manifest's weights were made from `material` (`abstract_model` given their values, placed
    by its shardings); else None: a directory without weights says nothing, one whose weights
    differ is named in one log line with each part that differs, as is one whose entry cannot
    be read (damaged, another layout). The directory is never written."""
    from jaxserve.runner.weight_cache import WeightCache

    if directory is None:
        return None
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError) as e:
        logger.warning("weights in %s not used: no readable %s (%s: %s); preparing them from the checkpoint",
                       directory, MANIFEST, type(e).__name__, e)
        return None
    stored = manifest.get("weights")
    if not isinstance(stored, Mapping) or not isinstance(stored.get("material"), Mapping):
        return None  # compiled without --weights
    diff = differences(stored["material"], material)
    if diff:
        logger.warning("weights in %s (prepared for %s) not used: %s; preparing them from the checkpoint",
                       directory, manifest.get("topology", "?"), "; ".join(diff))
        return None
    model = WeightCache(pathlib.Path(directory) / WEIGHTS_SUBDIR, read_only=True).load(material_key(material),
                                                                                      abstract_model)
    if model is None:
        logger.warning("weights in %s not used: their entry is missing or unreadable; preparing them from the "
                       "checkpoint", directory)
        return None
    logger.info("weights prepared ahead in %s (%s) match this engine: loaded, not prepared", directory,
                manifest.get("topology", "?"))
    return model
