import ast
import subprocess
import sys
from pathlib import Path

import pytest

import jaxserve.core
from jaxserve.request import Request, RequestStatus, needs_full_prompt_compute
from jaxserve.sampling_params import SamplingParams


# The config layer (plain dataclasses, stdlib only) is below the core.
ALLOWED_IMPORTS = {"jaxserve.core", "jaxserve.request", "jaxserve.sampling_params",
                   "jaxserve.config", "jaxserve.lora_request"}


def test_core_sources_import_only_stdlib_and_core():
    root = Path(jaxserve.core.__file__).parent
    for path in [*root.glob("*.py"), root.parent / "request.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in sys.stdlib_module_names or any(
                    name == m or name.startswith(m + ".") for m in ALLOWED_IMPORTS
                )
                assert ok, f"{path.name} imports {name}"


def test_core_imports_no_jax():
    code = (
        "import sys, jaxserve.core, jaxserve.request;"
        "assert 'jax' not in sys.modules, 'importing jaxserve.core loaded jax"
        " (jaxserve/__init__.py must import its JAX parts lazily)'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sizes_and_tokens():
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_id=0)
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 0, 3)
    r.append_output_token_ids(7)
    r.append_output_token_ids([8, 9])
    assert r.output_token_ids == [7, 8, 9]
    assert r.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert r.num_tokens == 6
    for s in range(7):
        for e in range(s, 7):
            assert r.get_token_ids(s, e) == r.all_token_ids[s:e]


def test_prompt_is_copied_and_identity_equality():
    prompt = [1, 2]
    a = Request("a", prompt, SamplingParams())
    b = Request("a", prompt, SamplingParams())
    prompt.append(3)
    assert a.prompt_token_ids == [1, 2]
    assert a != b and len({a, b}) == 2


@pytest.mark.parametrize(
    "status,reason",
    [
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
    ],
)
def test_finish_reason(status, reason):
    r = Request("a", [1], SamplingParams(), status=status)
    assert r.get_finished_reason() == reason
    assert r.is_finished == (reason is not None)


def test_skip_prefix_cache_forced_by_prompt_logprobs():
    assert needs_full_prompt_compute(SamplingParams(prompt_logprobs=0))
    assert not needs_full_prompt_compute(SamplingParams(repetition_penalty=1.2))
    assert Request("a", [1], SamplingParams(prompt_logprobs=2)).skip_prefix_cache
    assert not Request("a", [1], SamplingParams()).skip_prefix_cache
    assert Request("a", [1], SamplingParams(), skip_prefix_cache=True).skip_prefix_cache
