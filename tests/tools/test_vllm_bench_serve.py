"""benchmarks/vllm_bench_serve.py's record of vLLM's speculative-decoding summary: the figures
`vllm bench serve` saves in its result.json (from /metrics' vllm:spec_decode_* deltas) are kept
with each run and summarised per client; runs without speculation record none. The script's own
reading of the server's counters (/metrics before and after each run) gives the same figures from
the deltas, and the check that vLLM's client's figures are those deltas fails on any difference."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_bench_serve as vbs  # noqa: E402

# The keys vLLM's client writes (vllm/benchmarks/serve.py) beside its usual figures.
RESULT = {"completed": 8, "failed": 0, "duration": 4.0, "total_input_tokens": 1024, "total_output_tokens": 512,
          "output_throughput": 128.0, "request_throughput": 2.0, "median_ttft_ms": 50.0, "p99_ttft_ms": 90.0,
          "median_tpot_ms": 20.0, "median_itl_ms": 30.0, "p99_itl_ms": 60.0}
SPEC = {"spec_decode_acceptance_rate": 40.0, "spec_decode_acceptance_length": 2.2, "spec_decode_num_drafts": 100,
        "spec_decode_draft_tokens": 300, "spec_decode_accepted_tokens": 120,
        "spec_decode_per_position_acceptance_rates": [0.6, 0.4, 0.2]}


def test_runs_without_speculation_record_no_spec_figures():
    figures = vbs.vllm_figures(RESULT)
    assert not any(k.startswith("spec_") for k in figures) and figures["output_tok_s"] == 128.0
    assert vbs.spec_decode_summary([{"client": "vllm:openai", **figures}]) == []


def test_the_spec_decode_section_is_recorded_and_summarised():
    figures = vbs.vllm_figures({**RESULT, **SPEC})
    assert figures["spec_acceptance_rate_pct"] == 40.0 and figures["spec_acceptance_length"] == 2.2
    assert (figures["spec_num_drafts"], figures["spec_draft_tokens"], figures["spec_accepted_tokens"]) == (100, 300, 120)
    assert figures["spec_per_position"] == [0.6, 0.4, 0.2]
    other = vbs.vllm_figures({**RESULT, **SPEC, "spec_decode_acceptance_rate": 50.0,
                              "spec_decode_per_position_acceptance_rates": [0.8, 0.4, 0.1]})
    third = vbs.vllm_figures({**RESULT, **SPEC, "spec_decode_acceptance_rate": 45.0,
                              "spec_decode_per_position_acceptance_rates": [0.7, 0.5, 0.3]})
    runs = [{"client": "vllm:openai", **f} for f in (figures, other, third)]
    runs.append({"client": "serving_benchmark", "output_tok_s": 1.0})
    head, line = vbs.spec_decode_summary(runs)
    assert head.startswith("speculative decoding")
    assert line.startswith("vllm:openai") and "acceptance rate 45.0%" in line
    assert "mean acceptance length 2.20" in line and line.endswith("per position 0.700 0.400 0.200")


def metrics_text(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """A /metrics text as prometheus_client writes jaxserve's speculative-decoding counters
    (HELP/TYPE lines, `_total` and `_created` samples), among other series."""
    labels = 'engine="0",model_name="m"'
    lines = ['# HELP vllm:num_requests_running Number of requests in model execution batches.',
             '# TYPE vllm:num_requests_running gauge', f'vllm:num_requests_running{{{labels}}} 0.0']
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", draft_tokens),
                        ("num_accepted_tokens", accepted)):
        lines += [f"# TYPE vllm:spec_decode_{name} counter",
                  f"vllm:spec_decode_{name}_total{{{labels}}} {value}.0",
                  f"vllm:spec_decode_{name}_created{{{labels}}} 1.7e+09"]
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
    per_pos_name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    for pos, value in enumerate(per_pos):
        lines += [f'{per_pos_name}_total{{{labels},position="{pos}"}} {value}.0',
                  f'{per_pos_name}_created{{{labels},position="{pos}"}} 1.7e+09']
    return "\n".join(lines) + "\n"


def test_the_servers_counters_are_read_from_metrics():
    counters = vbs.server_spec_counters(metrics_text(10, 30, 12, [7, 4, 1]))
    assert counters == {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 12.0,
                        "per_pos": [7.0, 4.0, 1.0]}
    no_spec = metrics_text(0, 0, 0, []).split("# TYPE vllm:spec_decode_num_drafts")[0]
    assert vbs.server_spec_counters(no_spec) == {}


def test_the_clients_figures_are_checked_against_the_counters_deltas():
    before = vbs.server_spec_counters(metrics_text(10, 30, 12, [7, 4, 1]))
    after = vbs.server_spec_counters(metrics_text(110, 330, 132, [67, 44, 21]))
    server = vbs.server_spec_figures(before, after)
    assert (server["server_spec_num_drafts"], server["server_spec_draft_tokens"],
            server["server_spec_accepted_tokens"]) == (100, 300, 120)
    assert server["server_spec_acceptance_rate_pct"] == 40.0
    assert server["server_spec_acceptance_length"] == 2.2
    assert server["server_spec_per_position"] == [0.6, 0.4, 0.2]
    figures = {**vbs.vllm_figures({**RESULT, **SPEC}), **server}
    assert vbs.spec_agrees(figures) is True
    assert vbs.spec_agrees({**figures, "spec_accepted_tokens": 121}) is False
    assert vbs.spec_agrees({**figures, "spec_per_position": [0.6, 0.4]}) is False
    assert vbs.spec_agrees(vbs.vllm_figures({**RESULT, **SPEC})) is None
    assert vbs.server_spec_figures({}, {}) == {}

    runs = [{"client": "vllm:openai", **figures, "spec_agrees": True},
            {"client": "serving_benchmark", "output_tok_s": 1.0, **server}]
    _, vllm_line, ours_line = vbs.spec_decode_summary(runs)
    assert vllm_line.endswith(
        "per position 0.600 0.400 0.200; agrees with /metrics' deltas in every round")
    assert ours_line.startswith("serving_benchmark") and "acceptance rate 40.0%" in ours_line
    assert ours_line.endswith("(/metrics deltas)")
    runs[0]["spec_agrees"] = False
    assert vbs.spec_decode_summary(runs)[1].endswith("DISAGREES with /metrics' deltas")
