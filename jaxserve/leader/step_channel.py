"""The step channel of a multi-host run (parallel/multihost.py): the leader sends every step to
the followers before launching it.

A step message holds the step's bucket, the packed step inputs and any sampler rows to write (a
few tens of KB); each follower launches the same compiled step on it. The collectives inside
the step keep the processes in lockstep; the sampled tokens come back replicated, so the leader
reads them locally.

The messages travel over a host channel (TCP, `multiprocessing.connection` with an HMAC
challenge on a key the leader broadcasts once at start-up), not a device collective: a
`broadcast_one_to_all` of a step message costs ~56 ms on a CPU host (one collective per array),
and idle followers would sit inside a collective, where nothing notices a stuck peer.

Failures never hang: the leader's reader thread sees a follower's connection close at once
(even when idle) and fails the engine; a step that a dying follower's collective failed waits
briefly for that verdict, so the error names the follower; a follower whose leader is gone
(the connection closes, or nothing arrives for `step_timeout_seconds`: the leader pings every
second) exits non-zero. During start-up (after the handshake, until serving) a process whose
build fails sends the others an abort naming its error and exits as usual (through JAX's
distributed shutdown, a barrier of every process). The others may be inside a compile or a
start-up collective that would wait forever for it, so each process watches its connections
on a thread meanwhile: on an abort it logs the reason (the leader passes it on to the other
followers), joins the shutdown barrier from that thread and exits; on a connection closed (the
process died: it will never reach the barrier) it exits at once (`exit_now`). A compilation
after warm-up is fatal on any process (a follower would otherwise wait forever in a step the
others never run).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxserve.parallel.multihost import (FingerprintMismatch, FollowerLostError, LeaderLostError, Topology,
                                         exit_now, first_difference)

if TYPE_CHECKING:
    from jaxserve.runner.compile import CompileCounter
    from jaxserve.runner.model_runner import ModelRunner
    from jaxserve.sampling.config import SamplerConfig

logger = logging.getLogger(__name__)

MAGIC = b"JXS1"
STEP, PING, SHUTDOWN, ABORT = 1, 2, 3, 4
# magic, step id, kind, T, R, number of sampler-row writes
HEADER = struct.Struct("<4sQBIII")
PING_SECONDS = 1.0
VERDICT_SECONDS = 2.0  # how long a failed step waits to learn whether a follower is gone


def _abort_message(reason: str) -> bytes:
    return HEADER.pack(MAGIC, 0, ABORT, 0, 0, 0) + reason.encode()[:4000]


def _read_abort(data: bytes) -> str | None:
    """The reason of an abort message; None for any other message."""
    if len(data) >= HEADER.size:
        magic, _, kind, *_ = HEADER.unpack_from(data)
        if magic == MAGIC and kind == ABORT:
            return data[HEADER.size:].decode(errors="replace")
    return None


class _StartupWatch:
    """Watches connections while this process builds its engine (see the module docstring):
    `on_abort(name, reason)` when the process `name` sends an abort; a closed connection ends
    this process at once. `stop()` hands the connections over to the serving loop; a message
    that is neither an abort nor a ping is kept for it (`pending`)."""

    def __init__(self, conns: list[tuple[str, Connection]], on_abort: Callable[[str, str], None]):
        self._stop = threading.Event()
        self._on_abort = on_abort
        self.pending: list[bytes] = []
        self._threads = [threading.Thread(target=self._watch, args=(name, conn), daemon=True,
                                          name=f"jaxserve-startup-watch-{name}") for name, conn in conns]
        for t in self._threads:
            t.start()

    def _watch(self, name: str, conn: Connection) -> None:
        while not self._stop.is_set():
            try:
                if not conn.poll(0.2):
                    continue
                data = conn.recv_bytes()
            except (EOFError, OSError):
                if not self._stop.is_set():
                    logger.error("exiting: the %s closed its connection during start-up", name)
                    exit_now(1)
                return
            reason = _read_abort(data)
            if reason is not None:
                self._on_abort(name, reason)
                return
            if HEADER.unpack_from(data)[2] != PING:
                self.pending.append(data)
                return

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()


def _abort_heard(name: str, reason: str) -> None:
    """Another process's start-up failed (it exits through the shutdown barrier): join the
    barrier from this thread (the main one may be stuck in a collective) and exit."""
    logger.error("exiting: the %s failed during start-up: %s", name, reason)
    try:
        import jax

        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - exiting regardless
        logger.debug("distributed shutdown failed", exc_info=True)
    exit_now(1)


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
    return step_id, StepPlan((T, R), writes, buffers)  # nothing to read back: the leader collects


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
        self._startup: _StartupWatch | None = None

    def send_settings(self, settings: dict[str, Any]) -> None:
        """The leader's resolved settings (the backend's plan), to every follower."""
        for _, conn in self._conns:
            conn.send_bytes(json.dumps({"settings": settings}).encode())

    def watch_startup(self) -> None:
        """While the engine builds: a follower that fails or goes away ends this process."""
        self._startup = _StartupWatch([(f"follower {pid}", conn) for pid, conn in self._conns],
                                      self._follower_aborted)

    def _follower_aborted(self, name: str, reason: str) -> None:
        self.abort(f"{name} failed: {reason}")  # the other followers exit with the leader
        _abort_heard(name, reason)

    def abort(self, reason: str) -> None:
        """This process's start-up failed: tell every follower why, and close."""
        if self._startup is not None:
            self._startup.stop()
        self._closed = True
        for _, conn in self._conns:
            try:
                conn.send_bytes(_abort_message(reason))
                conn.close()
            except OSError:
                pass

    def start(self) -> None:
        """Watch the followers' connections and ping them while idle (once serving)."""
        if self._startup is not None:
            self._startup.stop()
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

    def prepare(self, batch, token_bitmask=None):
        return self.model_runner.prepare(batch, token_bitmask)

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
        self._startup: _StartupWatch | None = None

    def watch_startup(self) -> None:
        """While the engine builds: a leader that fails or goes away ends this process."""
        self._startup = _StartupWatch([("leader", self.conn)], _abort_heard)

    def abort(self, reason: str) -> None:
        """This process's start-up failed: tell the leader why, and close."""
        if self._startup is not None:
            self._startup.stop()
        try:
            self.conn.send_bytes(_abort_message(reason))
            self.conn.close()
        except OSError:
            pass

    def run(self, runner, step_timeout: float) -> None:
        """Launch the leader's steps until SHUTDOWN; raises LeaderLostError when it goes away."""
        import jax

        pending = []
        if self._startup is not None:
            self._startup.stop()
            pending = self._startup.pending
        in_flight = []
        last = 0
        while True:
            if pending:
                data = pending.pop(0)
            else:
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
            if kind == ABORT:
                raise LeaderLostError(f"the leader failed: {_read_abort(data)}")
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
