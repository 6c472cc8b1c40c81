"""Start-up hook for the peers' processes under `--cpu-class avx2` (benchmarks/cpu_class.py).

benchmarks/cpu_class.py puts this folder first on PYTHONPATH of the peer processes it starts
(vLLM's API server, engine core and workers, the transformers worker) and sets
JAXSERVE_BENCH_CPU_CLASS=avx2. Python imports `sitecustomize` at start-up, so every process of
the peer, including the ones vLLM spawns, gets this: when `torch.cpu` is imported, its
`get_capabilities()` (behind torch.cpu._is_avx512_supported, _is_avx512_bf16_supported,
_is_amx_tile_supported, ...) reports the AVX-512, AVX10, AMX and AVX-VNNI families as absent.
vLLM chooses its kernels by those calls: it then loads its AVX2 build (vllm/_C_AVX2), its "vec"
attention instead of "amx", no AMX linear kernel; torch.compile's C++ code picks its AVX2 ISA.
torch's own C++ (cpuinfo) is not changed here: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and
MKL_ENABLE_INSTRUCTIONS, set by cpu_class.py, cap that. Nothing happens without the variable.
"""

import os
import sys

HIDDEN = ("avx512", "amx", "avx10", "avx_vnni", "avx_ne_convert")


def _restrict(module) -> None:
    import functools
    import types

    original = module.get_capabilities

    @functools.lru_cache(None)
    def get_capabilities():
        caps = dict(original())
        for key, value in caps.items():
            if value is True and key.startswith(HIDDEN):
                caps[key] = False
        return types.MappingProxyType(caps)

    get_capabilities.__doc__ = original.__doc__
    module.get_capabilities = get_capabilities
    module._jaxserve_bench_cpu_class = "avx2"


class _TorchCpuHook:
    """A meta path finder that patches `torch.cpu` right after it executes (importing torch
    here would slow down every process that never uses it)."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _restrict(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("JAXSERVE_BENCH_CPU_CLASS") == "avx2":
    sys.meta_path.insert(0, _TorchCpuHook())
