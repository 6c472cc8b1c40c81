"""StepRecipe: what an engine's compiled steps are a function of, and the one way to build them.

Four users compile the same step programs: the runner (on the real weights), the compile workers
(runner/compile_pool.py: abstract weights, in other processes), the memory probes that size the
KV cache on accelerators (engine/setup.py: abstract weights, other page counts) and `jaxserve
shard-plan` (tools/plan_compile.py: abstract weights, for meshes and chips this host may not
have). Each starts from a `StepRecipe` and goes through `step_program` (the step function, its
LoRA slots, its shardings) and `StepProgram.lower` (one bucket's Lowered program), so none of
them can describe a step the others would not compile: the recipe names the weights' format
(quantization, the checkpoint's own format), the KV cache's dtype (a quantized cache's scales
are inputs of the step, beside the weights: runner/kv_scales.py), the LoRA slots,
the sampler's sizes (max_logprobs included) and the drafts a request may add.
tests/engine/test_step_recipe.py lowers one recipe through all three and compares the programs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.backends.base import Backend, DevicePlan
from jaxserve.compiled_step.buckets import BucketGrid
from jaxserve.config import LoRAConfig, jax_dtype
from jaxserve.runner.decode_block import DecodeBlock, block_layout
from jaxserve.runner.kv_cache import abstract_kv_cache, zeros_compiler
from jaxserve.runner.lora_weights import LoRAWeights
from jaxserve.runner.step_buffers import BufferLayout
from jaxserve.runner.step_fn import StepFunction, abstract_sampling_state, step_layout, step_program as lower_step
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.state import (
    SamplingState,
    SlotRowsWrite,
    init_sampling_state,
    sampling_state_shardings,
    write_slot_rows,
)

@dataclasses.dataclass(frozen=True)
class StepRecipe:
    """What a runner's step programs are a function of, picklable (see the module's doc). The
    runner's host-side options (the seed of requests without one, the host LRU of adapters,
    the compile workers, the caches) are not in it: they change no program."""

    arch: dict  # the HF config.json (its quantization_config: the checkpoint's weight format)
    platform: str  # the backend's platform ("cpu", "tpu", "gpu")
    plan: dict  # the backend's DevicePlan, as a dict (dtype, KV dtype, kernels, products)
    attention_impl: str  # the model config's ("auto" is resolved inside the model)
    rules: dict  # the serving rules
    mesh_shape: tuple[int, int]  # (data, model)
    target: dict  # compile workers' devices: {"kind": "cpu"}, {"kind": "tpu", "topology": ...}; {}: none
    num_pages: int  # KV pages of the whole mesh
    page_size: int
    max_model_len: int
    sampler_config: SamplerConfig  # the sampler's sizes: slots, vocabulary, max_logprobs, native draws
    quantization: str | None = None  # --quantization: the weights quantized at load (int8, fp8, int4)
    max_loras: int = 0  # LoRA adapters' device slots (0: no LoRA path)
    max_lora_rank: int = 0
    # Speculative decoding's drafts per request and step: a drafting request samples on 1 + k
    # rows of the request bucket (the shapes do not change; the runner checks a step against it).
    num_speculative_tokens: int = 0
    # Drafting inside the step: the drafter's HF directory (an EAGLE-3 head's, a draft model's;
    # "": none, or MTP's, the target's own layer); the step drafts num_speculative_tokens tokens
    # per request on the device (jaxserve/runner/draft_head_step.py).
    draft_model: str = ""
    # The method drafting inside the step ("eagle3", "deepseek_mtp", "draft_model"; "": none).
    draft_method: str = ""
    token_buckets: tuple[int, ...] = ()  # the grid the runner compiles (T, R pairs with R <= T)
    request_buckets: tuple[int, ...] = ()
    # Multi-step decode (runner/decode_block.py): K > 1 adds one decode block of K steps per
    # request bucket; 1: none.
    num_decode_steps: int = 1
    # The KV heads the model is served with when zero heads are appended to the checkpoint's
    # for lane-dense TPU pages (`serving_arch`); 0: the checkpoint's.
    kv_heads: int = 0
    # The same for the drafter's own pages and weights (an EAGLE-3 head's layer, a draft model:
    # `serving_draft_heads`); 0: its checkpoint's (and always for MTP, the target's own layer).
    draft_kv_heads: int = 0

    def arch_config(self):
        """The model's ArchConfig as served (with the appended KV heads, if any)."""
        from jaxserve.models.arch_config import ArchConfig

        cfg = ArchConfig.from_hf(self.arch)
        return cfg.with_kv_heads(self.kv_heads) if self.kv_heads else cfg

    def model_attention(self, cfg, mesh, kv_dtype) -> str:
        """The attention implementation a model of `cfg` (the target, or a drafter over pages of
        `kv_dtype`) is built with in this recipe's step: the recipe's, with "auto" resolved for
        the recipe's platform where that is not JAX's default (a compile-only target: "auto"
        would resolve at trace time for this host's backend instead)."""
        if self.attention_impl != "auto" or self.platform == jax.default_backend():
            return self.attention_impl
        return target_attention("auto", self.platform, cfg, mesh, self.rules, self.page_size, kv_dtype,
                                self.dtype)[0]

    def pages_per_req(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def device_plan(self) -> DevicePlan:
        return DevicePlan(**self.plan)

    @property
    def kv_dtype(self):
        return jax_dtype(self.plan["kv_dtype"])

    @property
    def dtype(self):
        return jax_dtype(self.plan["dtype"])

    @property
    def data_parallel_size(self) -> int:
        return self.mesh_shape[0]

    def grid(self) -> BucketGrid:
        return BucketGrid(tuple(self.token_buckets), tuple(self.request_buckets))

    def block_buckets(self) -> tuple[int, ...]:
        """The request buckets of the decode blocks (none when K is 1)."""
        return tuple(self.request_buckets) if self.num_decode_steps > 1 else ()

    def with_pages(self, num_pages: int) -> StepRecipe:
        return dataclasses.replace(self, num_pages=num_pages)

    def program_key(self) -> StepRecipe:
        """The recipe without its grid (nor its decode blocks' K): what one bucket's program is a function of (with the
        bucket's name, the executable cache's key of a memory probe)."""
        return dataclasses.replace(self, token_buckets=(), request_buckets=(), num_decode_steps=1)


@dataclasses.dataclass(frozen=True, eq=False)
class StepProgram:
    """The step function of a recipe with the structure of its arguments: the weights (and the
    LoRA slots after them), the KV cache, the sampling state, each bucket's packed inputs."""

    recipe: StepRecipe
    cfg: Any  # the model's ArchConfig
    function: StepFunction
    mesh: Mesh
    lora: LoRAWeights | None  # the adapters' device slots (None: LoRA off)
    replicated: NamedSharding  # the packed inputs and the step's outputs
    # the sampling state's shardings (a SamplingState of them: the slots split over "data" like
    # the pages, the [S, V] arrays' vocabulary like the logits'; sampling/state.py)
    state_sharding: SamplingState
    # The drafter's own flat weights (real or abstract; they follow the target's in the step's
    # parameter list; [] for MTP, part of the target's) and the config of its own KV pages (a
    # head's one layer, a draft model's whole cache); None: no drafter
    drafter_params: list | None = None
    drafter_cfg: Any = None

    def layout(self, T: int, R: int) -> BufferLayout:
        """How a (T, R) step's inputs (ModelInputs, SamplingMetadata, TokenInfo) are packed."""
        r = self.recipe
        return step_layout(T, R, pages_per_req=r.pages_per_req(), page_size=r.page_size,
                           sampler_config=r.sampler_config, lora=self.lora is not None,
                           draft=self.drafter_cfg is not None)

    def abstract_target_kv(self):
        """The target's KV cache (abstract)."""
        r = self.recipe
        return abstract_kv_cache(self.cfg, r.num_pages, r.page_size, r.kv_dtype, self.mesh,
                                 r.rules)

    def abstract_draft_kv(self):
        """The drafter's own pages (abstract): a KVCache (a head's one layer, a draft model's
        layers), in `draft_cache_dtype`."""
        from jaxserve.runner.draft_head_step import draft_cache_dtype

        r = self.recipe
        return abstract_kv_cache(self.drafter_cfg, r.num_pages, r.page_size, draft_cache_dtype(r.dtype, r.kv_dtype),
                                 self.mesh, r.rules)

    def abstract_kv(self):
        """What the step takes as its KV cache: the target's, or with a drafter a DraftKV (the
        target's and the drafter's own, over the same pages)."""
        if self.drafter_cfg is None:
            return self.abstract_target_kv()
        from jaxserve.runner.draft_head_step import DraftKV

        return DraftKV(self.abstract_target_kv(), self.abstract_draft_kv())

    def abstract_state(self):
        return abstract_sampling_state(self.recipe.sampler_config, self.state_sharding)

    def lora_arrays(self, abstract: bool) -> list:
        """The LoRA slots' arrays that follow the weights: zeros (a runner's), or abstract."""
        if self.lora is None:
            return []
        return self.lora.abstract() if abstract else self.lora.zeros()

    # The executables a runner of this program holds, each loaded or compiled through `scope`
    # (an ExecutableScope: the runner's, or `jaxserve compile`'s for a target; runner/prebuilt.py)
    # under the one name both use.
    @staticmethod
    def step_name(bucket: tuple[int, int]) -> str:
        return f"step-{bucket[0]}x{bucket[1]}"

    def step_executable(self, scope, bucket: tuple[int, int], params, kv, sstate) -> jax.stages.Compiled:
        """The step of `bucket` over these arguments (abstract or real)."""
        lower, buffers = self.lower(bucket, params, kv, sstate)
        return scope.get(self.step_name(bucket), (params, kv, sstate, *buffers), lambda: lower().compile())

    @staticmethod
    def block_name(R: int, K: int) -> str:
        return f"decode-{R}x{K}"

    def block_layout(self, R: int) -> BufferLayout:
        """How a decode block of R rows packs its inputs (runner/decode_block.py)."""
        r = self.recipe
        return block_layout(R, r.num_decode_steps, pages_per_req=r.pages_per_req(), page_size=r.page_size,
                            sampler_config=r.sampler_config, lora=self.lora is not None)

    def block_executable(self, scope, R: int, params, kv, sstate) -> jax.stages.Compiled:
        """The decode block of R rows and the recipe's K steps over these arguments (one
        data-parallel rank: the plan gives K = 1 with several)."""
        r = self.recipe
        if r.data_parallel_size > 1:
            raise ValueError("multi-step decode runs without data parallelism")
        layout = self.block_layout(R)
        fn = DecodeBlock(self.function, r.num_decode_steps, r.page_size)
        lower = functools.partial(fn.lower, layout, params, kv, sstate, self.replicated)
        device = self.mesh.devices.flat[0]
        if device.platform != jax.default_backend():
            plain = lower

            def lower():
                with jax.default_device(device):
                    return plain()

        return scope.get(self.block_name(R, r.num_decode_steps), (params, kv, sstate, *layout.abstract(self.replicated)),
                         lambda: lower().compile())

    def kv_zeros(self, scope) -> jax.stages.Compiled:
        """The executable making one zeroed layer array of the KV cache."""
        return scope.get("kv-zeros", (), zeros_compiler(self.abstract_target_kv().k[0]))

    def draft_kv_zeros(self, scope) -> jax.stages.Compiled:
        """The executable making one zeroed layer array of the drafter's own pages (every K
        and V array of its KVCache has that shape)."""
        return scope.get("draft-kv-zeros", (), zeros_compiler(self.abstract_draft_kv().k[0]))

    def sampling_state_init(self, scope) -> jax.stages.Compiled:
        """The executable making the sampling state, zeroed, in its sharding."""
        return scope.get("sampling-state", (), lambda: jax.jit(
            functools.partial(init_sampling_state, self.recipe.sampler_config), out_shardings=self.state_sharding
        ).lower().compile())

    def empty_slot_write(self) -> SlotRowsWrite:
        """A slot-row write that writes nothing (every row aimed past the last slot)."""
        c = self.recipe.sampler_config
        return SlotRowsWrite(
            slots=np.full(c.slot_write_batch, c.max_num_seqs, np.int32),
            logit_bias=np.zeros((c.slot_write_batch, c.vocab_size), np.float32),
            bad_words=np.zeros((c.slot_write_batch, c.max_bad_words, c.max_bad_word_len), np.int32),
        )

    def slot_rows_writer(self, scope, sstate) -> jax.stages.Compiled:
        """The executable writing new requests' rows into the sampling state `sstate` (donated)."""
        rep = self.replicated
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), self.empty_slot_write())
        keep = jax.tree.map(lambda x: x.sharding, sstate)
        return scope.get("write-slot-rows", (sstate, rows), lambda: jax.jit(
            write_slot_rows, donate_argnums=(0,), out_shardings=keep).lower(sstate, rows).compile())

    def compile_lora_writer(self, scope) -> None:
        """The executable writing an adapter into a slot (nothing without LoRA)."""
        if self.lora is not None:
            self.lora.compile_writer(scope, self.replicated)

    def lower(self, bucket: tuple[int, int], params, kv, sstate):
        """(lower, abstract packed inputs) of `bucket`'s step over these arguments (abstract or
        real): per data-parallel rank inside a shard_map when the mesh has "data" over 1.
        For devices of another platform than JAX's default (a compile-only TPU slice) the
        lowering runs with the first of them as the default device: Pallas' TPU lowering reads
        the chip's generation from the default device ("Unsupported TPU device kind: cpu")."""
        lower, buffers = lower_step(self.function, self.layout(*bucket), self.mesh, params, kv, sstate,
                                    self.replicated)
        device = self.mesh.devices.flat[0]
        if device.platform == jax.default_backend():
            return lower, buffers

        def lower_for_target():
            with jax.default_device(device):
                return lower()

        return lower_for_target, buffers


