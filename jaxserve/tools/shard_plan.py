"""`jaxserve shard-plan`: sharding-config experiments, compiled for meshes you may not have.

    jaxserve shard-plan [MODEL] --mesh 1x8,2x4|auto --rules tp,tp-kv-replicated \
        --buckets 16x8,512x32 --max-model-len 8192 [--kv-cache-memory 16GiB] \
        [--devices 8 | --topology v5e:2x4,h100:1x8 | --real] [--measure [--profile DIR]] \
        [--json plan.jsonl] [--markdown plan.md] [--plot plan.png]

MODEL is an HF directory, a config.json, a GGUF file, a Hugging Face Hub name (its config.json
alone is downloaded), a named architecture preset
(`ARCH_PRESETS`: llama3-8b, llama3-70b, qwen3-32b, mixtral-8x7b, smollm2-135m) or nothing (the
bundled model); only its configuration is read. For every (mesh, rules, bucket) the runner's
step is compiled on abstract inputs (`plan_compile.py`) in one worker process per device set
(`plan_worker.py`): N simulated CPU devices, a compile-only TPU topology (libtpu, no TPU
needed), GPU hosts (JAX's CUDA plugin and XLA's target description of the chip, no GPU
needed; `chips.py`), or the real devices. The results: a table on stdout, JSON lines, a
markdown report and a plot (`plan_report.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import time

from jaxserve.config import EngineConfig
from jaxserve.config_cli import flag_type, parse_bytes
from jaxserve.models.arch_config import ArchConfig
from jaxserve.tools.chips import parse_target, target_chip_count
from jaxserve.tools.plan_worker import RECORD_PREFIX

logger = logging.getLogger(__name__)

PRESET_DIR = pathlib.Path(__file__).parent / "arch_presets"
ARCH_PRESETS = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def _pairs(text: str, what: str) -> list[tuple[int, int]]:
    out = []
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)x(\d+)", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise argparse.ArgumentTypeError(f"{what} must look like 2x4 (comma-separated); got {part!r}")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return out


def _names(text: str) -> list[str]:
    return [x for x in re.split(r"[,\s]+", text.strip()) if x]


# The engine's options a plan takes, with the engine's flags (jaxserve/config.py), and the help
# of those whose default differs here.
ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "kv_cache_memory_bytes", "page_size", "dtype", "kv_cache_dtype",
                "attention_impl", "quantization", "revision", "download_dir", "gguf_file",
                "enable_lora", "max_loras", "max_lora_rank", "max_logprobs", "speculative_config")
_PLAN_HELP = {
    "max_num_seqs": "Sequences the KV cache must hold at max-model-len when --kv-cache-memory is not given "
                    "(default: the largest request bucket).",
    "kv_cache_memory_bytes": "KV-cache bytes per device, suffixes allowed (2GiB, 512MB). Default: "
                             "max-num-seqs x max-model-len tokens.",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help=f"HF directory, config.json, GGUF file, Hugging Face Hub name or preset "
                        f"({', '.join(ARCH_PRESETS)}); default: the bundled model. No weights "
                        "are read.")
    p.add_argument("--mesh", default="auto",
                   help="data x model mesh shapes, e.g. 1x8,2x4; 'auto': every factorization of the device count")
    p.add_argument("--rules", default="tp", type=_names,
                   help="sharding rule presets or JSON/YAML files, comma-separated (default: tp)")
    p.add_argument("--buckets", default="16x8,512x32", type=lambda t: _pairs(t, "buckets"),
                   help="(tokens x requests) step buckets to compile, e.g. 16x8,512x32")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--devices", type=int, default=None,
                       help="simulate N CPU devices (default: 8 unless --topology or --real)")
    where.add_argument("--topology", type=_names, default=None,
                       help="compile without the chips: TPU slices (v5e:2x4; needs libtpu: pip "
                            "install 'jaxserve[tpu]') or GPU hosts x GPUs per host (h100:1x8, "
                            "h200:2x8; needs JAX's CUDA plugin: pip install "
                            "'jaxserve[gpu-compile]'); comma-separated")
    where.add_argument("--real", action="store_true", help="the devices of this machine")
    p.add_argument("--hosts", type=int, default=None,
                   help="simulate the devices as N local processes joined by jax.distributed (gloo collectives "
                        "between them): the mesh spans the processes, as on N hosts; with --devices")
    p.add_argument("--device-memory", type=flag_type(parse_bytes), default=None,
                   help="memory per device for the verdict (default: the TPU chip's HBM, the real device's limit)")
    p.add_argument("--measure", action="store_true", help="time decode and prefill steps on random weights")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement (median)")
    p.add_argument("--context", type=int, default=None, help="decode context for --measure (default 1024)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="with --measure: trace one more decode step of each bucket with jax.profiler, into "
                        "DIR/decode_<T>x<R>/ (benchmarks/trace_kernels.py makes a per-kernel table of it)")
    p.add_argument("--profile-buckets", default=None, type=lambda t: _pairs(t, "buckets"),
                   help="the buckets --profile traces (default: every bucket)")
    p.add_argument("--json", dest="json_out", default=None, help="append one JSON line per configuration here")
    p.add_argument("--markdown", default=None, help="write a markdown report here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib: the bench extra)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error", "critical"])
    EngineConfig.add_cli_args(p, ENGINE_FLAGS, _PLAN_HELP)


def model_config(model: str | None, *, revision: str | None = None,
                 download_dir: str | None = None, gguf_file: str | None = None) -> tuple[str, dict]:
    """(name, HF config dict) of MODEL without reading weights (a Hub model: its config.json
    alone is downloaded, or its GGUF file)."""
    from jaxserve.models import gguf_loader
    from jaxserve.models.loader import default_gguf_path, is_gguf_file, locate_model

    if model is None:
        path = default_gguf_path()
        return "SmolLM2-135M-Instruct", gguf_loader.config_from_gguf(gguf_loader.open_gguf(path))
    if model in ARCH_PRESETS:
        return model, json.loads((PRESET_DIR / f"{model}.json").read_text())
    try:
        path = locate_model(model, revision=revision, download_dir=download_dir,
                            gguf_file=gguf_file, config_only=True)
    except ValueError as e:
        raise ValueError(f"{e} (nor is it a preset: {', '.join(ARCH_PRESETS)})") from e
    if path.is_dir():
        if (path / "config.json").is_file():
            name = model if path.name != pathlib.Path(model).name else path.name  # a Hub name
            return name, json.loads((path / "config.json").read_text())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.is_file():
        if is_gguf_file(path):
            return path.stem, gguf_loader.config_from_gguf(gguf_loader.open_gguf(path))
        try:
            return path.parent.name or path.stem, json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
    raise ValueError(f"model {model!r}: not an HF directory, config.json, GGUF file or preset "
                     f"({', '.join(ARCH_PRESETS)})")


def factorizations(n: int) -> list[tuple[int, int]]:
    return [(n // m, m) for m in range(1, n + 1) if n % m == 0][::-1]


def real_devices() -> tuple[int, str]:
    """(device count, JAX platform) of this machine, asked of a child process: JAX in this
    process would take the accelerator (a GPU's memory is preallocated) before the worker can."""
    code = "import jax; print(jax.device_count(), jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, platform = out.stdout.split()[-2:]
    return int(count), platform


def _worker_env(target: dict) -> dict[str, str]:
    env = dict(os.environ)
    if target["kind"] == "real":
        return env
    env["JAX_PLATFORMS"] = "cpu"  # TPU and GPU topologies compile from the CPU host
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    if target["kind"] == "cpu":
        per_process = target["devices"] // target.get("hosts", 1)
        flags = f"{flags} --xla_force_host_platform_device_count={per_process}".strip()
    env["XLA_FLAGS"] = flags
    return env


def run_worker(job: dict, on_record) -> int:
    """Run one worker process (one per simulated host with --hosts: process 0 reports);
    `on_record(record)` for each configuration as it finishes."""
    cmd = [sys.executable, "-m", "jaxserve.tools.plan_worker"]
    hosts = job["target"].get("hosts", 1)
    jobs = [job]
    if hosts > 1:
        from jaxserve.parallel.multihost import free_coordinator_port

        address = f"127.0.0.1:{free_coordinator_port()}"
        jobs = [{**job, "distributed": {"coordinator_address": address, "num_processes": hosts, "process_id": i}}
                for i in range(hosts)]
    procs = []
    for i, j in enumerate(jobs):
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                env=_worker_env(job["target"]), text=True)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(j))
        proc.stdin.close()
        procs.append(proc)
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
        if line.startswith(RECORD_PREFIX):
            on_record(json.loads(line[len(RECORD_PREFIX):]))
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def build_jobs(args, arch: dict) -> list[dict]:
    buckets = sorted(set(args.buckets))
    if args.profile is not None and not args.measure:
        raise ValueError("--profile traces the measured steps: add --measure")
    for T, R in buckets:
        if R > T:
            raise ValueError(f"bucket {T}x{R}: a step has at least one token per request (R <= T)")
    opts = EngineConfig.cli_options(args)
    engine = EngineConfig.from_kwargs(**opts)  # the engine's defaults and checks
    max_model_len = engine.model.resolve_max_model_len(ArchConfig.from_hf(arch).max_position_embeddings)
    if args.topology:
        parsed = [parse_target(t) for t in args.topology]
        targets = [(t, target_chip_count(t), t["kind"]) for t in parsed]
    elif args.real:
        count, platform = real_devices()
        targets = [({"kind": "real"}, count, platform)]
    else:
        n = args.devices or 8
        target = {"kind": "cpu", "devices": n}
        if args.hosts and args.hosts > 1:
            if n % args.hosts:
                raise ValueError(f"--hosts {args.hosts} must divide the {n} devices")
            target["hosts"] = args.hosts
        targets = [(target, n, "cpu")]
    settings = dict(arch=arch, max_model_len=max_model_len,
                    max_num_seqs=opts.get("max_num_seqs") or max(r for _, r in buckets),
                    page_size=engine.cache.page_size, kv_cache_memory=engine.cache.kv_cache_memory_bytes,
                    dtype=engine.model.dtype, kv_cache_dtype=engine.cache.kv_cache_dtype,
                    attention_impl=engine.model.attention_impl, quantization=engine.model.quantization,
                    device_memory=args.device_memory, measure=args.measure, steps=args.steps,
                    context=args.context, max_logprobs=engine.max_logprobs,
                    profile_dir=None if args.profile is None else str(pathlib.Path(args.profile).resolve()),
                    profile_buckets=None if args.profile_buckets is None else [list(b) for b in args.profile_buckets],
                    max_loras=engine.lora.max_loras if engine.lora.enable_lora else 0,
                    max_lora_rank=engine.lora.max_lora_rank, **speculative_settings(engine, arch))
    jobs = []
    for target, count, platform in targets:
        meshes = factorizations(count) if args.mesh == "auto" else _pairs(args.mesh, "meshes")
        if settings["draft_method"] and any(d * m > 1 for d, m in meshes):
            raise ValueError(f"a drafter in the step ({settings['draft_method']}) runs on one device (as serve "
                             "refuses data and tensor parallelism with it): plan it with --devices 1")
        if args.measure and target["kind"] in ("tpu", "gpu"):
            raise ValueError("--measure needs devices that run: use --devices or --real (a topology only compiles)")
        jobs.append({"target": target, "meshes": meshes, "rules": args.rules, "buckets": buckets,
                     "settings": {**settings, "platform": platform}, "log_level": args.log_level})
    return jobs


