"""CPU policy lives in the CPU backend alone: outside jaxserve/backends/, no module imports the
CPU backend's package (its kernels, packing, huge pages), and no engine, runner, sampler or model
module branches on the platform being the CPU; they receive what to do from the backend's plan
(read from the source tree, like tests/server/test_layering.py)."""

from __future__ import annotations

import ast
import pathlib

import jaxserve
import jaxserve.models
import jaxserve.pallas_kernels
import jaxserve.server

JAXSERVE = pathlib.Path(jaxserve.__file__).parent
BACKENDS = JAXSERVE / "backends"
KERNELS = pathlib.Path(jaxserve.pallas_kernels.__file__).parent
PACKAGES = [JAXSERVE, pathlib.Path(jaxserve.models.__file__).parent,
            pathlib.Path(jaxserve.server.__file__).parent, KERNELS]
# Where a platform check may stand: the backends; the tools, whose compile targets are
# platforms (`shard-plan --topology`); the kernels' dispatch, where "auto" is the kernel
# registered under the platform's name; jaxserve/platform.py, which tells the platform from the
# host's device files before JAX starts.
PLATFORM_CHECKS_ALLOWED = (BACKENDS, JAXSERVE / "tools", KERNELS, JAXSERVE / "platform.py")


def _sources(allowed: tuple[pathlib.Path, ...] = (BACKENDS,)):
    for root in PACKAGES:
        for path in sorted(root.rglob("*.py")):
            if not any(path.is_relative_to(a) for a in allowed):
                yield path, ast.parse(path.read_text())


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_only_the_backends_import_the_cpu_backend():
    bad = [f"{path} imports {name}" for path, tree in _sources() for name in _imports(tree)
           if name == "jaxserve.backends.cpu" or name.startswith("jaxserve.backends.cpu.")]
    assert not bad, bad


def _is_platform(node: ast.AST) -> bool:
    """An expression naming the platform: `platform`, `x.platform`, `jax.default_backend()`."""
    text = ast.unparse(node)
    return "platform" in text or "default_backend" in text


def _platform_checks(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names_cpu = any(isinstance(s, ast.Constant) and s.value == "cpu" for s in sides)
            if names_cpu and any(_is_platform(s) for s in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_cpu_platform_branch_outside_the_backends():
    bad = [f"{path}: {check}" for path, tree in _sources(PLATFORM_CHECKS_ALLOWED)
           for check in _platform_checks(tree)]
    assert not bad, bad


def test_the_checks_find_what_they_look_for():
    """The two checks on sources that break them (so that an empty result means something)."""
    tree = ast.parse("import jax\nfrom jaxserve.backends.cpu import kernels\n"
                     "if jax.default_backend() == 'cpu':\n    pass\n"
                     "native = device.platform != 'cpu'\n")
    assert "jaxserve.backends.cpu.kernels" in _imports(tree)
    assert len(_platform_checks(tree)) == 2
