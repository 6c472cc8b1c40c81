"""Where start-up time goes: the wall time of each phase, logged once when serving begins.

`jaxserve serve` logs one line such as

    start-up 7.4 s since launch: imports 1.3 s, tokenizer 0.6 s, weights 1.2 s, ... executables
    0.7 s (11 loaded, 0 compiled), server 0.2 s

so that a slow restart names its phase. Phases nest (a phase's time is its own: the time of
the phases inside it is not counted twice); unnamed gaps count as "other".
"""

from __future__ import annotations

import contextlib
import os
import time


def process_age() -> float | None:
    """Seconds since this process was launched (Linux: /proc), or None where unknown."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22 (starttime, clock ticks after boot) follows the command name in parentheses.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    """Accumulates the wall time of named phases (`with timer.phase("weights"): ...`)."""

    def __init__(self, since_launch: bool = False) -> None:
        """since_launch: count from the process's launch (the CLI, created first thing in
        main), the time before this timer existed (the interpreter, imports) as "imports"."""
        self.phases: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self._stack: list[list[float]] = []  # per open phase: [start, time of inner phases]
        self.created = time.perf_counter()
        age = process_age() if since_launch else None
        self.before = age if age is not None else 0.0

    @contextlib.contextmanager
    def phase(self, name: str):
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield self
        finally:
            self._stack.pop()
            total = time.perf_counter() - frame[0]
            self.phases[name] = self.phases.get(name, 0.0) + total - frame[1]
            if self._stack:
                self._stack[-1][1] += total

    def add(self, name: str, seconds: float) -> None:
        """Count `seconds` to phase `name` (time measured outside a `with phase`)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def note(self, name: str, text: str) -> None:
        """A remark printed after the phase's time (e.g. "11 loaded, 0 compiled")."""
        self.notes[name] = text

    def elapsed(self) -> float:
        """Seconds since launch (or since this timer was created, where the launch is unknown)."""
        return self.before + time.perf_counter() - self.created

    def summary(self) -> str:
        total = self.elapsed()
        parts = []
        if self.before:
            parts.append(("imports", self.before))
        parts += list(self.phases.items())
        other = total - sum(t for _, t in parts)
        if other >= 0.05:
            parts.append(("other", other))
        body = ", ".join(f"{name} {t:.2f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
                         for name, t in parts)
        since = "since launch" if self.before else "since the engine build began"
        return f"start-up {total:.1f} s {since}: {body}"
