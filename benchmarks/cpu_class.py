"""CPU classes for the benchmarks: run jaxserve and its peers as on another class of x86 CPU.

    native   this CPU as it is (the default).
    avx2     an AVX2-only CPU (Haswell .. Zen 3: AVX2 + FMA, no AVX-512, no AMX), emulated on a
             newer one, for jaxserve and for the peers alike:

  jaxserve  XLA_FLAGS --xla_cpu_max_isa=AVX2 (the code XLA generates) and
            --xla_cpu_experimental_ynn_fusion_type= (empty: XLA 0.10 hands dots and some
            reductions to YNNPACK, which picks its kernels by CPUID and has no switch to cap
            it, so here it would run AVX-512/AMX kernels; off, XLA emits those ops itself);
            the native kernels built for target "haswell" (`cpu_kernel_target`,
            `--cpu-kernel-target`).
  peers     (torch, transformers, vLLM's CPU build) ATEN_CPU_CAPABILITY=avx2 (torch's
            vectorized kernels and torch.compile's C++ ISA), ONEDNN_MAX_CPU_ISA=AVX2 (the
            oneDNN inside torch and the one inside vLLM), MKL_ENABLE_INSTRUCTIONS=AVX2 (torch's
            float32 GEMM), TORCHINDUCTOR_CPP_MARCH=haswell (torch.compile's -march, else
            native), and cpu_class_site/sitecustomize.py first on PYTHONPATH: in every peer
            process torch.cpu reports no AVX-512/AMX/AVX-VNNI, so vLLM loads its AVX2 library
            (vllm/_C_AVX2), its "vec" attention and no AMX linear kernel. vLLM's and
            torch.compile's caches go to benchmarks/.cache/ per class (code compiled for
            another class is never reused).
  both      GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,... (glibc's string and memory
            functions take their AVX2 versions) and NPY_DISABLE_CPU_FEATURES (numpy's loops).

What is not emulated: the CPU's caches, memory bandwidth and core count stay this machine's,
and C++ code that asks the CPU directly (cpuinfo, CPUID) and is not listed above still sees
AVX-512 (torch's cpuinfo-based checks are capped through oneDNN/MKL/ATen, not changed).

    .venv/bin/python benchmarks/cpu_class.py check --cpu-class avx2 \\
        --vllm-python /path/to/vllm-venv/bin/python --hf-python /path/to/torch-venv/bin/python

`check` verifies a class: which libraries and kernels each side picks, the ISA oneDNN and MKL
report (ONEDNN_VERBOSE / MKL_VERBOSE on small products), and a disassembly of the code that
runs (jaxserve's kernel library, XLA's compiled objects, torch.compile's, vLLM's own kernels)
for AVX-512 (EVEX) and AMX instructions. One JSON line to benchmarks/results/cpu_class.jsonl.
This module imports neither jax nor torch at the top: the peers' workers import it too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
SITE_DIR = HERE / "cpu_class_site"
CACHE = HERE / ".cache"
CLASSES = ("native", "avx2")
MARKER = "JAXSERVE_BENCH_CPU_CLASS"

_GLIBC_HWCAPS = "glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD"
_NUMPY_OFF = ("X86_V4 AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL "
              "AVX512_ICL AVX512_SPR")
BOTH_ENV = {"NPY_DISABLE_CPU_FEATURES": _NUMPY_OFF, "ONEDNN_MAX_CPU_ISA": "AVX2"}
JAXSERVE_XLA_FLAGS = ("--xla_cpu_max_isa=AVX2", "--xla_cpu_experimental_ynn_fusion_type=")
PEER_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "TORCHINDUCTOR_CPP_MARCH": "haswell"}
KERNEL_TARGET = {"native": "native", "avx2": "haswell"}


def _check(cpu_class: str) -> None:
    if cpu_class not in CLASSES:
        raise ValueError(f"unknown CPU class {cpu_class!r}; one of {CLASSES}")


def _common(cpu_class: str, base: dict | None) -> dict:
    env = dict(os.environ if base is None else base)
    if cpu_class == "native":
        return env
    env.update(BOTH_ENV)
    tunables = env.get("GLIBC_TUNABLES", "")
    if _GLIBC_HWCAPS not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{_GLIBC_HWCAPS}" if tunables else _GLIBC_HWCAPS
    env[MARKER] = cpu_class
    return env


def jaxserve_env(cpu_class: str, base: dict | None = None) -> dict:
    """The environment of a jaxserve process of `cpu_class` (`base`: default os.environ)."""
    _check(cpu_class)
    env = _common(cpu_class, base)
    if cpu_class == "avx2":
        flags = env.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if not f.startswith(("--xla_cpu_max_isa=", "--xla_cpu_experimental_ynn_fusion_type="))]
        env["XLA_FLAGS"] = " ".join([*flags, *JAXSERVE_XLA_FLAGS])
    return env


def jaxserve_options(cpu_class: str) -> dict:
    """Engine options (LLM(...) keywords) of `cpu_class`."""
    _check(cpu_class)
    return {} if cpu_class == "native" else {"cpu_kernel_target": KERNEL_TARGET[cpu_class]}


def jaxserve_serve_args(cpu_class: str) -> list[str]:
    """`jaxserve serve` arguments of `cpu_class`."""
    _check(cpu_class)
    return [] if cpu_class == "native" else ["--cpu-kernel-target", KERNEL_TARGET[cpu_class]]


def peer_env(cpu_class: str, base: dict | None = None) -> dict:
    """The environment of a peer's process (torch, transformers, vLLM) of `cpu_class`."""
    _check(cpu_class)
    env = _common(cpu_class, base)
    if cpu_class == "avx2":
        env.update(PEER_ENV)
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{SITE_DIR}{os.pathsep}{path}" if path else str(SITE_DIR)
        env["VLLM_CACHE_ROOT"] = str(CACHE / f"vllm-{cpu_class}")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE / f"torchinductor-{cpu_class}")
    return env


