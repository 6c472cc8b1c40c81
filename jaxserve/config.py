"""Engine configuration: small frozen dataclasses, one per concern, composed by EngineConfig.

Every knob is a field here, and every field is a CLI flag or says why not: each field documents
itself once with an attribute docstring (the string below it), and jaxserve/config_cli.py makes
the flags of `jaxserve serve`, `generate` and `shard-plan` from them (`EngineConfig.add_cli_args`,
`EngineConfig.cli_options`). A flag is spelled as its field unless the field says otherwise
(`option(flag=...)`: vLLM's names). "auto" values are resolved by the engine's backend
(jaxserve/backends), once. The only environment read is the user cache directory
(`$XDG_CACHE_HOME`, else `~/.cache`), as other tools locate it; huggingface_hub reads its own
(HF_TOKEN, HF_HOME, HF_HUB_OFFLINE: jaxserve/models/hub.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

from jaxserve.config_cli import (
    GROUP,
    add_arguments,
    class_doc,
    flag_fields,
    option,
    parse_bytes,
    values_from_args,
)
from jaxserve.reasoning import REASONING_PARSER_NAMES
from jaxserve.speculative_config import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "CompileConfig",
    "EngineConfig",
    "LoRAConfig",
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


def per_process(default: Any = None, **cli: Any) -> Any:
    """A dataclass field of an option that may differ between processes (see PER_PROCESS);
    `cli` as config_cli.option's."""
    return option(default, metadata=PER_PROCESS, **cli)


# Multi-step decode: the most decode steps one device call runs (--num-decode-steps).
MAX_DECODE_STEPS = 8

# A request's context when neither the user nor a smaller model limit sets it.
DEFAULT_MAX_MODEL_LEN = 2048

Dtype = Literal["float32", "bfloat16", "float16"]
DtypeOrAuto = Literal["auto", Dtype]
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
# Quantized KV caches: the name -> the cache's element type (DESIGN §9, "Quantized KV cache").
KV_QUANT_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}
KvCacheDtype = Literal["auto", Dtype, "fp8", "int8"]
KV_DTYPE_ALIASES = {"fp8_e4m3": "fp8", **DTYPE_ALIASES}  # vLLM's spellings


def jax_dtype(name: str) -> Any:
    """The JAX dtype of a resolved dtype name ("float32", "bfloat16", "float16"; for a KV
    cache also "fp8" = float8_e4m3fn and "int8")."""
    import jax.numpy as jnp

    if name in KV_QUANT_DTYPES:
        return jnp.dtype(KV_QUANT_DTYPES[name])
    if name not in get_args(Dtype):
        raise ValueError(f"dtype must be one of {', '.join(get_args(Dtype))}, got {name!r}.")
    return getattr(jnp, name)