def speculative_settings(engine: EngineConfig, arch: dict) -> dict:
    """The plan's speculative decoding: drafts per request and step, and the method and
    directory of a drafter run in the step, resolved and checked against the model as `serve`
    does."""
    if engine.speculative_config is None:
        return {"num_speculative_tokens": 0, "draft_model": "", "draft_method": ""}
    from jaxserve.speculative_config import STEP_DRAFTERS
    from jaxserve.engine.draft_check import TargetTokenizer, detect_eagle3_head
    from jaxserve.engine.setup import drafter_dir

    engine = detect_eagle3_head(engine)
    spec, draft_model, draft_method = engine.speculative_config, "", ""
    if spec.method in STEP_DRAFTERS:
        draft_method = spec.method
        draft_model = drafter_dir(engine, arch, TargetTokenizer(engine.model.model))
    return {"num_speculative_tokens": spec.num_speculative_tokens, "draft_model": draft_model,
            "draft_method": draft_method}


def run(args: argparse.Namespace) -> int:
    from jaxserve.tools import plan_report

    if args.hosts is not None and (args.hosts < 1 or args.topology or args.real):
        print("jaxserve shard-plan: --hosts N (N >= 1) simulates hosts of CPU devices: use it with --devices, "
              "not --topology or --real", file=sys.stderr)
        return 2
    try:
        from jaxserve.models.sharding import load_rules

        for r in args.rules:
            load_rules(r)
        name, arch = model_config(args.model, revision=args.revision,
                                  download_dir=args.download_dir, gguf_file=args.gguf_file)
        jobs = build_jobs(args, arch)
    except (ValueError, argparse.ArgumentTypeError) as e:
        print(f"jaxserve shard-plan: {e}", file=sys.stderr)
        return 2
    header = plan_report.run_header(name, arch, jobs)
    records: list[dict] = []
    t0 = time.perf_counter()
    print(plan_report.table_header(), flush=True)

    def on_record(rec: dict) -> None:
        rec = {**header, "target": rec.get("target", target_name), **rec}
        records.append(rec)
        print(plan_report.table_row(rec), flush=True)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

    failed = 0
    for job in jobs:
        target_name = plan_report.target_name(job["target"])
        rc = run_worker(job, on_record)
        if rc:
            print(f"jaxserve shard-plan: the worker for {target_name} exited with {rc}", file=sys.stderr)
            failed += 1
    print(plan_report.footer(records, time.perf_counter() - t0))
    if args.markdown:
        pathlib.Path(args.markdown).write_text(plan_report.markdown(records, header, args))
    if args.plot:
        plan_report.plot(records, args.plot)
    errors = [r for r in records if r.get("error")]
    return 1 if failed or (errors and len(errors) == len(records)) else 0