def step_program(recipe: StepRecipe, model, backend: Backend, mesh: Mesh,
                 max_cpu_loras: int | None = None, drafter=None) -> tuple[StepProgram, list, Any]:
    """The step of `recipe` over `model` (real or abstract weights, already laid out by
    `backend`): (program, the model's flat weights, their tree structure). The LoRA slots'
    arrays follow the weights in the step's parameter list (`StepProgram.lora_arrays`), and so
    do a drafter's own (`StepProgram.drafter_params`, draft_head_step.drafting_step):
    `drafter`, the loaded EAGLE-3 head or draft model, or None for an abstract one read from
    `recipe.draft_model` (an MTP layer is the target's own). A quantized KV cache's scales are
    inputs of the step, the layers' `KVCacheScale` arrays among the weights (ones where the
    model has none: runner/kv_scales.py)."""
    from jaxserve.runner.kv_scales import kv_scale_inputs

    kv_scale_inputs(model, recipe.kv_dtype)
    graphdef, state = nnx.split(model)
    params, treedef = jax.tree.flatten(state)
    lora = None
    if recipe.max_loras:
        if not getattr(model, "supports_lora", False):
            raise ValueError(f"LoRA adapters are not supported for {model.config.architecture}")
        config = LoRAConfig(enable_lora=True, max_loras=recipe.max_loras, max_lora_rank=recipe.max_lora_rank,
                            max_cpu_loras=max_cpu_loras)
        lora = LoRAWeights(model.config, config, model.dtype, mesh, recipe.rules)
    # A backend's fused layer has no LoRA products: with LoRA the model's own layer runs.
    layer_impl = backend.layer_impl(model) if lora is None else None
    function = StepFunction(graphdef, treedef, layer_impl, recipe.sampler_config,
                            None if lora is None else lora.treedef)
    replicated = NamedSharding(mesh, P())
    state_sharding = sampling_state_shardings(recipe.sampler_config, mesh, recipe.rules,
                                              recipe.data_parallel_size > 1)
    if not recipe.draft_method:
        return StepProgram(recipe, model.config, function, mesh, lora, replicated, state_sharding), params, treedef
    from jaxserve.runner.draft_head_step import drafting_step

    if lora is not None or recipe.num_decode_steps > 1 or recipe.data_parallel_size > 1 or mesh.size > 1:
        raise ValueError(f"{recipe.draft_method} speculative decoding runs on one device, without LoRA and "
                         "without multi-step decode")
    function, dparams, cache_cfg = drafting_step(recipe, model, mesh, drafter, graphdef, treedef, layer_impl)
    return StepProgram(recipe, model.config, function, mesh, lora, replicated, state_sharding, dparams,
                       cache_cfg), params, treedef


