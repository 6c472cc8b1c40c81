"""benchmarks/spec_decode_predicted.py without compiling: the speed-up and break-even arithmetic,
the measured acceptance it reads, its JSON rows from step records, and the abstract drafters'
directories it writes (an EAGLE-3 head and a draft model of the target's shape)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import spec_decode_predicted as sdp  # noqa: E402

TARGET = json.loads((ROOT / "jaxserve" / "tools" / "arch_presets" / "smollm2-135m.json").read_text())


def test_speedup_is_tokens_per_step_over_the_steps_cost():
    # a step twice the plain one's, 3 tokens a step: 1.5x; at 2 tokens it breaks even
    assert sdp.predicted_speedup(3.0, 2e-4, 1e-4) == pytest.approx(1.5)
    assert sdp.break_even_acceptance(2e-4, 1e-4) == pytest.approx(2.0)
    assert sdp.predicted_speedup(sdp.break_even_acceptance(3.7e-4, 1.3e-4), 3.7e-4, 1.3e-4) == pytest.approx(1.0)
    assert sdp.predicted_speedup(1.0, 1e-4, 1e-4) == pytest.approx(1.0)  # plain against itself
    assert sdp.step_time_s(1.6e9, 1.6e12) == pytest.approx(1e-3)
    # a tenth of the steps verify (3 tokens, a step of 2 plain): 1.2 tokens for 1.1 plain steps
    assert sdp.predicted_speedup(3.0, 2e-4, 1e-4, 0.1) == pytest.approx(1.2 / 1.1)
    # at the break-even length the share does not matter
    assert sdp.predicted_speedup(2.0, 2e-4, 1e-4, 0.1) == pytest.approx(1.0)
    assert sdp.predicted_speedup(3.0, 2e-4, 1e-4, 0.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        sdp.predicted_speedup(2.0, 0.0, 1e-4)
    with pytest.raises(ValueError):
        sdp.predicted_speedup(2.0, 1e-4, 1e-4, 1.5)


def test_the_verifying_share_is_verifying_steps_over_request_steps():
    # 1006 tokens, 89 accepted drafts: 917 request steps, 87 of them verified drafts
    line = {"output_tokens": 1006, "accepted_tokens": 89, "verifying_steps": 87, "repeats": 1}
    assert sdp.verifying_share(line) == pytest.approx(87 / 917)
    assert sdp.verifying_share({**line, "output_tokens": 503, "repeats": 2}) == pytest.approx(87 / 917)
    assert sdp.verifying_share({"output_tokens": 4, "accepted_tokens": 4, "verifying_steps": 1}) == 0.0


def test_the_measured_acceptance_is_the_last_chat_line_of_each_method_and_c(tmp_path):
    lines = [
        {"workload": "chat", "method": "ngram", "concurrency": 1, "mean_acceptance_length": 1.5},
        {"workload": "repeat", "concurrency": 1, "mean_accepted_length": 3.0},  # the other mode
        {"workload": "chat", "method": "eagle3", "concurrency": 4, "mean_acceptance_length": 1.2},
        {"workload": "chat", "method": "ngram", "concurrency": 1, "mean_acceptance_length": 2.0,
         "commit": "abc"},
    ]
    path = tmp_path / "spec_decode.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    got = sdp.measured_acceptance(path)
    assert sorted(got) == [("eagle3", 4), ("ngram", 1)]
    assert got[("ngram", 1)]["mean_acceptance_length"] == 2.0 and got[("ngram", 1)]["commit"] == "abc"


def test_the_repositorys_chat_acceptance_has_every_compared_method():
    got = sdp.measured_acceptance(sdp.ACCEPTANCE)
    for method in ("ngram", "eagle3"):
        for c in (1, 4, 16):
            assert got[(method, c)]["mean_acceptance_length"] >= 1.0


def _step(target, seqs, bucket, moved, copies=0):
    by_part = {"matmuls": moved - copies, "kv_write": copies}
    return {"target": target, "model": "smollm2-135m", "layers": 30, "context": 1024, "seqs": seqs,
            "bucket": bucket, "dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "attention_impl": "x",
            "kernels": 10, "bytes_moved": moved, "xla_cost_analysis": {"bytes accessed": moved * 0.9},
            "by_part": {p: {"bytes": b} for p, b in by_part.items()}, "minimum": {"total": moved // 2},
            "bytes_over_minimum": 2.0, "cache_copies": 1 if copies else 0, "cache_copy_bytes": copies,
            "hbm_bandwidth": 1.0e12, "compile_s": 1.0, "compile_cached": False, "lower_s": 0.1}


def test_rows_carry_the_prediction_and_its_inputs():
    steps = {("none", 1): _step("v6e:1x1", 1, [1, 1], 100_000_000),
             ("ngram", 1): _step("v6e:1x1", 1, [4, 4], 110_000_000),
             ("eagle3", 1): _step("v6e:1x1", 1, [4, 4], 250_000_000, copies=100_000_000),
             ("draft_model", 1): _step("v6e:1x1", 1, [4, 4], 300_000_000)}
    counts = {"output_tokens": 1000, "accepted_tokens": 500, "verifying_steps": 500}  # all steps verify
    acceptance = {("ngram", 1): {"workload": "chat", "mean_acceptance_length": 2.2, "commit": "c0",
                                 "predicted_accelerator_speedup": 1.1, "output_tokens": 1000,
                                 "accepted_tokens": 120, "verifying_steps": 100},
                  ("eagle3", 1): {"workload": "chat", "mean_acceptance_length": 1.5, "commit": "c0", **counts}}
    rows = sdp.prediction_rows(steps, acceptance, 3)
    assert [r["method"] for r in rows] == ["none", "ngram", "eagle3", "draft_model"]
    none, ngram, eagle3, draft = rows
    assert none["predicted_step_us"] == pytest.approx(100.0) and none["predicted_speedup"] == 1.0
    assert none["num_speculative_tokens"] == 0 and ngram["num_speculative_tokens"] == 3
    assert ngram["predicted_step_us"] == pytest.approx(110.0)
    assert ngram["break_even_acceptance_length"] == pytest.approx(1.1)
    assert ngram["predicted_speedup_every_step_verifying"] == pytest.approx(2.2 / 1.1)
    f = 100 / 880  # 100 of the 880 request steps verified
    assert ngram["verifying_share"] == pytest.approx(f, abs=1e-4)
    assert ngram["predicted_speedup"] == pytest.approx((1 + f * 1.2) / (1 + f * 0.1), rel=1e-3)
    assert none["verifying_share"] == 0.0
    assert ngram["acceptance_source"]["commit"] == "c0"
    assert ngram["acceptance_source"]["weight_formula_speedup"] == 1.1
    assert eagle3["predicted_speedup"] == pytest.approx(1.5 / 2.5)
    # without its 100 MB cache copy the head's step is 1.5 plain steps
    assert eagle3["break_even_without_cache_copies"] == pytest.approx(1.5)
    assert eagle3["predicted_speedup_without_cache_copies"] == pytest.approx(1.0)
    assert draft["mean_acceptance_length"] is None and draft["predicted_speedup"] is None
    assert draft["break_even_acceptance_length"] == pytest.approx(3.0)
    assert all(r["predicted"].startswith("roofline") for r in rows)
    assert eagle3["xla_bytes_accessed"] == pytest.approx(225_000_000)
    assert eagle3["bytes_by_part"] == {"matmuls": 150_000_000, "kv_write": 100_000_000}
    assert "PREDICTED speed-up" in sdp.table(rows).splitlines()[0]
    assert sdp.table(rows).count("\n") == len(rows) + 1


def test_the_abstract_drafters_fit_the_target(tmp_path):
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.eagle3 import Eagle3Config
    from jaxserve.models.loader import load_checkpoint

    target = ArchConfig.from_hf(TARGET)
    head = Eagle3Config.from_hf(load_checkpoint(sdp.eagle3_head_dir(tmp_path, TARGET, 3, 4096)).config)
    assert head.target_layer_ids(target) == (2, 15, 27)
    assert head.layer.hidden_size == target.hidden_size and head.layer.num_layers == 1
    cut = {**TARGET, "num_hidden_layers": 4}
    small = Eagle3Config.from_hf(load_checkpoint(sdp.eagle3_head_dir(tmp_path / "cut", cut, 3, 512)).config)
    assert small.target_layer_ids(ArchConfig.from_hf(cut)) == (0, 2, 4)
    draft = ArchConfig.from_hf(load_checkpoint(sdp.draft_model_dir(tmp_path, TARGET, 4)).config)
    assert draft.num_layers == 4 and draft.vocab_size == target.vocab_size
    assert (draft.num_kv_heads, draft.head_dim) == (target.num_kv_heads, target.head_dim)


def test_a_draft_models_kv_pages_are_counted_by_its_own_config(tmp_path):
    """plan_compile's KV record with `draft_method` "draft_model": a page holds the target's layers
    and the draft model's (all its layers, not an EAGLE-3 head's one)."""
    import jax.numpy as jnp

    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.sharding import load_rules, serving_rules
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.kv_cache import bytes_per_page
    from jaxserve.tools.plan_compile import PlanSettings, kv_record, plan_recipe, resolve_plan

    llama = json.loads((ROOT / "tests" / "data" / "arch" / "llama" / "config.json").read_text())
    draft = sdp.draft_model_dir(tmp_path, llama, 1)
    mesh, rules = make_mesh(1, 1), serving_rules(load_rules("tp"), 1)
    cfg = ArchConfig.from_hf(llama)
    common = dict(arch=llama, platform="cpu", max_model_len=64, max_num_seqs=8, dtype="float32",
                  kv_cache_dtype="float32", kv_cache_memory=1 << 20)
    plain, _, _ = kv_record(PlanSettings(**common), cfg, mesh, rules, "float32")
    settings = PlanSettings(**common, num_speculative_tokens=3, draft_model=draft, draft_method="draft_model")
    rec, num_pages, _ = kv_record(settings, cfg, mesh, rules, "float32")
    draft_page = bytes_per_page(ArchConfig.from_hf({**llama, "num_hidden_layers": 1}), 16, jnp.float32, mesh, rules)
    assert rec["bytes_per_page_per_device"] == plain["bytes_per_page_per_device"] + draft_page
    recipe = plan_recipe(settings, cfg, mesh, rules, resolve_plan(settings, cfg, mesh, rules), num_pages)
    assert (recipe.draft_method, recipe.draft_model, recipe.num_speculative_tokens) == ("draft_model", draft, 3)


def test_the_eagle3_chain_does_not_carry_the_embedding_table(tmp_path):
    """The EAGLE-3 step's chained passes read the draft vocabulary's rows, computed before their
    loop: no loop of the lowered step takes a [V, E] array (a table in a loop's state is copied
    whole where the chip lays it out other than a row lookup wants: TPU)."""
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.sharding import load_rules, serving_rules
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.compile_pool import abstract_step, lower_bucket
    from jaxserve.tools.plan_compile import PlanSettings, kv_record, plan_recipe, resolve_plan

    llama = json.loads((ROOT / "tests" / "data" / "arch" / "llama" / "config.json").read_text())
    head = sdp.eagle3_head_dir(tmp_path, llama, 3, 16)
    mesh, rules = make_mesh(1, 1), serving_rules(load_rules("tp"), 1)
    cfg = ArchConfig.from_hf(llama)
    settings = PlanSettings(arch=llama, platform="cpu", max_model_len=64, max_num_seqs=8,
                            dtype="float32", kv_cache_dtype="float32", kv_cache_memory=1 << 20,
                            num_speculative_tokens=3, draft_model=head, draft_method="eagle3")
    _, num_pages, _ = kv_record(settings, cfg, mesh, rules, "float32")
    plan = resolve_plan(settings, cfg, mesh, rules)
    recipe = plan_recipe(settings, cfg, mesh, rules, plan, num_pages)
    text = lower_bucket(recipe, abstract_step(recipe), (8, 8)).as_text()
    loops = [line for line in text.splitlines() if "stablehlo.while" in line]
    table = f"tensor<{cfg.vocab_size}x{cfg.hidden_size}x"
    assert loops and not [line for line in loops if table in line]
    assert table in text  # the table is an input of the step
