"""Multi-host serving on one machine: 2 processes x 2 simulated CPU devices (gloo) form one
4-device mesh: tensor parallelism across the processes (1 x 4), or a data-parallel rank per
process with tensor parallelism within it (2 x 2). Through `jaxserve serve` over HTTP and
through `LLM.generate`, outputs equal the single-process engine's; then the failure paths."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxserve import LLM, SamplingParams
from tests.model_dirs import write_model_dir
from tests.parallel import multihost_harness as mh

pytestmark = pytest.mark.multihost

# Tiny Llama: 8 KiB of KV per page; 16 pages (240 tokens besides the null page) make a few
# concurrent requests of 88 tokens preempt.
FLAGS = ["--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "16", "--token-buckets", "16",
         "--request-buckets", "8", "--max-model-len", "96", "--kv-cache-memory", str(16 * 8192)]
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(16,),
               request_buckets=(8,), max_model_len=96, kv_cache_memory_bytes=16 * 8192, show_progress=False)
LONG = list(range(20, 60))  # 40 tokens: prefilled in chunks of 16
# Options of the leader's front end and scheduler, and of each process's own caches: a follower
# may be started with other values (or none) of these.
FRONT_END_FLAGS = ["--served-model-name", "other-name", "--api-key", "follower-key", "--port", "1",
                   "--generation-config", "vllm", "--no-enable-prefix-caching", "--scheduling-policy", "priority",
                   "--max-waiting-requests", "3", "--request-timeout", "5", "--no-executable-cache"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("mh") / "llama")


@pytest.fixture(scope="module")
def reference(model_dir, compile_cache_dir):
    return LLM(str(model_dir), compilation_cache_dir=compile_cache_dir, **OPTIONS)


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 8, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"vllm:{name}"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


def _serves_like_one_process(url: str, reference) -> None:
    """Greedy, chunked prefill, a prefix hit, preemption, n = 2 seeded, prompt logprobs and an
    abort over HTTP, each as the single-process engine gives it."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    ref = {tuple(o.prompt_token_ids): o.outputs[0].text
           for o in reference.generate([[5, 6, 7, 8], LONG], greedy, use_tqdm=False)}
    for prompt in ([5, 6, 7, 8], LONG, LONG):  # the second LONG hits the prefix cache
        assert _complete(url, prompt=prompt)["choices"][0]["text"] == ref[tuple(prompt)]
    assert _metric(url, "prefix_cache_hits_total") >= 32
    # preemption: 6 prompts of 72 + 16 tokens (one request: queued at once) need 36 pages of
    # 16; the cache has 15 (per data-parallel rank: 3 requests need 18)
    prompts = [[7 + i, *range(21, 92)] for i in range(6)]
    got = _complete(url, prompt=prompts, max_tokens=16)
    assert _metric(url, "num_preemptions_total") > 0
    want = reference.generate(prompts, greedy.clone(max_tokens=16), use_tqdm=False)
    assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == [o.outputs[0].text for o in want]
    # n = 2 and a seeded sample
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2)
    (ref_n,) = reference.generate([[9, 10, 11]], sampled, use_tqdm=False)
    got = _complete(url, prompt=[9, 10, 11], temperature=0.8, seed=7, n=2)
    assert sorted(c["text"] for c in got["choices"]) == sorted(o.text for o in ref_n.outputs)
    # prompt logprobs
    (ref_p,) = reference.generate([LONG[:20]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
                                  use_tqdm=False)
    got = _complete(url, prompt=LONG[:20], max_tokens=2, prompt_logprobs=1)["choices"][0]["prompt_logprobs"]
    for pos in range(1, 20):
        tok = LONG[pos]
        assert abs(got[pos][str(tok)]["logprob"] - ref_p.prompt_logprobs[pos][tok].logprob) < 1e-4
    # an abort: a stream dropped after its first chunk; the run keeps serving, nothing leaks
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": LONG, "max_tokens": 40, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    assert _complete(url, prompt=[5, 6, 7, 8])["choices"][0]["text"]
    deadline = time.monotonic() + 30
    while _metric(url, "num_requests_running") or _metric(url, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.2)


def test_serve_across_two_processes_then_lose_a_follower(model_dir, reference):
    """1 x 4 mesh over two processes (tensor parallelism across them) serves as one process
    does; then SIGKILL the follower mid-generation: the request fails, /health says which
    follower is gone, and the leader exits non-zero within 10 s."""
    procs, url = mh.start_serve(model_dir, [*FLAGS, "--tensor-parallel-size", "4"])
    try:
        mh.wait_healthy(procs, url)
        _serves_like_one_process(url, reference)

        # Lose the follower in the middle of a long generation.
        events: list[str] = []

        def stream() -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", timeout=60,
                                  json={"prompt": [5, 6], "max_tokens": 90, "ignore_eos": True, "stream": True}) as r:
                    events.extend(line for line in r.iter_lines() if line.startswith("data: "))
            except httpx.HTTPError as e:
                events.append(f"closed: {e!r}")

        client = threading.Thread(target=stream)
        client.start()
        while not events:
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        health = None
        while procs[0].poll() is None and time.monotonic() - t0 < 15:
            try:
                r = httpx.get(url + "/health", timeout=1)
                if r.status_code == 503:
                    health = r.json()["error"]["message"]
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert procs[0].wait(15) != 0 and time.monotonic() - t0 < 10
        client.join(30)
        assert "follower 1" in (health or ""), health
        assert events[-1].startswith("closed") or events[-1] == "data: [DONE]" and '"error"' in events[-2]
    finally:
        mh.stop(procs)