def abstract_model(recipe: StepRecipe, mesh: Mesh, backend: Backend):
    """The model a runner of `recipe` holds, without memory: abstract weights in the recipe's
    format and shardings, laid out by the backend as real ones are (a quantized KV cache's
    scales, abstract too, are added by `step_program`)."""
    from jaxserve.models.weights import sharded_abstract_model

    cfg = recipe.arch_config()
    plan = recipe.device_plan()
    attention = recipe.model_attention(cfg, mesh, recipe.kv_dtype)
    model = sharded_abstract_model(cfg, dtype=recipe.dtype, mesh=mesh, attention_impl=attention,
                                   rules=recipe.rules, moe_impl=plan.moe_impl, quantization=recipe.quantization)
    backend.prepare_model(model, plan, abstract=True)
    return model


def program_fingerprint(lowered: jax.stages.Lowered) -> str:
    """A short hash of a lowered step program's text (StableHLO): equal for equal programs."""
    import hashlib

    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:16]


def _mla_attention(requested: str, platform: str, cfg, page_size: int, q_dtype, kv_dtype
                   ) -> tuple[str, str | None]:
    """`target_attention` for a multi-head latent attention model (one latent row per token,
    every query head reading it): "gpu" or "tpu" when MLA's own kernel there takes the shapes
    (pallas_kernels/mla_paged_attention/ops.py), else what the GQA op's dispatch runs."""
    from jaxserve.pallas_kernels.mla_paged_attention.ops import kernel_name

    width = cfg.kv_cache_head_dim
    name = kernel_name(requested, jax.ShapeDtypeStruct((1, cfg.num_heads, width), q_dtype),
                       jax.ShapeDtypeStruct((1, page_size, width), kv_dtype), cfg.kv_lora_rank,
                       backend=platform)
    if name.startswith("mla-"):
        return name.removeprefix("mla-"), None
    return name, (None if name != "reference" or requested != "auto"
                  else f"no {platform} kernel takes {width}-wide latent rows")


