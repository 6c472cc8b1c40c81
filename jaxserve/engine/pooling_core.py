"""PoolingCore: the engine core of --runner pooling (embeddings; see DESIGN §4c).

An embedding is one prefill with no future, computed whole inside the `embed` call, so this
core holds the PoolingRunner alone: no scheduler, no steps, no grammars. It answers the same
commands as the generation core (core_loop.Core), in order with them on the core's thread or
in its process: `embed`, `stats`, `reset_prefix_cache` (nothing is cached); it refuses
generation requests (the frontend refuses them first, with a 400 naming the runner) and sleep
mode.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxserve.core.scheduler import SchedulerStats
from jaxserve.engine.embedding import NOT_GENERATING
from jaxserve.engine.messages import EngineCoreOutput, EngineStats
from jaxserve.request import EngineRequest
from jaxserve.runner.pooling_runner import PoolingRunner



class PoolingCore:
    def __init__(self, runner: PoolingRunner):
        self.runner = runner

    # ------------------------------------------------------------------ requests (none)
    def add_request(self, request: EngineRequest) -> None:
        raise ValueError(NOT_GENERATING)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Nothing runs between commands: every id is unknown, and ignored."""

    def abort_all(self) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def step(self) -> list[EngineCoreOutput]:
        return []

    # ------------------------------------------------------------------ commands
    def embed(self, prompts: list[list[int]]) -> np.ndarray:
        """[len(prompts), hidden] float32 pooled embeddings."""
        return self.runner.embed(prompts)

    def stats(self) -> EngineStats:
        c = self.runner.counter
        idle = SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=0,
                              prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
        return EngineStats(idle, c.num_compiles, c.recompiles, c.compile_seconds, 0, False)

    def reset_prefix_cache(self) -> bool:
        return True  # there is no prefix cache: nothing outlives an embed call

    @property
    def is_sleeping(self) -> bool:
        return False

    def sleep(self) -> None:
        raise RuntimeError("sleep mode is not available with --runner pooling")

    def wake_up(self) -> None:
        raise RuntimeError("sleep mode is not available with --runner pooling")
