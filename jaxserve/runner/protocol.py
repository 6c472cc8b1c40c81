"""What the engine core needs of a runner: `StepRunner`.

Implemented by `ModelRunner` (the compiled steps on this process's devices), by the multi-host
leader's `LeaderRunner` (each step sent to the followers before it is launched here) and by the
tests' fakes. A step goes prepare (host: pack the step's typed batch, `StepBatch`: the scheduler's
snapshot, no live `Request`; None when there is nothing to run) ->
launch (dispatch; returns at once) -> collect (wait, bring the sampled tokens to the host).
The core passes every argument by position (the protocol's parameters are positional-only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from jaxserve.core.sched_output import StepBatch
    from jaxserve.runner.compile import CompileCounter
    from jaxserve.runner.model_runner import RunnerOutput
    from jaxserve.sampling.config import SamplerConfig


@runtime_checkable
class StepRunner(Protocol):
    @property
    def sampler_config(self) -> SamplerConfig: ...

    @property
    def counter(self) -> CompileCounter: ...  # compiles, and recompiles after warm-up

    @property
    def is_sleeping(self) -> bool: ...

    def prepare(self, batch: StepBatch, token_bitmask: np.ndarray | None = None, /
                ) -> Any | None: ...

    def launch(self, plan: Any, /) -> Any: ...

    def collect(self, step: Any, /) -> RunnerOutput: ...

    def sleep(self) -> None: ...  # free the device memory of the weights and the KV cache

    def wake_up(self) -> None: ...