def serving_arch(requested: str, platform: str, cfg, mesh, rules, page_size: int, kv_dtype, dtype,
                 devices=None, *, lora: bool = False):
    """`cfg` as attention `requested` ("auto") serves it on `platform` over `mesh`: with zero KV
    heads appended (`ArchConfig.with_kv_heads`) where the implementation that platform takes
    first needs lane-dense pages (`ops.lane_dense_kv_heads`: the TPU kernel, for rows of
    Hkv x D that are not a multiple of 128 lanes, e.g. SmolLM2's 3 x 64) and runs on the padded
    heads; else as the checkpoint stores it. The one place the padding is decided (DESIGN §9,
    "Lane-dense KV pages"); never on CPUs and GPUs unless a TPU kernel is asked for by name
    ("tpu-interpret": how the CPU tests force it). Not with LoRA (the adapters hold the
    checkpoint's heads). `cfg`: the target's, or a drafter's own pages' (`serving_draft_heads`,
    `kv_dtype` theirs). Arguments as `target_attention`'s."""
    from jaxserve.models import sharding as ax
    from jaxserve.models.interface import KV_CACHE_AXES
    from jaxserve.pallas_kernels.ragged_paged_attention.ops import (
        auto_candidates,
        lane_dense_kv_heads,
        resolve_impl,
    )

    cfg = cfg.checkpoint_config()
    if lora or cfg.kv_padding_blocker() is not None:
        return cfg
    if devices is None and hasattr(mesh, "devices"):
        devices = list(mesh.devices.flat)
    first = (auto_candidates(platform, devices)[0] if requested == "auto"
             else resolve_impl(requested, platform))
    # The devices the rules ask to split the KV heads over (a head count every mesh axis divides)
    many = max(1, int(np.prod(list(mesh.shape.values()))))
    asked = ax.logical_to_spec(KV_CACHE_AXES, (1, page_size, many, cfg.head_dim), mesh, rules)[2]
    split = ax.mesh_axes_size(mesh, asked)
    heads = lane_dense_kv_heads(first, cfg.num_kv_heads, cfg.head_dim, split)
    if heads == cfg.num_kv_heads:
        return cfg
    padded = cfg.with_kv_heads(heads)
    impl, _ = target_attention(requested, platform, padded, mesh, rules, page_size, kv_dtype, dtype,
                               devices)
    return padded if impl == first else cfg


