"""Engine configuration: small frozen dataclasses, one per concern, composed by EngineConfig.

Every knob is a field here and a CLI flag (see server/cli.py). "auto" values are resolved by
the engine's backend (jaxserve/backends), once. The only environment read is the user cache
directory (`$XDG_CACHE_HOME`, else `~/.cache`), as other tools locate it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Literal

__all__ = [
    "CacheConfig",
    "CompileConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
]


# Field metadata: an option that may differ between the processes of a multi-host run, because
# the compiled step and the weights do not depend on it (the leader's front end and scheduling,
# each process's own caches and place in the run). Every other option must agree
# (jaxserve/parallel/multihost.py: fingerprint).
PER_PROCESS = {"per_process": True}


def per_process(default: Any = None) -> Any:
    """A dataclass field of an option that may differ between processes (see PER_PROCESS)."""
    return dataclasses.field(default=default, metadata=PER_PROCESS)


def _user_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxserve"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    # Tokens per step; None: the engine's backend chooses (jaxserve/backends: 8192 on TPU/GPU,
    # less on a CPU), as the largest explicit token bucket when there are some.
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = per_process("fcfs")  # the leader's scheduler's
    # Overlap host and device: plan and launch step t+1 while step t runs (the engine core).
    async_scheduling: bool = per_process(True)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if (not self.enable_chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"Without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens})"
                f" must be >= max_model_len ({self.max_model_len}), or long prompts could never"
                " be scheduled; raise it or enable chunked prefill."
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str | None = per_process()  # None = the bundled default model (its identity: config.json)
    served_model_name: str | None = per_process()
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = None  # None = min(model's max_position_embeddings, 2048)
    model_cache_dir: str | None = per_process()  # where GGUF conversions are cached
    attention_impl: str = "auto"
    # Native CPU product kernels (one device; weights packed at load time): "amx" for bfloat16
    # weights on CPUs with AMX, "avx512" for float32 weights on CPUs with AVX-512, "avx2" for
    # float32 weights with a kernel build without AVX-512 (AVX2-only CPUs); "xla": XLA's dot;
    # "auto": the kernel that fits the weights' dtype where it can run, else xla.
    matmul_impl: Literal["auto", "xla", "amx", "avx512", "avx2"] = "auto"
    # The instruction set the native CPU kernels are built for: "native" (this CPU), "haswell"
    # (AVX2 + FMA, no AVX-512: the class of most laptops, reproducible on newer CPUs) or
    # "x86-64" (portable loops). One build serves a process.
    cpu_kernel_target: Literal["native", "haswell", "x86-64"] = "native"
    seed: int = 0  # seeds unseeded requests' generators
    # Default sampling settings and EOS ids: "auto" (the model's generation_config.json),
    # "vllm" (ignore its sampling defaults) or a folder / file path (see
    # jaxserve/engine/generation_config.py).
    generation_config: str = per_process("auto")
    # Weight-only quantization at load: "int8" keeps every matmul weight (and the embedding)
    # int8 in device memory with per-channel float32 scales, converted inside the product.
    quantization: Literal["int8"] | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be 'int8' or None, got {self.quantization!r}.")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # KV cache size per device: an explicit byte budget, or a fraction of free device memory on
    # accelerators (the least over devices and processes). On the CPU without a budget, 1 GiB.
    kv_cache_memory_bytes: int | None = None
    device_memory_utilization: float = 0.9
    num_pages: int | None = None  # overrides the budget (tests)
    enable_prefix_caching: bool = per_process(True)  # the leader's scheduler's
    # "auto": the model dtype, except float32 on a CPU without the native attention kernel
    # (there XLA writes the cache, and its bfloat16 scatter is orders of magnitude slower).
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}.")
        if not 0.0 < self.device_memory_utilization <= 1.0:
            raise ValueError("device_memory_utilization must be in (0, 1].")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh: `data_parallel_size` x `tensor_parallel_size` devices (vLLM's names)."""

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # How weights and the KV cache are laid over the mesh: a preset of
    # jaxserve.models.sharding.RULE_PRESETS ("tp", "tp-replicate-vocab", "tp-kv-replicated",
    # "fsdp", "expert-parallel", "attn-dp") or a JSON / YAML rules file.
    sharding_rules: str = "tp"
    # Several processes (hosts) in one mesh (jaxserve/parallel/multihost.py): the JAX
    # coordinator's HOST:PORT (process 0's host), or "auto" to detect a Cloud TPU, SLURM or
    # Kubernetes job; None = one process.
    coordinator_address: str | None = per_process()
    num_processes: int | None = None
    process_id: int | None = per_process()
    # the leader's step channel; None = the coordinator's port + 1
    follower_port: int | None = per_process()
    # a follower hearing nothing for this long exits (the leader sends its own)
    step_timeout_seconds: float = per_process(120.0)
    heartbeat_timeout_seconds: int = 100  # JAX's coordination service (jax.distributed.initialize)
    startup_timeout_seconds: float = per_process(300.0)  # for every follower to connect to the leader

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    # Padded token counts and request counts compiled at start-up; None = geometric defaults.
    token_buckets: tuple[int, ...] | None = None
    request_buckets: tuple[int, ...] | None = None
    compilation_cache_dir: str | None = per_process()  # None = <user cache>/jaxserve/xla
    enable_compilation_cache: bool = per_process(True)
    # Keep the compiled steps themselves on disk (runner/executable_cache.py), so that a restart
    # loads them without tracing or compiling. Needs the compilation cache's folder.
    enable_executable_cache: bool = per_process(True)
    show_progress: bool = per_process(True)

    def cache_dir(self) -> str:
        return self.compilation_cache_dir or str(_user_cache_dir() / "xla")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config`. The one method is "ngram" (prompt
    lookup): the drafts are the tokens that followed the latest earlier occurrence of the
    longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) ending the request's context,
    and the model checks them all in one step (jaxserve/spec_decode/)."""

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None  # vLLM's defaults: both 5; one given sets the other
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method {self.method!r} is not supported; jaxserve "
                             "drafts with 'ngram' (prompt lookup) only.")
        object.__setattr__(self, "method", "ngram")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be a positive integer, "
                             f"got {self.num_speculative_tokens!r}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi}).")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From vLLM's forms: a dict (`LLM(speculative_config={...})`), its JSON text
        (`--speculative-config`), or None (off). Unknown keys are an error naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {', '.join(unknown)}; "
                             f"accepted: {', '.join(sorted(known))}.")
        if "method" not in value:
            raise ValueError('speculative_config: "method" is required ("ngram").')
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    compile: CompileConfig = CompileConfig()
    max_logprobs: int = 20
    # None: no speculative decoding (the leader drafts; the step is the same)
    speculative_config: SpeculativeConfig | None = per_process()

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, routed to the sub-config that has the field.

        `LLM(model, max_num_seqs=8, page_size=16, ...)` and the CLI use this. An unknown name
        raises ValueError listing the accepted ones.
        """
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "compile": CompileConfig}
        own = {f.name for f in dataclasses.fields(cls) if f.name not in parts}
        buckets: dict[str, dict[str, Any]] = {name: {} for name in parts}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in own:
                top[key] = value
                continue
            for name, klass in parts.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    buckets[name][key] = value
                    break
            else:
                known = sorted(own | {f.name for k in parts.values() for f in dataclasses.fields(k)})
                raise ValueError(f"unknown engine option {key!r}; accepted: {', '.join(known)}")
        # Explicit buckets without a limit: the largest bucket is the limit (token budget per
        # step, sequences per step).
        for key, limit in (("token_buckets", "max_num_batched_tokens"), ("request_buckets", "max_num_seqs")):
            if buckets["compile"].get(key) is not None:
                buckets["compile"][key] = tuple(sorted(int(x) for x in buckets["compile"][key]))
                buckets["scheduler"].setdefault(limit, buckets["compile"][key][-1])
        return cls(**{name: parts[name](**vals) for name, vals in buckets.items()}, **top)
