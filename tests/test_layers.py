"""The layers import one way (docs/DESIGN.md §1): types and configuration <- core <- kernels <-
models <- sampling and backends <- runner <- leader <- engine <- server, tools, entry points.
Every import in every module of the package counts, the ones inside functions and under
TYPE_CHECKING too (they are dependencies all the same).

The device side's floors, from what their modules import:
- kernels (pallas_kernels) import nothing of the package.
- models call the kernels.
- sampling and backends: the sampler (whose ops read the models' sharding axes), the backends
  (which lay out the models' weights, call the kernels, and the CPU one the sampler), the
  compiled step's shapes and memory (compiled_step: the backend sizes the KV cache from them,
  the runner compiles them), and the parts that import no higher device floor: structured
  output and speculative decoding (the core's and the request's types only), and parallel
  (meshes over the models' sharding axes; the hosts' bootstrap).
- runner: compiles and launches the step from all of the above.
- leader: the multi-host leader's runner and its followers, around the runner.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import jaxserve

# Lowest first; a module may import its own layer and the layers below it.
LAYERS = [
    ("types", ["jaxserve.config", "jaxserve.config_cli", "jaxserve.speculative_config",
               "jaxserve.sampling_params", "jaxserve.request",
               "jaxserve.lora_request", "jaxserve.outputs", "jaxserve.startup_timer", "jaxserve.reasoning",
               "jaxserve.inputs", "jaxserve.beam_search", "jaxserve.chat", "jaxserve.platform"]),
    ("core", ["jaxserve.core"]),
    ("kernels", ["jaxserve.pallas_kernels"]),
    ("models", ["jaxserve.models"]),
    ("sampling/backends", ["jaxserve.sampling", "jaxserve.backends", "jaxserve.compiled_step",
                           "jaxserve.structured", "jaxserve.spec_decode", "jaxserve.parallel"]),
    ("runner", ["jaxserve.runner"]),
    ("leader", ["jaxserve.leader"]),
    ("engine", ["jaxserve.engine"]),
    ("front", ["jaxserve.server", "jaxserve.tools", "jaxserve.entrypoints"]),
]


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def package_modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package by its dotted name (the mapped folders included)."""
    mods = {}
    for pkg_dir in {pathlib.Path(p).resolve() for p in jaxserve.__path__}:
        for path in pkg_dir.rglob("*.py"):
            rel = path.relative_to(pkg_dir).with_suffix("")
            mods[".".join(("jaxserve", *rel.parts)).removesuffix(".__init__")] = path
    for name in ("models", "server", "pallas_kernels"):
        sub = __import__(f"jaxserve.{name}", fromlist=["_"])
        root = pathlib.Path(sub.__file__).resolve().parent
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            mods[".".join(("jaxserve", name, *rel.parts)).removesuffix(".__init__")] = path
    return mods


def imports(module: str, path: pathlib.Path) -> list[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.append(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.append(node.module)
    return [n for n in names if n.startswith("jaxserve.")]


def violations() -> list[str]:
    bad = []
    for module, path in sorted(package_modules().items()):
        mine = layer_of(module)
        if mine is None:
            continue
        for name in imports(module, path):
            theirs = layer_of(name)
            if theirs is not None and theirs > mine:
                bad.append(f"{module} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]})")
    return bad


def test_every_module_is_in_a_layer():
    unplaced = [m for m in package_modules() if m != "jaxserve" and layer_of(m) is None]
    assert not unplaced, unplaced


def test_the_layers_import_one_way():
    assert violations() == []


def test_the_check_sees_an_import_against_the_layers(tmp_path, monkeypatch):
    """An import inside a function of a core module, up into the engine, is found."""
    real = package_modules()
    fake = tmp_path / "scheduler.py"
    fake.write_text("def f():\n    from jaxserve.engine.core import EngineCore\n")
    monkeypatch.setattr(sys.modules[__name__], "package_modules",
                        lambda: {**real, "jaxserve.core.scheduler": fake})
    assert violations() == ["jaxserve.core.scheduler (core) imports jaxserve.engine.core (engine)"]


def test_every_layer_names_packages_that_exist():
    """A renamed package leaves no empty name behind in a layer (its modules would be unplaced)."""
    real = package_modules()
    missing = [p for _, prefixes in LAYERS for p in prefixes if p not in real]
    assert not missing, missing


@pytest.mark.parametrize("module, source, name", [
    ("jaxserve.pallas_kernels.kv_quant", "from jaxserve.models.interface import KV_CACHE_AXES",
     "jaxserve.models.interface"),
    ("jaxserve.models.llama", "from jaxserve.sampling.state import SamplingState",
     "jaxserve.sampling.state"),
    ("jaxserve.backends.base", "from jaxserve.runner.compile_pool import step_memory",
     "jaxserve.runner.compile_pool"),
    ("jaxserve.compiled_step.memory", "import jaxserve.runner.recipe", "jaxserve.runner.recipe"),
    ("jaxserve.parallel.mesh", "from jaxserve.leader.step_channel import Leader",
     "jaxserve.leader.step_channel"),
    ("jaxserve.runner.model_runner", "from jaxserve.leader import step_channel", "jaxserve.leader"),
    ("jaxserve.leader.step_channel", "from jaxserve.engine.plan import EnginePlan",
     "jaxserve.engine.plan"),
])
def test_the_check_sees_an_import_up_a_device_floor(tmp_path, monkeypatch, module, source, name):
    """Each floor of the device side is its own layer: an import up to a higher floor (under
    TYPE_CHECKING here) is found."""
    real = package_modules()
    fake = tmp_path / "module.py"
    fake.write_text(f"from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    {source}\n")
    monkeypatch.setattr(sys.modules[__name__], "package_modules", lambda: {**real, module: fake})
    assert violations() == [f"{module} ({LAYERS[layer_of(module)][0]}) imports {name} "
                            f"({LAYERS[layer_of(name)][0]})"]