def serving_draft_heads(method: str, draft_model: str, target, requested: str, platform: str, mesh, rules,
                        page_size: int, kv_dtype, dtype, devices=None) -> int:
    """The KV heads the drafter of speculative `method` ("eagle3", "draft_model") in directory
    `draft_model` is served with, 0 for its checkpoint's: `serving_arch` of its own pages (an
    EAGLE-3 head's decoder layer, a draft model's layers) in their dtype (`draft_cache_dtype`
    of the model's `dtype` and the target's `kv_dtype`), so that they are lane-dense where the
    TPU kernel runs, as the target's are. 0 for "deepseek_mtp" (and no method): its layer is
    the target's own, its pages the target's config (`serving_arch` of the target decides
    them; MLA is never padded). `target`: the target's ArchConfig; the rest as
    `serving_arch`'s. The loaders apply it (`load_eagle3`, `load_draft_model`: `kv_heads`)."""
    from jaxserve.runner.draft_head_step import DRAFT_MODEL, EAGLE3, draft_cache_config, draft_cache_dtype

    if method not in (EAGLE3, DRAFT_MODEL):
        return 0
    cfg = draft_cache_config(method, target, draft_model)
    served = serving_arch(requested, platform, cfg, mesh, rules, page_size, draft_cache_dtype(dtype, kv_dtype),
                          dtype, devices)
    return served.num_kv_heads if served.checkpoint_heads else 0


