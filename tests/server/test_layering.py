"""The server layer reaches the engine through its client alone: every module under server/
imports, of the engine layer, only `jaxserve.engine.client` (the protocol, its errors and the
types it hands out); the rest of jaxserve it may use are the config, the request, prompt and output
types, the reasoning parsers (pure Python), and the entry points beside it (offline LLM for
`generate`, the shard-plan tool)."""

from __future__ import annotations

import ast
import pathlib

import jaxserve.server

ALLOWED = ("jaxserve.server", "jaxserve.engine.client", "jaxserve.config", "jaxserve.config_cli", "jaxserve.outputs",
           "jaxserve.inputs", "jaxserve.beam_search", "jaxserve.chat", "jaxserve.sampling_params", "jaxserve.lora_request", "jaxserve.startup_timer",
           "jaxserve.entrypoints", "jaxserve.tools", "jaxserve.reasoning")


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_the_server_imports_only_the_engine_client():
    root = pathlib.Path(jaxserve.server.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        for name in _imports(path):
            if name == "jaxserve" or not name.startswith("jaxserve."):
                continue
            if not any(name == a or name.startswith(a + ".") for a in ALLOWED):
                bad.append(f"{path.relative_to(root)} imports {name}")
    assert not bad, bad


def test_the_engine_client_loads_without_jax():
    """A frontend beside an engine process never needs JAX: importing the client does not load it."""
    import subprocess
    import sys

    code = "import sys, jaxserve.engine.client; assert 'jax' not in sys.modules, 'the engine client loaded jax'"
    subprocess.run([sys.executable, "-c", code], check=True)