def test_serve_data_parallel_across_two_processes_then_sigterm(model_dir, reference):
    """2 x 2 mesh over two processes (a data-parallel rank per process, tensor parallelism
    within it) serves as one process does; SIGTERM on the leader drains it, shuts the follower
    down, and both exit 0."""
    # Each rank has its own KV pages: a smaller budget per device, so that each rank preempts.
    flags = [*FLAGS, "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-num-batched-tokens", "32",
             "--kv-cache-memory", str(8 * 8192)]
    # The follower is started without the leader's front-end options, and with others: only
    # what the step depends on must agree.
    procs, url = mh.start_serve(model_dir, flags, per_process=[[], FRONT_END_FLAGS])
    try:
        mh.wait_healthy(procs, url)
        _serves_like_one_process(url, reference)
        procs[0].send_signal(signal.SIGTERM)
        assert (procs[0].wait(60), procs[1].wait(60)) == (0, 0)
    finally:
        mh.stop(procs)


def test_a_lost_leader_ends_its_followers(model_dir):
    """A leader that dies (SIGKILL) leaves its follower to exit non-zero within seconds (SIGTERM:
    see the data-parallel serve test)."""
    procs, url = mh.start_serve(model_dir, [*FLAGS, "--tensor-parallel-size", "4"])
    try:
        mh.wait_healthy(procs, url)
        assert _complete(url, prompt=[5, 6, 7])["choices"][0]["text"]
        procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        assert procs[1].wait(60) != 0 and time.monotonic() - t0 < 10
    finally:
        mh.stop(procs)


def test_a_follower_started_differently_stops_naming_the_flag(model_dir):
    procs, _ = mh.start_serve(model_dir, [*FLAGS, "--tensor-parallel-size", "4"],
                              per_process=[[], ["--max-num-seqs", "4"]])
    try:
        assert procs[1].wait(120) == 2
        out = procs[1].stdout.read()
        assert "max_num_seqs" in out and "leader 8, follower 4" in out, out[-2000:]
        assert procs[0].wait(60) != 0  # the leader does not wait forever either
    finally:
        mh.stop(procs)


SCRIPT = """
import json, sys
from jaxserve import LLM, SamplingParams
out, options = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(**options)
greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
prompts = [[5, 6, 7, 8], list(range(20, 60)), list(range(20, 60))]
res = llm.generate(prompts, greedy, use_tqdm=False)
res += llm.generate([[9, 10, 11]], SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2), use_tqdm=False)
json.dump([[o.token_ids for o in r.outputs] for r in res], open(out, "w"))
print("channel", llm.engine.parts.link.bytes_sent, llm.engine.parts.link.step_id, llm.engine.parts.link.send_seconds)
"""


@pytest.mark.parametrize("dp,tp", [(1, 4), (2, 2)], ids=["tp4", "dp2-tp2"])
def test_llm_generate_across_two_processes(model_dir, reference, tmp_path, dp, tp):
    """LLM.generate over two processes: tensor parallelism across them, or data parallelism
    across them (a rank per process, its pages and scheduler there) with tensor parallelism
    within each."""
    port = mh.free_port()
    procs = []
    for pid in range(2):
        opts = dict(OPTIONS, model=str(model_dir), data_parallel_size=dp, tensor_parallel_size=tp,
                    max_num_batched_tokens=16 * dp, coordinator_address=f"127.0.0.1:{port}",
                    num_processes=2, process_id=pid, heartbeat_timeout_seconds=60, step_timeout_seconds=30)
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "out.json"), json.dumps(opts)],
                                      env=mh.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    finally:
        mh.stop(procs)
    got = json.loads((tmp_path / "out.json").read_text())
    prompts = [[5, 6, 7, 8], list(range(20, 60)), list(range(20, 60))]
    want = reference.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    want += reference.generate([[9, 10, 11]], SamplingParams(max_tokens=8, temperature=0.8, seed=7, n=2),
                               use_tqdm=False)
    assert got == [[o.token_ids for o in r.outputs] for r in want]
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("channel"))
    _, sent, steps, seconds = line.split()
    assert int(steps) > 0 and int(sent) / int(steps) < 64 * 1024  # small step messages