def target_attention(requested: str, platform: str, cfg, mesh, rules, page_size: int, kv_dtype,
                     dtype, devices=None) -> tuple[str, str | None]:
    """(implementation, why not the first kernel) that attention `requested` ("auto") takes on
    `platform` for this model on `mesh` (anything with the mesh's `shape`), decided as "auto"
    decides when serving there (the first of the platform's kernels whose shape check takes one
    device's heads, else the reference), without devices: for programs compiled where that
    platform is not JAX's default (compile-only topologies) and for the engine's plan.
    `devices`: the mesh's devices or their descriptions (on GPUs "auto" reads their compute
    capability; default `mesh.devices`). `dtype`: the model's (a quantized cache's queries come
    in it)."""
    from jaxserve.models import sharding as ax
    from jaxserve.models.interface import KV_CACHE_AXES
    from jaxserve.pallas_kernels.kv_quant import attention_dtype
    from jaxserve.pallas_kernels.ragged_paged_attention.ops import auto_candidates, resolve_impl, supports_check
    from jaxserve.runner.kv_cache import kv_head_shape

    if devices is None and hasattr(mesh, "devices"):
        devices = list(mesh.devices.flat)
    if cfg.is_mla:  # multi-head latent attention: its op's own dispatch
        return _mla_attention(requested, platform, cfg, page_size, attention_dtype(kv_dtype, dtype),
                              kv_dtype)
    candidates = (auto_candidates(platform, devices) if requested == "auto"
                  else (resolve_impl(requested, platform),))
    spec = ax.logical_to_spec(KV_CACHE_AXES, kv_head_shape(cfg, 1, page_size), mesh, rules)
    split = ax.mesh_axes_size(mesh, spec[2])
    notes = []
    for impl in candidates:
        check = supports_check(impl)
        if check is None:
            return impl, "; ".join(notes) or None
        try:
            check(jax.ShapeDtypeStruct((1, cfg.num_heads // split, cfg.kv_cache_head_dim),
                                       attention_dtype(kv_dtype, dtype)),
                  jax.ShapeDtypeStruct((1, page_size, cfg.kv_cache_heads // split
                                        * cfg.kv_cache_head_dim), kv_dtype))
        except ValueError as e:
            notes.append(f"{impl} kernel unsupported: {e}")
            continue
        return impl, "; ".join(notes) or None
    return "reference", "; ".join(notes)
