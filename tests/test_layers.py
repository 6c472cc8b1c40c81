"""The layers import one way (docs/DESIGN.md §1): types and configuration <- core <- the device
side (runner, backends, sampling, structured output, speculative decoding, parallel, models,
kernels) <- engine <- server, tools, entry points. Every import in every module of the package
counts, the ones inside functions too (they are dependencies all the same)."""

from __future__ import annotations

import ast
import pathlib
import sys

import jaxserve

# Lowest first; a module may import its own layer and the layers below it.
LAYERS = [
    ("types", ["jaxserve.config", "jaxserve.config_cli", "jaxserve.sampling_params", "jaxserve.request",
               "jaxserve.lora_request", "jaxserve.outputs", "jaxserve.startup_timer", "jaxserve.reasoning",
               "jaxserve.inputs", "jaxserve.beam_search", "jaxserve.chat", "jaxserve.platform"]),
    ("core", ["jaxserve.core"]),
    ("device", ["jaxserve.runner", "jaxserve.backends", "jaxserve.sampling", "jaxserve.structured",
                "jaxserve.spec_decode", "jaxserve.parallel", "jaxserve.models", "jaxserve.pallas_kernels",
                "jaxserve.compiled_step", "jaxserve.leader"]),
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