def reexec_for(cpu_class: str) -> None:
    """Re-execute this script once under jaxserve_env(cpu_class) unless it already runs so
    (glibc reads its tunables and numpy its disabled features at start-up; XLA its flags
    when jax initializes). Call before importing jax or numpy's users."""
    _check(cpu_class)
    if cpu_class == "native" or os.environ.get(MARKER) == cpu_class:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.argv], jaxserve_env(cpu_class))


def describe(cpu_class: str) -> dict:
    """What `cpu_class` sets, for the JSON lines (no local paths)."""
    _check(cpu_class)
    if cpu_class == "native":
        return {"name": "native", "emulated": False}
    common = {**BOTH_ENV, "GLIBC_TUNABLES": _GLIBC_HWCAPS}
    return {
        "name": cpu_class, "emulated": True,
        "jaxserve": {"env": {**common, "XLA_FLAGS": " ".join(JAXSERVE_XLA_FLAGS)},
                     "cpu_kernel_target": KERNEL_TARGET[cpu_class]},
        "peers": {"env": {**common, **PEER_ENV, "PYTHONPATH": "benchmarks/cpu_class_site (+ existing)",
                          "VLLM_CACHE_ROOT": f"benchmarks/.cache/vllm-{cpu_class}",
                          "TORCHINDUCTOR_CACHE_DIR": f"benchmarks/.cache/torchinductor-{cpu_class}"},
                  "sitecustomize": "torch.cpu reports no avx512*/amx*/avx10*/avx_vnni*"},
    }