def test_only_what_the_step_depends_on_must_agree():
    """The fingerprint processes compare: per-process options (front end, scheduling policy,
    caches, place in the run) are left out, anything the step depends on is in."""
    from jaxserve.config import EngineConfig
    from jaxserve.parallel.multihost import fingerprint, first_difference

    leader = EngineConfig.from_kwargs(model="/models/a", **OPTIONS, process_id=0)
    follower = EngineConfig.from_kwargs(
        model="/mnt/elsewhere/a", **{**OPTIONS, "show_progress": True}, served_model_name="x", process_id=1,
        generation_config="vllm", enable_prefix_caching=False, policy="priority", async_scheduling=False,
        compilation_cache_dir="/tmp/other", enable_executable_cache=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert first_difference(fingerprint(leader, None), fingerprint(follower, None)) is None
    for option, value in (("max_num_seqs", 4), ("dtype", "bfloat16"), ("page_size", 32), ("max_logprobs", 5),
                          ("token_buckets", (16, 32)), ("sharding_rules", "fsdp"), ("seed", 3)):
        other = EngineConfig.from_kwargs(model="/models/a", **{**OPTIONS, option: value})
        assert option in first_difference(fingerprint(leader, None), fingerprint(other, None)), option


def test_a_step_failed_by_a_lost_follower_names_the_follower():
    """A follower killed mid-step fails the step's collective with a transport error at about the
    moment its connection closes, in either order: the step's error is the connection's verdict
    (which /health shows) when it comes soon after, and the step's own error otherwise."""
    from jaxserve.leader.step_channel import Leader, LeaderRunner
    from jaxserve.parallel.multihost import FollowerLostError, Topology, free_coordinator_port

    class FailingRunner:
        def collect(self, step):
            raise RuntimeError("gloo: connection reset by peer")

    leader = Leader(Topology(0, 1, "127.0.0.1", free_coordinator_port()), b"k" * 32, {}, timeout=5)
    runner = LeaderRunner(FailingRunner(), leader)
    lost = FollowerLostError("follower 1 closed its connection")
    threading.Timer(0.3, leader._fail, args=(lost,)).start()  # the watcher reports after the step failed
    with pytest.raises(FollowerLostError, match="follower 1") as caught:
        runner.collect(None)
    assert isinstance(caught.value.__cause__, RuntimeError)

    alone = LeaderRunner(FailingRunner(), Leader(Topology(0, 1, "127.0.0.1", free_coordinator_port()),
                                                 b"k" * 32, {}, timeout=5))
    alone.leader.verdict_seconds = 0.2  # the wait for a verdict is bounded
    with pytest.raises(RuntimeError, match="gloo"):
        alone.collect(None)
    leader.close(), alone.leader.close()


FAILING_SCRIPT = """
import json, sys
import jaxserve.engine.setup as setup
options, failing = json.loads(sys.argv[1]), int(sys.argv[2])
if options["process_id"] == failing:  # this process's build fails after the processes joined
    def broken(*args, **kwargs):
        raise RuntimeError("a start-up failure of this process")
    setup.ModelRunner = broken
from jaxserve import LLM
LLM(**options)
"""


@pytest.mark.parametrize("failing", [0, 1], ids=["leader", "follower"])
def test_a_start_up_failure_after_joining_ends_every_process(model_dir, failing):
    """A process whose engine build fails after the processes joined (the others are compiling or
    waiting in a start-up collective for it) tells them why: every process exits non-zero within
    seconds, the others naming the failed one and its error, instead of waiting forever."""
    port = mh.free_port()
    procs = []
    for pid in range(2):
        opts = dict(OPTIONS, model=str(model_dir), tensor_parallel_size=4, coordinator_address=f"127.0.0.1:{port}",
                    num_processes=2, process_id=pid, heartbeat_timeout_seconds=60, step_timeout_seconds=30)
        procs.append(subprocess.Popen([sys.executable, "-c", FAILING_SCRIPT, json.dumps(opts), str(failing)],
                                      env=mh.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        mh.stop(procs)
    assert [p.returncode != 0 for p in procs] == [True, True], outs
    assert "a start-up failure of this process" in outs[failing], outs[failing][-3000:]
    other = outs[1 - failing]
    name = "leader" if failing == 0 else "follower 1"
    assert f"the {name} failed during start-up: RuntimeError: a start-up failure" in other, other[-3000:]
