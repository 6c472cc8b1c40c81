"""Which weight dtype serves faster on this CPU — measured, not read off a feature list.

Without AMX, bfloat16 weights go through the same strips kernel as float32 (widened as they are
loaded: half the bytes to read, the same float32 FMAs), where a bfloat16 KV cache also halves
attention's reads but the activations are rounded; an AMX CPU has a bfloat16 kernel several
times faster than float32. So "auto" times the products a decode step is made of (SmolLM2's
MLP shapes, at 1 and 32 rows: one request and a full batch) through the path the engine would
take for each dtype (the packed kernel where one runs, else XLA's dot), alternating the two,
and picks the dtype with the lower geometric mean of times. The choice is cached per CPU,
kernel build and jaxlib version (`<user cache>/jaxserve/dtype/`, with a checksum of its record:
a damaged file is measured again), so it is measured once per
machine (about a second).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.checksum import digest

logger = logging.getLogger(__name__)

SHAPES = ((576, 1536), (1536, 576))  # (K, N): a decode step's MLP products
ROWS = (1, 32)
REPEATS = 15
VERSION = 2  # bump when the measurement changes


def _cache_file(key: str) -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxserve" / "dtype" / f"{key}.json"


def _product(dtype: str, impl: str, k: int, n: int) -> Callable[[jax.Array], jax.Array]:
    """A jitted x [M, K] -> [M, N] float32 product on a random weight, as the engine runs it."""
    rng = np.random.default_rng(0)
    w = (0.05 * rng.standard_normal((k, n))).astype(np.float32)
    if impl != "xla":
        from jaxserve.backends.cpu.kernels.matmul import pack_weight, packed_matmul

        packed = jnp.asarray(pack_weight(w.astype(jnp.dtype(dtype)), tiles=impl == "amx"))
        return jax.jit(lambda x: packed_matmul(x, packed))
    wd = jnp.asarray(w, dtype)
    return jax.jit(lambda x: jnp.einsum("mk,kn->mn", x.astype(wd.dtype), wd, preferred_element_type=jnp.float32))


def measure(impls: dict[str, str]) -> dict[str, float]:
    """Geometric mean time (seconds) per dtype of the products, alternating the dtypes.
    `impls`: dtype -> the product implementation the engine would use for it."""
    cases = [(m, k, n) for m in ROWS for k, n in SHAPES]
    fns = {(d, k, n): _product(d, impl, k, n) for d, impl in impls.items() for _, k, n in cases}
    xs = {m: jnp.asarray(np.random.default_rng(1).standard_normal((m, max(k for k, _ in SHAPES))), jnp.float32)
          for m in ROWS}
    times: dict[tuple, list[float]] = {}
    for (d, k, n), f in fns.items():  # compile and warm
        for m in ROWS:
            jax.block_until_ready(f(xs[m][:, :k]))
    for _ in range(REPEATS):
        for m, k, n in cases:
            for d in impls:
                x = xs[m][:, :k]
                t0 = time.perf_counter()
                jax.block_until_ready(fns[(d, k, n)](x))
                times.setdefault((d, m, k, n), []).append(time.perf_counter() - t0)
    return {d: math.exp(statistics.fmean(math.log(statistics.median(times[(d, m, k, n)])) for m, k, n in cases))
            for d in impls}


def fastest_dtype(impls: dict[str, str], cache_key: str) -> str:
    """"bfloat16" or "float32", whichever `measure` finds faster; cached under `cache_key`."""
    key = hashlib.sha256(f"{VERSION}|{cache_key}|{sorted(impls.items())}".encode()).hexdigest()[:16]
    path = _cache_file(key)
    cached = _read_choice(path)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    times = measure(impls)
    dtype = min(times, key=times.get)
    logger.info("dtype auto: %s (products measured %s, %.1fs; cached in %s)", dtype,
                ", ".join(f"{d} {1e3 * t:.3f} ms ({impls[d]})" for d, t in times.items()),
                time.perf_counter() - t0, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    record = {"dtype": dtype, "seconds": times, "impls": impls}
    tmp.write_text(json.dumps({**record, "checksum": digest(json.dumps(record, sort_keys=True).encode())}))
    os.replace(tmp, path)
    return dtype


def _read_choice(path: pathlib.Path) -> str | None:
    """The cached choice, if the file is there and whole (its checksum agrees and it names one
    of the dtypes); a damaged file is logged by name and measured again."""
    try:
        data = json.loads(path.read_text())
        record = {k: v for k, v in data.items() if k != "checksum"}
        if data["checksum"] == digest(json.dumps(record, sort_keys=True).encode()) and \
                data["dtype"] in ("bfloat16", "float32"):
            return data["dtype"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    logger.warning("the cached dtype choice %s is damaged (its checksum differs); measuring again", path)
    return None
