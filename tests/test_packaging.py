"""The package as a user installs it: a wheel built from a copy of the source tree, installed (not
editable) into a fresh virtual environment, imported from another folder, and its command run on a
tiny model. No network: the wheel is built with this environment's setuptools (the test extra)
and the new environment reaches the installed dependencies through a .pth file."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
# import name -> source folder (docs/DESIGN.md §1; setup.py maps the same)
NAMESPACE = {"jaxserve": "jaxserve", "jaxserve.models": "models", "jaxserve.server": "server",
             "jaxserve.pallas_kernels": "pallas_kernels"}
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                              "tests", "benchmarks", "docs", ".jax_cache", "cache", ".pytest_cache")

# Imports every module of the installed package (a module left out of the wheel fails here),
# lists its other files, and reads data files the code finds beside itself.
CHECK = """
import importlib, json, pathlib, pkgutil
import jaxserve
walk = pkgutil.walk_packages(jaxserve.__path__, "jaxserve.")
names = ["jaxserve", *sorted(m.name for m in walk)]
for name in names:
    importlib.import_module(name)
from jaxserve.tools import chips, shard_plan
root = pathlib.Path(jaxserve.__file__).parent
data = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
              if p.is_file() and p.suffix not in (".py", ".pyc"))
print(json.dumps({"file": jaxserve.__file__, "modules": names, "data": data,
                  "presets": list(shard_plan.ARCH_PRESETS),
                  "gpu_targets": [p.name for p in chips.GPU_TARGET_DIR.glob("*.txtpb")]}))
"""


def source_modules() -> set[str]:
    """Every module of the source tree, by its installed name."""
    out = set()
    for package, folder in NAMESPACE.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if all((ROOT / folder / pathlib.Path(*rel.parts[:i]) / "__init__.py").is_file()
                   for i in range(len(rel.parts))):
                out.add(".".join([package, *parts]))
    return out


def source_data() -> set[str]:
    """Every other file of the source tree's packages (kernel sources, presets, static pages…),
    by its installed path under jaxserve/."""
    out = set()
    for package, folder in NAMESPACE.items():
        prefix = pathlib.Path(*package.split(".")[1:])
        for path in (ROOT / folder).rglob("*"):
            rel = path.relative_to(ROOT / folder)
            if (path.is_file() and path.suffix not in (".py", ".pyc", ".so")
                    and "__pycache__" not in rel.parts
                    and not any(p.startswith(".") for p in rel.parts)):
                out.add((prefix / rel).as_posix())
    return out


def test_the_wheel_installs_and_runs(tmp_path, compile_cache_dir):
    import json

    from tests.model_dirs import write_model_dir

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # a clean copy: no stale build/ leftovers
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("jaxserve-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = pathlib.Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies: this environment's package folders, after the new one's own (a .pth line
    # adds a folder without running the .pth files in it, so an editable jaxserve stays out).
    here = {sysconfig.get_paths()["purelib"], *(p for p in sys.path if p.endswith("-packages"))}
    (site / "zz_dependencies.pth").write_text("\n".join(sorted(here)) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               XDG_CACHE_HOME=str(tmp_path / "cache"))
    res = subprocess.run([python, "-c", CHECK], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert pathlib.Path(found["file"]).is_relative_to(site), found["file"]
    missing = source_modules() - set(found["modules"])
    assert not missing, f"modules left out of the wheel: {sorted(missing)}"
    assert "jaxserve.spec_decode.ngram" in found["modules"]
    missing = source_data() - set(found["data"])
    assert not missing, f"data files left out of the wheel: {sorted(missing)}"
    assert any(p.endswith(".cc") for p in found["data"])  # the native kernels' sources
    assert len(found["presets"]) == len(list((ROOT / "jaxserve/tools/arch_presets").glob("*.json")))
    assert found["gpu_targets"]

    model = write_model_dir(tmp_path / "model")
    res = subprocess.run(
        [venv / "bin" / "jaxserve", "generate", "w5 w6 w7", "--model", str(model),
         "--max-tokens", "4", "--token-buckets", "16", "--request-buckets", "8",
         "--compilation-cache-dir", compile_cache_dir],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.fullmatch(r"w\d+( w\d+)*", res.stdout.strip()), res.stdout