def _user_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxserve"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What each step takes: sequences, tokens, order (vLLM's scheduler options)."""

    max_num_seqs: int = 32
    """Sequences in one step at most (the sampler's slots), for the whole mesh: data-parallel
    ranks split it evenly. With --request-buckets and no value: the largest bucket."""
    max_num_batched_tokens: int | None = None
    """Tokens in one step at most (the token budget), for the whole mesh. Default: the largest
    --token-buckets value when given, else the backend's: 8192 on TPU/GPU (vLLM's), less on a
    CPU, where larger steps only delay first tokens (jaxserve/backends)."""
    max_model_len: int = option(DEFAULT_MAX_MODEL_LEN,
                                not_a_flag="the engine sets it to the resolved --max-model-len")
    """The context length the scheduler enforces."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps; off needs max_num_batched_tokens >= max_model_len."""
    policy: Literal["fcfs", "priority"] = per_process("fcfs", flag="--scheduling-policy")
    """fcfs: by arrival; priority: by the requests' priority field (lower first), then arrival.
    The leader's scheduler's."""
    async_scheduling: bool = per_process(True)
    """Overlap host and device: plan and launch step t+1 while step t runs (the engine core)."""
    num_decode_steps: int | None = None
    """Multi-step decode (vLLM's former --num-scheduler-steps): while every running request
    decodes, run up to this many decode steps in one device call (sampling, stop tokens and
    lengths on the device; the host catches up after). 1 to 8; outputs are those of single
    steps. Default: the backend's (1 on a CPU, 4 on TPU/GPU; docs/performance.md). One
    data-parallel rank and one process only."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_decode_steps is not None and not 1 <= self.num_decode_steps <= MAX_DECODE_STEPS:
            raise ValueError(f"num_decode_steps must be in [1, {MAX_DECODE_STEPS}], got {self.num_decode_steps}.")
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
    """The model: its files, dtype, context, and the kernels that run it."""

    model: str | None = per_process(not_a_flag="the commands' MODEL argument (or serve's --model)")
    """HF model directory, .gguf file or Hugging Face Hub name (org/name; org/name:QUANT picks a
    GGUF repository's file by its quant, e.g. Q4_K_M). Default: the bundled model (its identity:
    config.json)."""
    revision: str | None = None
    """The Hub model's branch, tag or commit. Default: main."""
    download_dir: str | None = per_process()
    """Where Hub models are downloaded to. Default: the Hugging Face cache ($HF_HOME/hub)."""
    gguf_file: str | None = None
    """The .gguf file of a GGUF repository (or of a local directory) to load. Default: the one
    whose quant `org/name:QUANT` names (a GGUF repository needs one or the other)."""
    served_model_name: str | None = per_process(not_a_flag="from serve's --served-model-name")
    """The model's name in responses. Default: the model argument, or the bundled model's name."""
    dtype: DtypeOrAuto = option("auto", choice_aliases=DTYPE_ALIASES)
    """The weights' dtype (half = float16, float = float32, as in vLLM). auto: the backend's:
    bfloat16 on TPU/GPU, on a CPU the faster of bfloat16 and float32 (measured once per CPU)."""
    max_model_len: int | None = None
    """Context length (prompt and output tokens) of a request. Default: the model's
    max_position_embeddings; on TPU/GPU lowered, with a warning, to what the KV cache holds
    when it cannot hold one sequence that long (a value given here is refused instead); on a
    CPU at most 2048 (DEFAULT_MAX_MODEL_LEN)."""
    model_cache_dir: str | None = per_process()
    """Where GGUF files are converted to (once) and kept, under models/. Default: <user
    cache>/jaxserve."""
    attention_impl: str = "auto"
    """The paged-attention kernel: auto (the backend's), reference (pure JAX), cpu, tpu, gpu;
    tpu-interpret and gpu-interpret run the kernels on any host (slow, for checking)."""
    matmul_impl: Literal["auto", "xla", "amx", "avx512", "avx2"] = "auto"
    """Native CPU product kernels (one device; weights packed at load time): amx for bfloat16
    weights on CPUs with AMX, avx512 for float32 weights on CPUs with AVX-512, avx2 for float32
    weights with a kernel build without AVX-512 (AVX2-only CPUs); xla: XLA's dot; auto: the
    kernel that fits the weights' dtype where it can run, else xla."""
    cpu_kernel_target: Literal["native", "haswell", "x86-64"] = "native"
    """The instruction set the native CPU kernels are built for: native (this CPU), haswell (AVX2
    + FMA, no AVX-512: the class of most laptops, reproducible on newer CPUs) or x86-64 (portable
    loops). One build serves a process."""
    seed: int = 0
    """Seeds the random generators of requests that give no seed."""
    generation_config: str = per_process("auto")
    """Default sampling settings and EOS ids: auto (the model's generation_config.json), vllm
    (ignore its sampling defaults) or a folder or file holding a generation_config.json."""
    runner: Literal["auto", "generate", "pooling"] = "auto"
    """What the model serves: generate (text: completions, chat) or pooling (embeddings:
    /v1/embeddings, LLM.embed; decoder models, pooled as their sentence-transformers files say,
    else last token + L2 norm). auto: pooling for a base model's checkpoint (architectures
    named *Model, e.g. Qwen3Model: no LM head), else generate."""
    task: Literal["generate", "embed"] | None = None
    """vLLM's older spelling of --runner: embed = pooling. Default: --runner decides."""
    quantization: Literal["int8", "fp8", "int4"] | None = None
    """Weight-only quantization at load: int8 keeps every matmul weight (and the embedding) int8
    in device memory with per-channel float32 scales, converted inside the product; fp8 keeps
    the decoder layers' matmul weights float8_e4m3fn with per-channel scales, int4 as packed
    4-bit values with a scale and zero per group of 128 inputs (64/32 where 128 does not
    divide). Default: the checkpoint's weights as they are (FP8, AWQ and GPTQ checkpoints keep
    their own format, which a contradicting value here refuses)."""
    reasoning_parser: str | None = per_process(None, choices=REASONING_PARSER_NAMES)
    """The model's reasoning format (vLLM's --reasoning-parser): deepseek_r1 (DeepSeek-R1 and its
    distills), qwen3 (Qwen3) or gpt_oss (alias openai_gptoss: gpt-oss's Harmony channels).
    Chat completions then return the reasoning (between <think> and </think>; Harmony's analysis
    channel) as reasoning_content, apart from the content, and structured output and tool calls
    apply to the answer after it. Default: none (the reasoning stays in the content)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.reasoning_parser not in (None, *REASONING_PARSER_NAMES):
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; available: "
                             f"{', '.join(REASONING_PARSER_NAMES)}.")
        if self.dtype not in get_args(DtypeOrAuto):
            raise ValueError(f"dtype must be one of {', '.join(get_args(DtypeOrAuto))}, "
                             f"got {self.dtype!r}.")
        if self.task is not None:
            implied = {"embed": "pooling", "generate": "generate"}.get(self.task)
            if implied is None:
                raise ValueError(f"task must be 'generate' or 'embed', got {self.task!r}.")
            if self.runner not in ("auto", implied):
                raise ValueError(f"task {self.task!r} contradicts runner {self.runner!r}.")
            object.__setattr__(self, "runner", implied)
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', "
                             f"got {self.runner!r}.")
        if self.quantization not in (None, "int8", "fp8", "int4"):
            raise ValueError(f"quantization must be 'int8', 'fp8', 'int4' or None, "
                             f"got {self.quantization!r}.")

    def is_pooling(self, architectures: list[str] | None) -> bool:
        """Whether the engine embeds instead of generating, for a checkpoint of `architectures`."""
        if self.runner != "auto":
            return self.runner == "pooling"
        return bool(architectures) and all(a.endswith("Model") for a in architectures)

    def resolve_max_model_len(self, max_position_embeddings: int, cap: int | None = DEFAULT_MAX_MODEL_LEN) -> int:
        """The context length: the user's, else the model's, at most `cap` (the backend's
        `default_max_model_len`: none on accelerators)."""
        if self.max_model_len:
            return self.max_model_len
        return max_position_embeddings if cap is None else min(max_position_embeddings, cap)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page size, size, dtype, prefix caching."""

    page_size: int = option(16, aliases=("--block-size",))
    """Tokens per KV-cache page, a power of two (--block-size is vLLM's name)."""
    kv_cache_memory_bytes: int | None = option(
        None, flag="--kv-cache-memory", aliases=("--kv-cache-memory-bytes",), parse=parse_bytes)
    """KV-cache bytes per device; suffixes allowed (2GiB, 512MB); --kv-cache-memory-bytes is
    vLLM's name. Default: on accelerators
    device_memory_utilization of each device's free memory (the least over devices and
    processes), on a CPU 1 GiB (or JAXSERVE_CPU_KVCACHE_SPACE GiB from the environment)."""
    device_memory_utilization: float = option(0.9, flag="--gpu-memory-utilization")
    """Fraction of each accelerator's free memory for the KV cache when no byte budget is given
    (vLLM's --gpu-memory-utilization)."""
    num_pages: int | None = option(None, not_a_flag="tests only: a page count instead of a budget")
    """KV pages for the whole mesh, overriding the budget. Default: as many as the budget holds."""
    enable_prefix_caching: bool = per_process(True)
    """Reuse the KV cache of shared prompt prefixes (the leader's scheduler's)."""
    kv_cache_dtype: KvCacheDtype = option("auto", choice_aliases=KV_DTYPE_ALIASES)
    """The KV cache's dtype. auto: the model's, except float32 on a CPU without the native
    attention kernel (there XLA writes the cache, and its bfloat16 scatter is orders of magnitude
    slower). fp8 (or fp8_e4m3, vLLM's spellings): float8_e4m3fn, with the checkpoint's k/v
    scales (per tensor or per KV head) when it has them, else 1.0, as vLLM. int8: the
    checkpoint's scales, else per KV head scales measured at start-up on a calibration text.
    Either halves a bfloat16 cache's page (the budget holds twice the pages)."""

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}.")
        if not 0.0 < self.device_memory_utilization <= 1.0:
            raise ValueError("device_memory_utilization must be in (0, 1].")
        object.__setattr__(self, "kv_cache_dtype",
                           KV_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype))
        if self.kv_cache_dtype not in get_args(KvCacheDtype):
            choices = ", ".join([*get_args(KvCacheDtype), *KV_DTYPE_ALIASES])
            raise ValueError(f"kv_cache_dtype must be one of {choices}, "
                             f"got {self.kv_cache_dtype!r}.")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh, data_parallel_size x tensor_parallel_size devices (vLLM's names), and
    several hosts in one mesh: every host runs the same command, each with its --process-id;
    process 0 serves, the others run its steps headless."""

    data_parallel_size: int = 1
    """Data-parallel ranks (the mesh's data axis), each with its own scheduler, requests and KV
    pages."""
    tensor_parallel_size: int = 1
    """Devices each rank's weights and KV heads are split over (the mesh's model axis)."""
    sharding_rules: str = option("tp", metavar="PRESET|FILE")
    """How weights and the KV cache are laid over the mesh: a preset of
    jaxserve.models.sharding.RULE_PRESETS (tp, tp-replicate-vocab, tp-kv-replicated, fsdp,
    expert-parallel, attn-dp) or a JSON / YAML file mapping logical axes to mesh axes."""
    coordinator_address: str | None = per_process()
    """Several processes (hosts) in one mesh (jaxserve/parallel/multihost.py): the JAX
    coordinator's HOST:PORT (process 0's host), or auto to detect a Cloud TPU, SLURM or Kubernetes
    job. Default: one process."""
    num_processes: int | None = None
    """Processes (hosts) in the run. Default: one, or what auto detects."""
    process_id: int | None = per_process()
    """This process's index (0: the leader). Default: 0, or what auto detects."""
    follower_port: int | None = per_process()
    """The leader's port for its step channel. Default: the coordinator's port + 1."""
    step_timeout_seconds: float = per_process(120.0, flag="--step-timeout")
    """Seconds a follower waits to hear from the leader before it exits (the leader sends its
    own)."""
    heartbeat_timeout_seconds: int = option(100, flag="--heartbeat-timeout")
    """Seconds JAX's coordination service waits for a silent process (jax.distributed)."""
    startup_timeout_seconds: float = per_process(300.0, flag="--startup-timeout")
    """Seconds the leader waits for every follower to connect."""

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served on the base model (vLLM's flags): each adapter lives in one of
    max_loras device slots while it runs (the compiled step reads the slots; loading one never
    recompiles), and in a host cache of max_cpu_loras."""

    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories) on the base model. Off: no LoRA path at all."""
    max_loras: int = 1
    """Adapters on the device at once: the most distinct adapters in one step."""
    max_lora_rank: int = 16
    """The largest adapter rank accepted (every slot is padded to it)."""
    max_cpu_loras: int | None = None
    """Adapters kept in host memory (least recently used dropped first). Default: max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}).")


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """The compiled steps: the bucket grid and the caches that keep them across restarts."""

    token_buckets: tuple[int, ...] | None = None
    """Padded token counts to compile, e.g. 16 64 512 or 16,64,512. Default: x2 from 16 up to the
    token budget (on TPU/GPU x4 above 1024)."""
    request_buckets: tuple[int, ...] | None = None
    """Padded request counts to compile, e.g. 8 32. Default: x4 from 8 up to max_num_seqs."""
    compilation_cache_dir: str | None = per_process()
    """Where compiled steps (executables/) and, on a CPU, the weights packed for its kernels
    (weights/) are kept, so that restarts load them. Default: <user cache>/jaxserve/xla."""
    enable_compilation_cache: bool = per_process(True, flag="--compilation-cache")
    """Keep compiled steps and packed weights in compilation_cache_dir (--no-compilation-cache:
    compile and pack at every start)."""
    enable_executable_cache: bool = per_process(True, flag="--executable-cache")
    """Keep the compiled steps themselves on disk (runner/executable_cache.py), so that a restart
    loads them without tracing or compiling; needs the compilation cache."""
    compile_workers: int | None = per_process(None)
    """Processes compiling the steps side by side at a cold start (runner/compile_pool.py; needs
    the executable cache). Default: on TPU one per 4 cores, at most 8; elsewhere 1 (in this
    process)."""
    executables: str | None = per_process(None)
    """A directory of executables compiled ahead by `jaxserve compile` (for these devices, maybe on
    another host): the steps it holds are loaded, not compiled, when its manifest matches this
    engine (versions, devices, recipe); else one log line names what differs and they compile.
    Weights it holds (`jaxserve compile --weights`) are loaded, not prepared, likewise.
    Default: none (every step compiles, or comes from the executable cache)."""
    show_progress: bool = per_process(True, not_a_flag="the command's: on in serve, not generate")
    """Show a progress bar while the steps compile."""

    def cache_dir(self) -> str:
        return self.compilation_cache_dir or str(_user_cache_dir() / "xla")


_PART = "a part: its fields are the flags of the help group of its name"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every engine option: one part per concern, and the few that are the engine's own."""

    model: ModelConfig = option(ModelConfig(), not_a_flag=_PART)
    """The model."""
    cache: CacheConfig = option(CacheConfig(), not_a_flag=_PART)
    """The KV cache."""
    scheduler: SchedulerConfig = option(SchedulerConfig(), not_a_flag=_PART)
    """The scheduler."""
    parallel: ParallelConfig = option(ParallelConfig(), not_a_flag=_PART)
    """The device mesh and the processes."""
    compile: CompileConfig = option(CompileConfig(), not_a_flag=_PART)
    """The compiled steps."""
    lora: LoRAConfig = option(LoRAConfig(), not_a_flag=_PART)
    """LoRA adapters."""
    max_logprobs: int = option(20, group="model")
    """The most log-probs a request may ask for (logprobs, prompt_logprobs): the width of the
    sampler's top-logprobs outputs."""
    speculative_config: SpeculativeConfig | None = per_process(group="scheduler")
    """Speculative decoding, as vLLM's: e.g. {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2} (n-gram prompt lookup; the leader drafts,
    the step is the same), or {"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}
    (an EAGLE-3 draft head run inside the compiled step), {"method": "deepseek_mtp",
    "num_speculative_tokens": 2} (a DeepSeek V3 checkpoint's MTP layer, likewise), or
    {"model": DIR, "num_speculative_tokens": 3} (method "draft_model": a smaller causal LM with
    the target's vocabulary, likewise). Default: off."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @staticmethod
    def parts() -> dict[str, type]:
        """The sub-configurations by field name (also the CLI's help groups)."""
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "parallel": ParallelConfig, "compile": CompileConfig, "lora": LoRAConfig}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, routed to the sub-config that has the field.

        `LLM(model, max_num_seqs=8, page_size=16, ...)` and the CLI use this. An unknown name
        raises ValueError listing the accepted ones.
        """
        parts = cls.parts()
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
        # The scheduler enforces the context the user asked for (the engine replaces it with the
        # resolved one), so that its checks see the same length.
        if buckets["model"].get("max_model_len") is not None:
            buckets["scheduler"]["max_model_len"] = buckets["model"]["max_model_len"]
        # Explicit buckets without a limit: the largest bucket is the limit (token budget per
        # step, sequences per step).
        for key, limit in (("token_buckets", "max_num_batched_tokens"), ("request_buckets", "max_num_seqs")):
            if buckets["compile"].get(key) is not None:
                buckets["compile"][key] = tuple(sorted({int(x) for x in buckets["compile"][key]}))
                buckets["scheduler"].setdefault(limit, buckets["compile"][key][-1])
        return cls(**{name: parts[name](**vals) for name, vals in buckets.items()}, **top)

    # ------------------------------------------------------------------ the command line
    @classmethod
    def add_cli_args(
        cls,
        parser: argparse.ArgumentParser,
        names: Iterable[str] | None = None,
        help_overrides: Mapping[str, str] | None = None,
        groups: Mapping[str, argparse._ArgumentGroup] | None = None,
    ) -> dict[str, argparse._ArgumentGroup]:
        """Add a flag for every engine option (or for those in `names`) to `parser`, in one help
        group per part (model, cache, scheduler, parallel, compile; those in `groups` are the
        caller's); returns the groups by name. `help_overrides` replaces a field's help where a
        command uses it differently."""
        wanted = None if names is None else set(names)
        own = flag_fields(cls)
        groups, added = dict(groups or {}), set()
        for title, klass in cls.parts().items():
            fields = [(klass, f.name) for f in flag_fields(klass)]
            fields += [(cls, f.name) for f in own if f.metadata.get(GROUP) == title]
            fields = [(k, n) for k, n in fields if wanted is None or n in wanted]
            if fields:
                group = groups.get(title) or parser.add_argument_group(title, class_doc(klass))
                groups[title] = group
                for klass_, name in fields:
                    added.update(add_arguments(group, klass_, [name], help_overrides))
        if wanted is not None and wanted - added:
            raise KeyError(f"not engine flags: {', '.join(sorted(wanted - added))}")
        return groups

    @classmethod
    def cli_options(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The engine options given on the command line, as from_kwargs's keywords."""
        opts = values_from_args(cls, args)
        for klass in cls.parts().values():
            opts.update(values_from_args(klass, args))
        return opts
