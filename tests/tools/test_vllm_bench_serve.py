"""benchmarks/vllm_bench_serve.py's record of vLLM's speculative-decoding summary: the figures
`vllm bench serve` saves in its result.json (from /metrics' vllm:spec_decode_* deltas) are kept
with each run and summarised per client; runs without speculation record none."""

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
