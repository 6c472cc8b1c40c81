"""The engine core is typed against two protocols, `StepScheduler` and `StepRunner`, and the
core loop against a third, `Core` (the generation core and the pooling core): every
implementation provides each member with the protocol's parameters (not only its name, which is
all `isinstance` checks), and the multi-host leader's runner does what its protocol promises."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

from jaxserve.config import SchedulerConfig
from jaxserve.core.dp_scheduler import DataParallelOutput, DataParallelScheduler
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.protocol import ScheduledStep, StepScheduler
from jaxserve.core.sched_output import SchedulerOutput
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.core import EngineCore
from jaxserve.engine.core_loop import Core
from jaxserve.engine.pooling_core import PoolingCore
from jaxserve.leader.step_channel import LeaderRunner
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.protocol import StepRunner
from tests.engine.fakes import FakeRunner


def _members(proto) -> dict[str, object]:
    """The protocol's own methods and properties, and its annotated attributes (as None)."""
    own = {n: v for n, v in vars(proto).items() if not n.startswith("_")}
    return {**own, **{n: None for n in proto.__annotations__}}


def _init_assigns(cls) -> set[str]:
    """Attributes `cls.__init__` assigns on self."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in ast.walk(t) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}


_MISSING = object()


def _accepts(want: list[inspect.Parameter], have: list[inspect.Parameter]) -> bool:
    """Whether parameters `have` take every call `want` allows: positional-only ones by position
    (any name), the others by name; `have`'s extra parameters need defaults."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(have) < len(want):
        return False
    for w, h in zip(want, have):
        if h.kind not in positional or (w.kind is not inspect.Parameter.POSITIONAL_ONLY and w.name != h.name):
            return False
        if w.default is not inspect.Parameter.empty and h.default is inspect.Parameter.empty:
            return False
    return all(h.default is not inspect.Parameter.empty for h in have[len(want):])


def missing(proto, cls) -> list[str]:
    """What `cls` lacks of `proto`: a member not provided, or a method that does not take the
    protocol's arguments."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    assigned = _init_assigns(cls) if "__init__" in vars(cls) and not fields else set()
    gaps = []
    for name, member in _members(proto).items():
        if name in fields or name in assigned:
            continue
        impl = inspect.getattr_static(cls, name, _MISSING)
        if impl is _MISSING:
            gaps.append(f"{name}: missing")
        elif callable(member) and not isinstance(member, property):
            want = list(inspect.signature(member).parameters.values())[1:]
            params = list(inspect.signature(impl).parameters.values())[1:]
            if not _accepts(want, params):
                gaps.append(f"{name}{tuple(p.name for p in params)}: the protocol has "
                            f"{tuple(p.name for p in want)}")
    return sorted(gaps)


@pytest.mark.parametrize("cls", [Scheduler, DataParallelScheduler])
def test_both_schedulers_are_step_schedulers(cls):
    assert missing(StepScheduler, cls) == []


def test_scheduler_instances_pass_the_runtime_check():
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    kv = lambda: KVCacheManager(4, 32, True, 64)  # noqa: E731
    assert isinstance(Scheduler(sc, kv()), StepScheduler)
    assert isinstance(DataParallelScheduler(sc, [kv(), kv()]), StepScheduler)


@pytest.mark.parametrize("cls", [SchedulerOutput, DataParallelOutput])
def test_both_step_plans_are_scheduled_steps(cls):
    assert missing(ScheduledStep, cls) == []
    # the core adds the releases of a discarded step with dataclasses.replace
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


@pytest.mark.parametrize("cls", [ModelRunner, LeaderRunner, FakeRunner])
def test_every_runner_is_a_step_runner(cls):
    assert missing(StepRunner, cls) == []


@pytest.mark.parametrize("cls", [EngineCore, PoolingCore])
def test_both_engine_cores_are_what_the_loop_drives(cls):
    assert missing(Core, cls) == []


def test_the_check_finds_a_missing_member_and_a_changed_signature():
    class Partial:
        sampler_config = counter = is_sleeping = None

        def prepare(self, batch):  # the bitmask parameter is gone
            return None

        def launch(self, plan): ...

        def sleep(self): ...

        def wake_up(self): ...

    assert missing(StepRunner, Partial) == [
        "collect: missing", "prepare('batch',): the protocol has ('batch', 'token_bitmask')"]

    class Renamed:
        def update_from_output(self, out, sampled, keep=1): ...  # positional-only: any names

        def discard_step(self, out, more): ...  # a second parameter without a default

    gaps = missing(StepScheduler, Renamed)
    assert "update_from_output: missing" not in gaps and not any(g.startswith("update_from_output(") for g in gaps)
    assert "discard_step('out', 'more'): the protocol has ('scheduler_output',)" in gaps


class _Runner:
    """A device runner that records what happened, in order."""

    def __init__(self, log):
        self.log, self.recompile = log, False
        self.sampler_config = object()
        self.counter = type("C", (), {"recompiles": 0})()

    def prepare(self, so, token_bitmask=None):
        self.log.append(("prepare", so, token_bitmask))
        return "plan"

    def launch(self, plan):
        self.log.append(("launch", plan))
        if self.recompile:
            self.counter.recompiles = 1
        return "step"

    def collect(self, step):
        self.log.append(("collect", step))
        return "output"


class _Leader:
    def __init__(self, log):
        self.log, self.failure = log, None

    def send_step(self, plan):
        self.log.append(("send", plan))


def test_the_leader_sends_each_step_before_it_launches_it_and_forwards_the_rest():
    log = []
    device, leader = _Runner(log), _Leader(log)
    runner = LeaderRunner(device, leader)
    assert runner.model_runner is device and runner.sampler_config is device.sampler_config
    assert runner.counter is device.counter and runner.is_sleeping is False
    plan = runner.prepare("so", "mask")
    assert runner.collect(runner.launch(plan)) == "output"
    assert log == [("prepare", "so", "mask"), ("send", "plan"), ("launch", "plan"), ("collect", "step")]
    with pytest.raises(RuntimeError, match="sleep mode is not available"):
        runner.sleep()
    leader.failure = ConnectionError("follower 1 lost")
    with pytest.raises(ConnectionError, match="follower 1"):
        runner.collect("step")
    leader.failure, device.recompile = None, True
    with pytest.raises(RuntimeError, match="compiled after warm-up"):
        runner.launch("plan")