def host_cpu() -> dict:
    """This CPU's model and the instruction-set flags that matter here (/proc/cpuinfo)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
            "amx_tile", "amx_bf16", "amx_int8")
    return {"model": model, "flags": [f for f in keep if f in flags], "cpu_count": os.cpu_count()}


def torch_isa(torch) -> dict:
    """What torch reports in this process (for the peers' workers): ATen's kernel ISA, what
    torch.cpu says of the CPU (patched under the avx2 class), whether torch's oneDNN takes
    bfloat16 products, and the class's variables."""
    out = {"aten_capability": torch.backends.cpu.get_cpu_capability(),
           "torch_cpu_reports": {k: getattr(torch.cpu, f"_is_{k}_supported")()
                                 for k in ("avx2", "avx512", "avx512_bf16", "amx_tile")},
           "cpu_class": os.environ.get(MARKER, "native")}
    try:
        out["onednn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        pass
    keys = (*BOTH_ENV, *PEER_ENV, "GLIBC_TUNABLES")
    out["env"] = {k: os.environ[k] for k in keys if k in os.environ}
    return out


def loaded_libraries(pid: int, needle: str) -> list[str]:
    """Base names of the mapped files whose path contains `needle` in process `pid` and all its
    descendants (e.g. which of vLLM's kernel libraries its engine processes loaded)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/maps") as f:
                found |= {line.split()[-1].rsplit("/", 1)[-1] for line in f if needle in line}
        except OSError:
            continue
    return sorted(found)


# ---------------------------------------------------------------------------- disassembly
_EVEX = re.compile(r"%zmm|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|%k[1-7]\b|\{1to\d+\}")
_AMX = re.compile(r"\b(tdp\w+|tileloadd\w*|tilestored|ldtilecfg|tilezero|tilerelease)\b")
_FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def scan_code(path: str | os.PathLike, skip: str | None = None) -> dict | None:
    """Instructions of `path` (an object or shared library) that need AVX-512 (EVEX-encoded:
    zmm, ymm/xmm16-31, mask registers, embedded broadcasts) or AMX, counted by objdump, with
    the functions that hold them; functions whose (mangled) name contains `skip` are left out
    and counted apart. None without objdump."""
    if shutil.which("objdump") is None:
        return None
    proc = subprocess.Popen(["objdump", "-d", "--no-show-raw-insn", str(path)], stdout=subprocess.PIPE,
                            text=True, errors="replace")
    fn, counts, skipped, lines = "", {}, 0, 0
    for line in proc.stdout:
        m = _FUNC.match(line)
        if m:
            fn = m.group(1)
            continue
        lines += 1
        evex, amx = bool(_EVEX.search(line)), bool(_AMX.search(line))
        if not (evex or amx):
            continue
        if skip and skip in fn:
            skipped += 1
            continue
        c = counts.setdefault(fn, [0, 0])
        c[0] += evex
        c[1] += amx
    proc.wait()
    top = sorted(counts.items(), key=lambda kv: -sum(kv[1]))[:5]
    return {"instructions": lines, "evex": sum(c[0] for c in counts.values()),
            "amx": sum(c[1] for c in counts.values()), "functions": len(counts),
            "top": [f"{name[:80]} ({c[0]} evex, {c[1]} amx)" for name, c in top],
            **({"skipped_" + skip: skipped} if skip else {})}


# ---------------------------------------------------------------------------- probes
def _jaxserve_probe(target: str, dump: str) -> dict:
    """In a jaxserve process: the kernel build and products chosen, and a small XLA program
    (float32 and bfloat16 products, exp, reductions) compiled for the dump."""
    import jax
    import jax.numpy as jnp

    from jaxserve.backends.cpu import _ONE_DEVICE, CpuBackend
    from jaxserve.backends.cpu import kernels
    from jaxserve.backends.cpu.kernels import matmul

    kernels.select_target(target)
    lib = str(kernels.library_path(target))
    backend = CpuBackend()
    impls = {d: backend.resolve_matmul_impl("auto", d, _ONE_DEVICE) for d in ("float32", "bfloat16")}
    for dt in (jnp.float32, jnp.bfloat16):
        f = jax.jit(lambda a, b: jnp.tanh(a @ b).max(axis=1) + jnp.exp(a).sum())
        f(jnp.ones((32, 576), dt), jnp.ones((576, 1536), dt)).block_until_ready()
    return {"kernel_target": kernels.selected_target(), "kernel_library": lib,
            "amx_available": matmul.amx_available(), "avx512_available": matmul.avx512_available(),
            "avx2_available": matmul.avx2_available(), "matmul_impl_auto": impls,
            "xla_flags": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                  if not f.startswith("--xla_dump_to=")), "dump": dump}


def _torch_probe() -> dict:
    """In a peer process: what torch (and vLLM, where installed) pick, with small products run
    so that ONEDNN_VERBOSE / MKL_VERBOSE (set by the caller) show the ISA."""
    import torch

    out = {"torch": torch.__version__, "aten_capability": torch.backends.cpu.get_cpu_capability(),
           "torch_cpu_reports": {k: getattr(torch.cpu, f"_is_{k}_supported")()
                                 for k in ("avx2", "avx512", "avx512_bf16", "amx_tile")},
           "patched": getattr(torch.cpu, "_jaxserve_bench_cpu_class", None)}
    for dt in (torch.float32, torch.bfloat16):
        x, w = torch.randn(32, 576, dtype=dt), torch.randn(1536, 576, dtype=dt)
        print(f"PROBE torch.linear {dt}", flush=True)
        torch.nn.functional.linear(x, w)
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor import config as inductor_config

        out["inductor_vec_isa"] = str(cpu_vec_isa.pick_vec_isa())
        out["inductor_march"] = inductor_config.cpp.march
        fn = torch.compile(lambda a, b: torch.relu(a @ b).exp().sum(dim=1), backend="inductor")
        fn(torch.randn(32, 576), torch.randn(576, 1536))
        out["inductor_compiled"] = True
    except Exception as e:  # noqa: BLE001 - a report, not a failure
        out["inductor_error"] = repr(e)[:300]
    try:
        import vllm  # noqa: F401
    except ImportError:
        return out
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    current_platform.import_kernels()
    with open("/proc/self/maps") as f:
        out["vllm_library"] = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in f if "/vllm/_C" in line})
    out["vllm_attention_isa"] = {str(dt): _get_attn_isa(dt, 128, 64) for dt in (torch.bfloat16, torch.float32)}
    out["vllm_sgl_amx_linear"] = {f"{n}x{k}": check_cpu_sgl_kernel(n, k, torch.bfloat16)
                                  for n, k in ((576, 576), (1536, 576))}
    out["vllm_onednn_mm"] = {}
    for dt in (torch.float32, torch.bfloat16):
        print(f"PROBE vllm.onednn_mm {dt}", flush=True)
        try:
            handler = ops.create_onednn_mm(torch.randn(1536, 576, dtype=dt).t(), 32)
            ops.onednn_mm(handler, torch.randn(32, 576, dtype=dt), None)
            out["vllm_onednn_mm"][str(dt)] = "ok"
        except RuntimeError as e:  # vLLM then falls back to torch's linear
            out["vllm_onednn_mm"][str(dt)] = f"refused: {str(e).splitlines()[0][:120]}"
    return out


def _run_probe(cmd: list[str], env: dict) -> tuple[dict, list[str]]:
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", timeout=900)
    lines = proc.stdout.splitlines()
    result = next((json.loads(l[len("PROBE_RESULT "):]) for l in reversed(lines) if l.startswith("PROBE_RESULT ")),
                  None)
    if result is None:
        raise SystemExit(f"probe {cmd[-1]} failed (exit {proc.returncode}):\n" + "\n".join(lines[-30:]))
    return result, lines


def _verbose_summary(lines: list[str]) -> dict:
    """oneDNN's and MKL's own words on the ISA they use, and the oneDNN kernels that ran, by the
    PROBE section they ran in."""
    isa, mkl, section, impls = set(), set(), "start", {}
    for line in lines:
        if line.startswith("PROBE "):
            section = line[6:]
        elif line.startswith("onednn_verbose") and ",info,cpu,isa:" in line:
            isa.add(line.split("isa:", 1)[1].strip())
        elif line.startswith("onednn_verbose") and ",primitive,exec," in line:
            parts = line.split(",")
            impls.setdefault(section, set()).add(f"{parts[5]}:{parts[6]}")
        elif line.startswith("MKL_VERBOSE") and " for Intel(R) 64 architecture " in line:
            mkl.add(line.split(" for Intel(R) 64 architecture ", 1)[1].split(",")[0].strip())
    return {"onednn_isa": sorted(isa), "mkl_isa": sorted(mkl),
            "onednn_kernels": {k: sorted(v) for k, v in impls.items()}}


def check(args) -> dict:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    report = {"benchmark": "cpu_class_check", "git_sha": sha or None, "cpu_class": describe(args.cpu_class),
              "host": host_cpu()}
    with tempfile.TemporaryDirectory() as tmp:
        dump = os.path.join(tmp, "xla")
        env = jaxserve_env(args.cpu_class)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
        res, _ = _run_probe([sys.executable, __file__, "_jaxserve-probe", KERNEL_TARGET[args.cpu_class], dump], env)
        objs = sorted(pathlib.Path(dump).glob("*lambda*.o"))
        hlo = "".join(p.read_text() for p in pathlib.Path(dump).glob("*lambda*cpu_after_optimizations.txt"))
        xla = {"objects": len(objs), "ynn_fusions": len(re.findall(r"%ynn_fusion\S* = ", hlo)), "evex": 0, "amx": 0}
        for o in objs:
            s = scan_code(o) or {}
            xla["evex"] += s.get("evex", 0)
            xla["amx"] += s.get("amx", 0)
        report["jaxserve"] = {**{k: v for k, v in res.items() if k not in ("kernel_library", "dump")},
                              "kernel_library_code": scan_code(res["kernel_library"]), "xla_compiled_code": xla}
        for name, python in (("hf", args.hf_python), ("vllm", args.vllm_python)):
            if not python:
                continue
            ind = os.path.join(tmp, f"inductor-{name}")
            penv = peer_env(args.cpu_class)
            penv.update({"ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1", "TORCHINDUCTOR_CACHE_DIR": ind})
            res, lines = _run_probe([python, __file__, "_torch-probe"], penv)
            sos = [p for p in pathlib.Path(ind).rglob("*.so")]
            ind_code = {"libraries": len(sos), "evex": 0, "amx": 0}
            for so in sos:
                s = scan_code(so) or {}
                ind_code["evex"] += s.get("evex", 0)
                ind_code["amx"] += s.get("amx", 0)
            res["inductor_code"] = ind_code
            res.update(_verbose_summary(lines))
            if res.get("vllm_library"):
                spec = subprocess.run([python, "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
                                      capture_output=True, text=True, env=peer_env("native"))
                lib = os.path.join(spec.stdout.strip(), res["vllm_library"][0])
                res["vllm_library_code"] = scan_code(lib, skip="dnnl")
            report[name] = res
    return report


def print_check(r: dict) -> None:
    host, j = r["host"], r["jaxserve"]
    print(f"\nCPU class {r['cpu_class']['name']} on {host['model']} ({' '.join(host['flags'])})")
    k, x = j["kernel_library_code"] or {}, j["xla_compiled_code"]
    print(f"jaxserve: kernels for {j['kernel_target']} (AMX {j['amx_available']}, AVX-512 {j['avx512_available']}, "
          f"AVX2 {j['avx2_available']}); products auto: {j['matmul_impl_auto']}; kernel library "
          f"{k.get('evex')} EVEX / {k.get('amx')} AMX instructions; XLA: {x['objects']} objects, "
          f"{x['evex']} EVEX / {x['amx']} AMX instructions, {x['ynn_fusions']} YNNPACK fusions")
    for name in ("hf", "vllm"):
        p = r.get(name)
        if not p:
            continue
        print(f"{name}: torch {p['torch']}, ATen {p['aten_capability']}, torch.cpu reports {p['torch_cpu_reports']}; "
              f"oneDNN ISA {p['onednn_isa']}, MKL {p['mkl_isa']}")
        print(f"  oneDNN kernels run: {p['onednn_kernels']}")
        ic = p["inductor_code"]
        print(f"  torch.compile: ISA {p.get('inductor_vec_isa')}, -march {p.get('inductor_march') or 'native'}, "
              f"{ic['libraries']} libraries, {ic['evex']} EVEX / {ic['amx']} AMX instructions"
              + (f" ({p['inductor_error']})" if p.get("inductor_error") else ""))
        if p.get("vllm_library"):
            c = p.get("vllm_library_code") or {}
            print(f"  vLLM: {p['vllm_library']} ({c.get('evex')} EVEX / {c.get('amx')} AMX instructions outside "
                  f"oneDNN, {c.get('skipped_dnnl')} inside it), attention {p['vllm_attention_isa']}, AMX linear "
                  f"{p['vllm_sgl_amx_linear']}, oneDNN linear {p['vllm_onednn_mm']}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_jaxserve-probe"]:
        print("PROBE_RESULT " + json.dumps(_jaxserve_probe(argv[1], argv[2])), flush=True)
        return
    if argv[:1] == ["_torch-probe"]:
        print("PROBE_RESULT " + json.dumps(_torch_probe()), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="verify what a CPU class restricts, on both sides")
    c.add_argument("--cpu-class", choices=CLASSES, default="avx2")
    c.add_argument("--vllm-python", default=None, help="python with vLLM's CPU build")
    c.add_argument("--hf-python", default=None, help="python with torch and transformers")
    c.add_argument("--results", default=str(HERE / "results" / "cpu_class.jsonl"), help="'' = none")
    args = p.parse_args(argv)
    report = check(args)
    report["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print_check(report)
    if args.results:
        append_results(args.results, report)


if __name__ == "__main__":
    main()
