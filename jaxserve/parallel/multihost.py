"""Serving across hosts: JAX's multi-controller runtime, one leader and headless followers.

Every host runs the same command with its own `--process-id`; `jax.distributed.initialize`
joins them into one global mesh. Process 0, the leader, runs everything a one-process server
runs (HTTP, tokenizer, scheduler, output processing). The others, the followers, load their
weight shards, allocate their KV shards, compile the same buckets in the same order, and then
run the leader's steps, which reach them over the step channel (leader/step_channel.py:
the messages, and what happens when a process fails). Followers keep no request state.

Before anything is built, each follower sends the leader a fingerprint of its flags, model and
versions; a mismatch stops it, naming the field. Every "auto" the backend resolves (dtype, KV
dtype, kernels) is resolved once on the leader and sent to the followers.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import pathlib
import socket
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def exit_now(code: int) -> None:
    """End this process of a multi-host run without the interpreter's exit: JAX's distributed
    shutdown would wait at its barrier for processes that are gone or stuck."""
    logging.shutdown()
    os._exit(code)


class FollowerLostError(RuntimeError):
    """A follower's process died or its connection broke: multi-host serving cannot go on."""

    public = True  # the message names the lost follower and nothing internal: /health shows it


class LeaderLostError(RuntimeError):
    """The leader went away (or stalled past the step timeout)."""


class FingerprintMismatch(RuntimeError):
    """A follower was started with other flags, model or versions than the leader."""


@dataclasses.dataclass(frozen=True)
class Topology:
    process_id: int
    num_processes: int
    leader_host: str
    follower_port: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def initialize(pc) -> Topology | None:
    """Join the processes of a multi-host run (`ParallelConfig`'s coordinator fields); None
    for a single process. Must run before anything touches a JAX backend."""
    if pc.coordinator_address is None:
        if pc.num_processes not in (None, 1) or pc.process_id not in (None, 0):
            raise ValueError("--num-processes / --process-id need --coordinator-address (or 'auto')")
        return None
    import jax

    kwargs: dict[str, Any] = {"heartbeat_timeout_seconds": pc.heartbeat_timeout_seconds}
    if pc.coordinator_address != "auto":
        if pc.num_processes is None or pc.process_id is None:
            raise ValueError("--coordinator-address HOST:PORT needs --num-processes and --process-id "
                             "(or 'auto' to detect a Cloud TPU, SLURM or Kubernetes job)")
        kwargs.update(coordinator_address=pc.coordinator_address, num_processes=pc.num_processes,
                      process_id=pc.process_id)
    jax.distributed.initialize(**kwargs)
    address = pc.coordinator_address if pc.coordinator_address != "auto" else _detected_coordinator()
    host, _, port = address.rpartition(":")
    topo = Topology(jax.process_index(), jax.process_count(), host or "127.0.0.1",
                    pc.follower_port or int(port) + 1)
    logger.info("process %d of %d (%s), %d local and %d global devices", topo.process_id, topo.num_processes,
                "leader" if topo.is_leader else "follower", jax.local_device_count(), jax.device_count())
    return topo


def _detected_coordinator() -> str:
    from jax._src import distributed

    return distributed.global_state.coordinator_address


def shared_key(topo: Topology) -> bytes:
    """32 random bytes drawn by the leader and broadcast to every process (one collective, at
    start-up): the channel's authentication key."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(os.urandom(32), np.uint8) if topo.is_leader else np.zeros(32, np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(mine, is_source=topo.is_leader), np.uint8).tobytes()


def fingerprint(config, model_path: pathlib.Path | None) -> dict[str, Any]:
    """What must agree across processes: every engine option the step or the weights depend on
    (not those marked per-process: the leader's front end and scheduling, each process's caches
    and place in the run; jaxserve.config.PER_PROCESS), the model's identity, and the versions
    of what compiles the step."""
    flat: dict[str, Any] = {}
    for part in dataclasses.fields(config):
        if part.metadata.get("per_process"):
            continue
        value = getattr(config, part.name)
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                if not f.metadata.get("per_process"):
                    flat[f.name] = getattr(value, f.name)
        else:
            flat[part.name] = value
    model: dict[str, Any] = {}
    if model_path is not None:
        config_json = pathlib.Path(model_path) / "config.json"
        model = {"config.json": config_json.read_text() if config_json.is_file() else None}
    versions = {name: _version(name) for name in ("jax", "jaxlib", "flax", "jaxserve")}
    return json.loads(json.dumps({"options": flat, "model": model, "versions": versions}, default=str))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def first_difference(a: dict, b: dict, prefix: str = "") -> str | None:
    """The first field (dotted path) where two fingerprints differ, with both values."""
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            found = first_difference(va, vb, f"{prefix}{key}.")
            if found:
                return found
        elif va != vb:
            return f"{prefix}{key}: leader {va!r}, follower {vb!r}"
    return None


def free_coordinator_port() -> int:
    """A free local port whose successor is free too: a coordinator address for a run of local
    processes (the leader's step channel takes the next port). For tests, benchmarks and
    `shard-plan --hosts`."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
