"""`jaxserve shard-plan`: predicted bytes equal the live buffers', the worker processes, the
reports, and reading models without their weights."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.sharding import load_rules, serving_rules
from jaxserve.models.weights import create_model
from jaxserve.parallel.mesh import make_mesh
from jaxserve.runner.kv_cache import allocate_kv_cache
from jaxserve.server.cli import main
from jaxserve.tools.plan_compile import PlanSettings, plan_one
from jaxserve.tools.shard_plan import ARCH_PRESETS, factorizations, model_config

FIXTURE = pathlib.Path(__file__).parent.parent / "data" / "arch"
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
            max_position_embeddings=512, tie_word_embeddings=False)
QWEN3 = model_config(str(FIXTURE / "qwen3"))[1]  # the command's model, as it reads it


# (tp-replicate-vocab and tp-kv-replicated differ from tp only in one axis each, whose bytes the
# same accounting counts; the fsdp case splits the weights over data-parallel ranks; every
# preset's numerics: tests/models/test_sharding_rules.py, the KV cache's bytes per page per device
# under each: tests/models/test_sharding_rules.py's test_kv_bytes_per_page_are_per_device.)
def _assert_plan_is_the_placement(rec: dict, arch: dict, mesh_shape: tuple[int, int], rules: str,
                                  max_model_len: int) -> None:
    """The plan's parameter and KV bytes per device (record `rec`, planned for `arch` with 8
    sequences) are what the engine's own placement puts on every device (addressable shards), and
    the compiled step's arguments hold them."""
    mesh = make_mesh(*mesh_shape)
    cfg = ArchConfig.from_hf(arch)
    model = create_model(cfg, dtype=jnp.float32, mesh=mesh, rules=load_rules(rules))
    leaves = jax.tree.leaves(model)
    for d in range(mesh.size):
        live = sum(a.addressable_shards[d].data.nbytes for a in leaves)
        assert rec["params"]["per_device"] == live
    D = mesh_shape[0]  # data-parallel ranks, as serve runs them: pages over "data", a null page each
    kv = allocate_kv_cache(cfg, rec["kv"]["num_pages"], 16, jnp.float32, mesh, serving_rules(load_rules(rules), D))
    assert rec["kv"]["per_device"] == sum(a.addressable_shards[0].data.nbytes for a in (*kv.k, *kv.v))
    workload = D * (8 // D * max_model_len // 16 + 1)  # per rank: its sequences' pages + a null page
    assert rec["kv"]["num_pages"] == rec["kv"]["workload_pages"] == workload
    assert rec["data_parallel"] == D
    args = rec["memory"]["argument"]
    assert args >= rec["params"]["per_device"] + rec["kv"]["per_device"] + rec["sampling_state_per_device"]
    assert rec["collectives"]["count"] >= (0 if mesh_shape[1] == 1 else 1)


def test_predicted_bytes_equal_the_live_buffers():
    """On 8 simulated devices, tensor parallelism over all 8: the plan's bytes are the live
    buffers' (above), and the compiled step runs (`measure`)."""
    assert len(jax.devices()) >= 8
    settings = PlanSettings(arch=TINY, platform="cpu", max_model_len=128, max_num_seqs=8,
                            dtype="float32", kv_cache_dtype="float32", attention_impl="reference",
                            measure=True, steps=1)
    rec = plan_one(settings, make_mesh(1, 8), "tp", (16, 8), "cpu")
    _assert_plan_is_the_placement(rec, TINY, (1, 8), "tp", 128)
    # the compiled step runs (twice each: its outputs feed the next call)
    assert rec["measure"]["decode_ms"] > 0 and rec["measure"]["prefill_ms"] > 0
    # 8 query heads over 8, 4 KV heads do not split 8 ways: reported
    assert any("kv_heads (4) over model=8" in r for r in rec["params"]["replicated"])


def test_fsdp_predicted_bytes_equal_the_live_buffers(command_run):
    """fsdp on a 2 x 2 mesh (the weights split over the data-parallel ranks too): the command's
    record (its worker process planned it; compiling that step again here would check nothing
    more) is what the engine's placement puts on 4 of this process's devices."""
    rec = command_run["by"][("2x2", "fsdp")]
    _assert_plan_is_the_placement(rec, QWEN3, (2, 2), "fsdp", 256)


def test_kv_budget_sizes_the_pages():
    """An fp8 cache (float32 caches: the test above): one byte a value, 4x float32's pages."""
    settings = PlanSettings(arch=TINY, platform="cpu", max_model_len=128, max_num_seqs=8, dtype="float32",
                            kv_cache_dtype="fp8", attention_impl="reference", kv_cache_memory=1 << 20)
    rec = plan_one(settings, make_mesh(1, 4), "tp", (16, 8), "cpu")
    assert rec["kv"]["dtype"] == "fp8"
    per_page = 2 * 2 * 16 * (4 // 4) * 16 * 1  # layers x K,V x page x local heads x head dim x 1 byte
    assert rec["kv"]["bytes_per_page_per_device"] == per_page
    assert rec["kv"]["num_pages"] == (1 << 20) // per_page


def test_model_configs_without_weights():
    assert {"llama3-8b", "llama3-70b", "qwen3-32b", "smollm2-135m", "mixtral-8x7b", "gpt-oss-120b",
            "deepseek-v3-671b"} <= set(ARCH_PRESETS)
    for name in ARCH_PRESETS:
        ArchConfig.from_hf(model_config(name)[1])
    name, cfg = model_config(None)  # the bundled GGUF's metadata
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (9, 3, 30)
    assert model_config(str(FIXTURE / "llama"))[1]["hidden_size"] == 64
    assert model_config(str(FIXTURE / "llama" / "config.json"))[1]["hidden_size"] == 64
    with pytest.raises(ValueError, match="preset"):
        model_config("no-such-model")
    assert factorizations(8) == [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.fixture(scope="module")
def command_run(tmp_path_factory) -> dict:
    """The command on a fixture over two 4-device meshes (one worker process), two rules, with
    JSON lines, a markdown report and a plot: run once for the tests that read its records (its
    four compiles are a third of this module's time)."""
    tmp = tmp_path_factory.mktemp("plan")
    out, md, png = tmp / "plan.jsonl", tmp / "plan.md", tmp / "plan.png"
    argv = ["shard-plan", str(FIXTURE / "qwen3"), "--devices", "4", "--mesh", "2x2,4x1", "--rules", "tp,fsdp",
            "--buckets", "16x8", "--max-model-len", "256", "--dtype", "float32", "--json", str(out),
            "--markdown", str(md)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(png)]
    except ImportError:
        png = None
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(argv)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {"rc": rc, "records": records, "by": {(r["mesh"], r["rules"]): r for r in records},
            "markdown": md.read_text(), "stdout": stdout.getvalue(), "png": png}


def test_command_end_to_end(command_run):
    """The command's records: every mesh with every rule, each a plan of its own (4x1 is four
    data-parallel ranks), the markdown report and the plot."""
    assert command_run["rc"] == 0
    records = command_run["records"]
    assert sorted((r["mesh"], r["rules"]) for r in records) == sorted(
        (m, r) for m in ("2x2", "4x1") for r in ("tp", "fsdp"))
    assert all(not r.get("error") and r["git_sha"] is not None and r["versions"]["jax"] for r in records)
    by = command_run["by"]
    # 4x1 is four data-parallel ranks. fsdp splits the weights over them; tp replicates them (no
    # model axis), so its only collectives are the ranks agreeing on batch-wide branches and
    # the sampled rows gathered, none inside the layers; fsdp gathers its weights besides
    tp41, fsdp41 = by[("4x1", "tp")], by[("4x1", "fsdp")]
    assert fsdp41["params"]["per_device"] < tp41["params"]["per_device"]
    assert not tp41["collectives"]["per_layer"] and tp41["collectives"]["count"] > 0
    assert fsdp41["collectives"]["bytes"] > 10 * tp41["collectives"]["bytes"]
    assert "| cpu x4 | 2x2 | tp |" in command_run["markdown"]
    assert "cpu x4" in command_run["stdout"]
    if command_run["png"] is not None:
        assert command_run["png"].stat().st_size > 1000


def test_a_mesh_over_two_processes(tmp_path, capsys, command_run):
    """--hosts 2: the 4 devices are two local processes of two (jax.distributed), the mesh spans
    them; the step compiles and runs (--measure) across the processes, and its plan is the one
    a single process makes of the same mesh (the command's 2x2 tp record, whose arguments these
    are)."""
    out = tmp_path / "plan.jsonl"
    common = [str(FIXTURE / "qwen3"), "--devices", "4", "--mesh", "2x2", "--rules", "tp", "--buckets", "16x8",
              "--max-model-len", "256", "--dtype", "float32", "--json", str(out)]
    assert main(["shard-plan", *common, "--hosts", "2", "--measure", "--steps", "2"]) == 0
    (two,) = [json.loads(line) for line in out.read_text().splitlines()]
    one = command_run["by"][("2x2", "tp")]
    assert "2 processes" in two["device_kind"] and "processes" not in one["device_kind"]
    assert not two.get("error") and two["measure"]["decode_ms"] > 0
    assert two["params"] == one["params"] and two["kv"] == one["kv"]
    assert two["collectives"]["count"] == one["collectives"]["count"]
    assert "cpu x4 over 2 processes" in capsys.readouterr().out
    assert main(["shard-plan", "--hosts", "2", "--topology", "v5e:2x2"]) == 2
    assert "with --devices" in capsys.readouterr().err


def test_bad_arguments_are_refused(capsys):
    assert main(["shard-plan", "smollm2-135m", "--rules", "nope"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["shard-plan", "smollm2-135m", "--buckets", "8x16"]) == 2
    assert "R <= T" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shard-plan", "--mesh", "1x8", "--buckets", "oops"])
    bad_topologies = (("h100:8", "HOSTSxGPUS"), ("a100:1x8", "CHIP:SHAPE"),
                      ("v5e:2xz", "positive integers"))
    for bad, says in bad_topologies:
        assert main(["shard-plan", "smollm2-135m", "--topology", bad]) == 2
        assert says in capsys.readouterr().err
    assert main(["shard-plan", "smollm2-135m", "--topology", "h200:1x8", "--measure"]) == 2
    assert "a topology only compiles" in capsys.readouterr().err
    assert main(["shard-plan", "smollm2-135m", "--devices", "2", "--profile", "traces"]) == 2
    assert "add --measure" in capsys.readouterr().err


def test_gpu_topologies_are_hosts_of_gpus():
    from jaxserve.tools.chips import CHIPS, parse_target, target_chip_count

    target = parse_target("h200:2x8")
    assert target == {"kind": "gpu", "chip": "h200", "hosts": 2, "gpus_per_host": 8,
                      "topology": "h200:2x8"}
    assert target_chip_count(target) == 16 and target_chip_count(parse_target("v5e:4x4")) == 16
    # the memory verdict reads XLA's own description of the chip
    assert CHIPS["h100"].hbm_bytes == 84942979072 and CHIPS["h200"].hbm_bytes == 151397597184
    assert "NVIDIA H200" in CHIPS["h200"].target_text()


def test_engine_flags_and_defaults_are_the_engines():
    """shard-plan's engine options parse as serve's and default to the engine's defaults."""
    from jaxserve.config import DEFAULT_MAX_MODEL_LEN, CacheConfig, ModelConfig
    from jaxserve.server.cli import build_parser
    from jaxserve.tools.shard_plan import build_jobs

    def settings(*flags):
        args = build_parser().parse_args(["shard-plan", "--devices", "4", "--buckets", "16x8", *flags])
        return build_jobs(args, {**TINY, "max_position_embeddings": 4096})[0]["settings"]

    s = settings()
    assert (s["page_size"], s["dtype"], s["kv_cache_dtype"], s["attention_impl"], s["kv_cache_memory"]) == (
        CacheConfig().page_size, ModelConfig().dtype, CacheConfig().kv_cache_dtype, ModelConfig().attention_impl, None)
    assert s["max_model_len"] == DEFAULT_MAX_MODEL_LEN and s["max_num_seqs"] == 8  # the largest request bucket
    s = settings("--block-size", "32", "--dtype", "half", "--kv-cache-memory", "2GiB", "--max-model-len", "512",
                 "--max-num-seqs", "16")
    assert (s["page_size"], s["dtype"], s["kv_cache_memory"], s["max_model_len"], s["max_num_seqs"]) == (
        32, "float16", 2 << 30, 512, 16)
    with pytest.raises(ValueError, match="power of two"):
        settings("--page-size", "24")


def test_the_engine_layer_does_not_import_the_server():
    """jaxserve/ (engine, tools, configuration) and the layers below it sit below server/: no
    module of theirs imports jaxserve.server, at the top or inside a function."""
    import ast

    import jaxserve
    import jaxserve.models
    import jaxserve.pallas_kernels

    offenders, seen = [], set()
    for package in (jaxserve, jaxserve.models, jaxserve.pallas_kernels):
        for path in sorted(pathlib.Path(package.__file__).parent.rglob("*.py")):
            seen.add(path.name)
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path}: {n}" for n in names if n.startswith("jaxserve.server")]
    assert {"shard_plan.py", "config.py", "config_cli.py", "loader.py"} <= seen
    assert not offenders, offenders


def test_lora_slots_are_counted_as_the_runner_places_them():
    """--enable-lora: the adapters' slots are a parameter group whose bytes per device are those
    of the runner's slots (B split over the heads and MLP columns like its weight). (The step
    that plan_one compiles with them is the engine's: tests/engine/test_lora.py runs it.)"""
    from jaxserve.config import LoRAConfig
    from jaxserve.runner.lora_weights import LoRAWeights
    from jaxserve.tools.plan_compile import lora_slots_group

    settings = PlanSettings(arch=TINY, platform="cpu", max_model_len=128, max_num_seqs=8,
                            dtype="float32", max_loras=4, max_lora_rank=8)
    mesh, cfg = make_mesh(1, 2), ArchConfig.from_hf(TINY)
    group, leaves, _ = lora_slots_group(settings, cfg, jnp.float32, mesh, load_rules("tp"))
    lora = LoRAConfig(enable_lora=True, max_loras=4, max_lora_rank=8)
    live = LoRAWeights(cfg, lora, jnp.float32, mesh).zeros()
    # per layer, slot and rank: A's inputs + B's outputs of q, k, v, o, gate, up, down (E 64,
    # Hq*D 128, Hkv*D 64, F 128)
    per = (64 + 128) + 2 * (64 + 64) + (128 + 64) + 2 * (64 + 128) + (128 + 64)
    assert group["total"] == sum(a.nbytes for a in live) == 2 * 4 * 8 * per * 4
    local = sum(a.addressable_shards[0].data.nbytes for a in live)
    assert group["per_device"] == local < group["total"]


def test_a_draft_heads_weights_and_pages_are_counted():
    """--speculative-config with an EAGLE-3 head: the step planned is the one serve compiles with
    the head (its weights a parameter group of their own, its layer of pages in every page's
    bytes, so the same budget holds fewer pages); the flag resolves the head as serve does, and a
    mesh of several devices is refused (the head runs on one)."""
    from jaxserve.models.eagle3_checkpoint import load_eagle3
    from jaxserve.runner.draft_head_step import draft_layer_config
    from jaxserve.server.cli import build_parser
    from jaxserve.tools.shard_plan import build_jobs

    llama = json.loads((FIXTURE / "llama" / "config.json").read_text())
    head = str(FIXTURE / "eagle3_llama")
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})

    def settings(*flags):
        args = build_parser().parse_args(["shard-plan", "--buckets", "16x8", "--speculative-config", spec, *flags])
        return build_jobs(args, llama)[0]["settings"]

    s = settings("--devices", "1")
    assert (s["draft_model"], s["draft_method"], s["num_speculative_tokens"]) == (head, "eagle3", 3)
    with pytest.raises(ValueError, match="runs on one device"):
        settings("--devices", "2")

    common = dict(arch=llama, platform="cpu", max_model_len=64, max_num_seqs=8, dtype="float32",
                  kv_cache_dtype="float32", kv_cache_memory=1 << 20)
    mesh = make_mesh(1, 1)
    plain = plan_one(PlanSettings(**common), mesh, "tp", (16, 8), "cpu")
    rec = plan_one(PlanSettings(**common, num_speculative_tokens=3, draft_model=head, draft_method="eagle3"), mesh,
                   "tp", (16, 8), "cpu")
    live = sum(a.nbytes for a in jax.tree.leaves(load_eagle3(head, target=FIXTURE / "llama")))
    assert rec["params"]["groups"]["draft_head"]["per_device"] == live
    assert rec["params"]["per_device"] == plain["params"]["per_device"] + live
    head_kv = allocate_kv_cache(draft_layer_config(head), 1, 16, jnp.float32, mesh)
    head_page = head_kv.k[0].nbytes + head_kv.v[0].nbytes
    per_page = rec["kv"]["bytes_per_page_per_device"]
    assert per_page == plain["kv"]["bytes_per_page_per_device"] + head_page
    assert rec["kv"]["num_pages"] == (1 << 20) // per_page < plain["kv"]["num_pages"]
    assert rec["kv"]["per_device"] == rec["kv"]["num_pages"] * per_page  # the target's pages and the head's
    assert rec["memory"]["argument"] >= rec["params"]["per_device"] + rec["kv"]["per_device"]
    assert rec["program_fingerprint"] != plain["program_fingerprint"]
