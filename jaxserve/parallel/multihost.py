"""Serving across hosts: JAX's multi-controller runtime, one leader and headless followers.

Every host runs the same command with its own `--process-id`; `jax.distributed.initialize`
joins them into one global mesh. Process 0, the leader, runs everything a one-process server
runs (HTTP, tokenizer, scheduler, output processing). The others, the followers, load their
weight shards, allocate their KV shards, compile the same buckets in the same order, and then
run the leader's steps: before launching a step the leader sends it to every follower as a step
message (its bucket, the packed step inputs and any sampler rows to write: a few tens of KB),
and each follower launches the same compiled step on it. The collectives inside the step keep
the processes in lockstep; the sampled tokens come back replicated, so the leader reads them
locally. Followers keep no request state.

The messages travel over a host channel (TCP, `multiprocessing.connection` with an HMAC
challenge on a key the leader broadcasts once at start-up), not a device collective: a
`broadcast_one_to_all` of a step message costs ~56 ms on a CPU host (one collective per array),
and idle followers would sit inside a collective, where nothing notices a stuck peer. Before
anything is built, each follower sends the leader a fingerprint of its flags, model and
versions; a mismatch stops it, naming the field. Every "auto" the backend resolves (dtype, KV
dtype, kernels) is resolved once on the leader and sent to the followers.

Failures never hang: the leader's reader thread sees a follower's connection close at once
(even when idle) and fails the engine; a follower whose leader is gone (the connection closes,
or nothing arrives for `step_timeout_seconds`: the leader pings every second) exits non-zero.
A compilation after warm-up is fatal on any process (a follower would otherwise wait forever in
a step the others never run).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import pathlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxserve.runner.compile import CompileCounter
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.sampling.config import SamplerConfig

logger = logging.getLogger(__name__)

MAGIC = b"JXS1"
STEP, PING, SHUTDOWN = 1, 2, 3
# magic, step id, kind, T, R, number of sampler-row writes
HEADER = struct.Struct("<4sQBIII")
PING_SECONDS = 1.0
VERDICT_SECONDS = 2.0  # how long a failed step waits to learn whether a follower is gone


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


# ---------------------------------------------------------------------------- step messages
def encode_step(step_id: int, plan) -> list[bytes]:
    """A step message: the header, then the sampler-row writes and the packed buffers, raw."""
    parts = [HEADER.pack(MAGIC, step_id, STEP, plan.bucket[0], plan.bucket[1], len(plan.slot_writes))]
    for w in plan.slot_writes:
        parts += [np.ascontiguousarray(w.slots).tobytes(), np.ascontiguousarray(w.logit_bias).tobytes(),
                  np.ascontiguousarray(w.bad_words).tobytes()]
    parts += [np.ascontiguousarray(b).tobytes() for b in plan.buffers]
    return parts


def decode_step(data: bytes, runner) -> tuple[int, Any]:
    """(step id, a StepPlan holding what `launch` needs) from a step message; the sizes are
    checked against the runner's layouts (nothing in a message is executed or unpickled)."""
    from jaxserve.runner.model_runner import StepPlan
    from jaxserve.sampling.state import SlotRowsWrite

    magic, step_id, kind, T, R, n_writes = HEADER.unpack_from(data)
    if magic != MAGIC or kind != STEP:
        raise ValueError("not a step message")
    layout = runner.layouts.get((T, R))
    if layout is None:
        raise ValueError(f"a step message for an uncompiled bucket ({T}, {R})")
    empty = runner.empty_slot_write()
    offset = HEADER.size

    def take(shape, dtype) -> np.ndarray:
        nonlocal offset
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if offset + n > len(data):
            raise ValueError("a truncated step message")
        out = np.frombuffer(data, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
        offset += n
        return out

    writes = [SlotRowsWrite(slots=take(empty.slots.shape, np.int32),
                            logit_bias=take(empty.logit_bias.shape, np.float32),
                            bad_words=take(empty.bad_words.shape, np.int32)) for _ in range(n_writes)]
    ranks = (runner.dp,) if runner.dp > 1 else ()  # data parallelism: one row per rank
    buffers = tuple(take((*ranks, n), dt) for n, dt in zip(layout.sizes, layout.dtypes))
    if offset != len(data):
        raise ValueError("a step message with trailing bytes")
    return step_id, StepPlan((T, R), writes, buffers, [], np.zeros(0, np.int64), [], [])


# ---------------------------------------------------------------------------- the leader
class Leader:
    """The leader's end of the channel: accepts every follower, checks its fingerprint, sends
    it the resolved settings, then one message per step (and a ping each idle second)."""

    def __init__(self, topo: Topology, key: bytes, mine: dict[str, Any], *, timeout: float):
        self.topo = topo
        self.failure: BaseException | None = None
        self._failed = threading.Event()
        self.verdict_seconds = VERDICT_SECONDS
        self._callbacks: list[Callable[[BaseException], None]] = []
        self._lock = threading.Lock()
        self._conns: list[tuple[int, Connection]] = []
        self._closed = False
        self.step_id = 0
        self.bytes_sent = 0
        self.send_seconds = 0.0
        self._last_send = time.monotonic()
        listener = Listener(("0.0.0.0", topo.follower_port), authkey=key)
        watchdog = threading.Timer(timeout, listener.close)  # accept() has no timeout of its own
        watchdog.start()
        try:
            while len(self._conns) < topo.num_processes - 1:
                try:
                    conn = listener.accept()
                except OSError:
                    raise TimeoutError(f"{len(self._conns)} of {topo.num_processes - 1} followers connected within "
                                       f"{timeout:.0f} s") from None
                theirs = json.loads(conn.recv_bytes())
                diff = first_difference(mine, theirs["fingerprint"])
                if diff is not None:
                    conn.send_bytes(json.dumps({"error": diff}).encode())
                    conn.close()
                    raise FingerprintMismatch(f"follower {theirs['process_id']} differs from the leader: {diff}")
                self._conns.append((theirs["process_id"], conn))
        finally:
            watchdog.cancel()
            listener.close()

    def send_settings(self, settings: dict[str, Any]) -> None:
        """The leader's resolved settings (the backend's plan), to every follower."""
        for _, conn in self._conns:
            conn.send_bytes(json.dumps({"settings": settings}).encode())

    def start(self) -> None:
        """Watch the followers' connections and ping them while idle (after the handshake)."""
        for pid, conn in self._conns:
            threading.Thread(target=self._watch, args=(pid, conn), name=f"jaxserve-follower-{pid}",
                             daemon=True).start()
        threading.Thread(target=self._ping, name="jaxserve-ping", daemon=True).start()

    def add_failure_callback(self, fn: Callable[[BaseException], None]) -> None:
        self._callbacks.append(fn)
        if self.failure is not None:
            fn(self.failure)

    def _watch(self, pid: int, conn: Connection) -> None:
        try:
            conn.recv_bytes()  # followers send nothing after the handshake: this returns on EOF
            reason = "sent an unexpected message"
        except (EOFError, OSError):
            reason = "closed its connection (the process exited or its host is gone)"
        if not self._closed:
            self._fail(FollowerLostError(f"follower {pid} {reason}"))

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
            self._failed.set()
        logger.error("multi-host serving failed: %s", error)
        for fn in self._callbacks:
            try:
                fn(error)
            except Exception:  # noqa: BLE001 - one callback does not stop the others
                logger.exception("a failure callback failed")

    def explain(self, error: BaseException) -> BaseException:
        """What a failed step means: a follower that died mid-step fails the step's collective
        (a transport error naming nothing) at about the moment its connection closes, in
        either order. Wait briefly for the connection's verdict, which names the follower."""
        if self._failed.wait(self.verdict_seconds):
            return self.failure
        return error

    def _send(self, parts: list[bytes]) -> None:
        data = b"".join(parts)
        with self._lock:
            for pid, conn in self._conns:
                try:
                    conn.send_bytes(data)
                except OSError as e:
                    error = FollowerLostError(f"follower {pid}: sending failed ({e})")
                    threading.Thread(target=self._fail, args=(error,), daemon=True).start()
                    raise error from None
            self.bytes_sent += len(data) * len(self._conns)
            self._last_send = time.monotonic()

    def send_step(self, plan) -> None:
        if self.failure is not None:
            raise self.failure
        t0 = time.perf_counter()
        self.step_id += 1
        self._send(encode_step(self.step_id, plan))
        self.send_seconds += time.perf_counter() - t0

    def _ping(self) -> None:
        while not self._closed and self.failure is None:
            time.sleep(PING_SECONDS / 4)
            if time.monotonic() - self._last_send >= PING_SECONDS:
                try:
                    self._send([HEADER.pack(MAGIC, self.step_id, PING, 0, 0, 0)])
                except FollowerLostError:
                    return

    def close(self) -> None:
        """Tell the followers to shut down (a clean exit for every process)."""
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                self._send([HEADER.pack(MAGIC, self.step_id, SHUTDOWN, 0, 0, 0)])
            except FollowerLostError:
                pass
        for _, conn in self._conns:
            conn.close()


class LeaderRunner:
    """The leader's runner (a `StepRunner` around this process's `ModelRunner`): every step goes
    to the followers before the leader launches it; a compilation after warm-up is fatal (the
    followers would wait in a step never run); sleep mode is refused."""

    def __init__(self, runner: ModelRunner, leader: Leader):
        self.model_runner = runner
        self.leader = leader

    @property
    def sampler_config(self) -> SamplerConfig:
        return self.model_runner.sampler_config

    @property
    def counter(self) -> CompileCounter:
        return self.model_runner.counter

    @property
    def is_sleeping(self) -> bool:
        return False

    def prepare(self, scheduler_output, token_bitmask=None):
        return self.model_runner.prepare(scheduler_output, token_bitmask)

    def launch(self, plan):
        self.leader.send_step(plan)
        try:
            step = self.model_runner.launch(plan)
        except Exception as e:
            self._raise_explained(e)
        if self.model_runner.counter.recompiles:
            raise RuntimeError("a step compiled after warm-up: fatal with several processes")
        return step

    def collect(self, step):
        if self.leader.failure is not None:
            raise self.leader.failure
        try:
            return self.model_runner.collect(step)
        except Exception as e:
            self._raise_explained(e)

    def _raise_explained(self, error: Exception):
        explained = self.leader.explain(error)
        if explained is error:
            raise error
        raise explained from error

    def sleep(self) -> None:
        raise RuntimeError("sleep mode is not available with several processes")

    def wake_up(self) -> None:
        pass  # never asleep


# ---------------------------------------------------------------------------- a follower
class Follower:
    """A follower's end: connects, sends its fingerprint, receives the leader's settings, then
    launches every step it is sent until told to shut down."""

    def __init__(self, topo: Topology, key: bytes, mine: dict[str, Any], *, timeout: float):
        self.topo = topo
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn = Client((topo.leader_host, topo.follower_port), authkey=key)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise LeaderLostError(f"no leader listening on {topo.leader_host}:{topo.follower_port} "
                                          f"after {timeout:.0f} s") from None
                time.sleep(0.2)
        self.conn.send_bytes(json.dumps({"process_id": topo.process_id, "fingerprint": mine}).encode())
        reply = json.loads(self.conn.recv_bytes())
        if "error" in reply:
            raise FingerprintMismatch(f"this follower differs from the leader: {reply['error']}")
        self.settings: dict[str, Any] = reply["settings"]

    def run(self, runner, step_timeout: float) -> None:
        """Launch the leader's steps until SHUTDOWN; raises LeaderLostError when it goes away."""
        import jax

        in_flight = []
        last = 0
        while True:
            if not self.conn.poll(step_timeout):
                raise LeaderLostError(f"nothing from the leader for {step_timeout:.0f} s")
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                raise LeaderLostError("the leader closed the connection") from None
            magic, step_id, kind, *_ = HEADER.unpack_from(data)
            if magic != MAGIC:
                raise LeaderLostError("a message that is not the leader's")
            if kind == PING:
                continue
            if kind == SHUTDOWN:
                jax.block_until_ready([s.out.token_ids for s in in_flight])
                return
            step_id, plan = decode_step(data, runner)
            if step_id != last + 1:
                raise LeaderLostError(f"step {step_id} after {last}: a message was lost")
            last = step_id
            in_flight.append(runner.launch(plan))
            if runner.counter.recompiles:
                raise RuntimeError("a step compiled after warm-up: fatal with several processes")
            if len(in_flight) > 2:  # at most two steps queued ahead of the device
                jax.block_until_ready(in_flight.pop(0).out.token_ids)
