"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    schedule -> run the compiled step -> update the scheduler -> detokenize / stop strings
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxserve.backends import select_backend
from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.models.arch_config import ArchConfig
from jaxserve.models.loader import load_checkpoint, resolve_model
from jaxserve.models.weights import create_model
from jaxserve.outputs import OutputKind, RequestOutput
from jaxserve.parallel.mesh import make_mesh
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.buckets import BucketGrid
from jaxserve.runner.compile import enable_persistent_cache
from jaxserve.runner.kv_cache import num_pages_for_budget
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling.config import SamplerConfig
from jaxserve.sampling.metadata import tokenize_bad_words
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        mc = config.model
        if config.compile.enable_compilation_cache:
            enable_persistent_cache(config.compile.cache_dir())
        self.model_path = resolve_model(mc.model, cache_dir=mc.model_cache_dir)
        self.model_name = mc.served_model_name or (mc.model or "SmolLM2-135M-Instruct")
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        ckpt = load_checkpoint(self.model_path)
        self.arch = ArchConfig.from_hf(ckpt.config)
        self.backend = select_backend()
        self.max_model_len = mc.max_model_len or min(self.arch.max_position_embeddings, 2048)
        if self.max_model_len > self.arch.max_position_embeddings:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d",
                           self.max_model_len, self.arch.max_position_embeddings)
        sc = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        self.mesh = make_mesh(config.parallel.data, config.parallel.model)
        self.plan = self.backend.plan(mc, config.cache, self.mesh)
        self.dtype, self.kv_dtype = _DTYPES[self.plan.dtype], _DTYPES[self.plan.kv_dtype]
        self.matmul_impl = self.plan.matmul_impl
        model = create_model(self.arch, dtype=self.dtype, mesh=self.mesh, attention_impl=mc.attention_impl,
                             get_tensor=ckpt.get_tensor, quantization=mc.quantization)
        self.backend.prepare_model(model, self.plan)
        self.load_seconds = time.perf_counter() - t0
        cc = config.cache
        num_pages = cc.num_pages or num_pages_for_budget(self.arch, cc.page_size, self.kv_dtype,
                                                         self.backend.kv_cache_budget(cc))
        self.kv_manager = KVCacheManager(cc.page_size, num_pages, enable_caching=cc.enable_prefix_caching,
                                         max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sc, self.kv_manager)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.sampler_config = SamplerConfig(max_num_seqs=sc.max_num_seqs, vocab_size=self.arch.vocab_size,
                                            max_logprobs=config.max_logprobs, native=self.plan.native_sampling)
        grid = BucketGrid.build(sc.max_num_batched_tokens, sc.max_num_seqs,
                                config.compile.token_buckets, config.compile.request_buckets)
        self.runner = ModelRunner(
            model, backend=self.backend, mesh=self.mesh, num_pages=num_pages, page_size=cc.page_size, max_model_len=self.max_model_len,
            max_num_seqs=sc.max_num_seqs, grid=grid, sampler_config=self.sampler_config, kv_dtype=self.kv_dtype,
            seed=mc.seed, show_progress=config.compile.show_progress,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._bad_words: dict[str, list[list[int]]] = {}
        self._ids = itertools.count()
        logger.info("engine ready: %s, %s, %d KV pages of %d, %d buckets compiled in %.1fs (load %.1fs)",
                    self.model_name, jnp.dtype(self.dtype).name, num_pages, cc.page_size,
                    self.runner.num_buckets, self.runner.compile_seconds, self.load_seconds)

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.arch.vocab_size}); got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty; send at least one token.")
        return ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Validate against the model and context; returns params with max_tokens resolved."""
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the model's context length is {self.max_model_len}; "
                "shorten the prompt so at least one token can be generated."
            )
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - n)
        elif n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length {self.max_model_len}; lower max_tokens to at most {self.max_model_len - n}."
            )
        eos = () if self.eos_token_id is None else (self.eos_token_id,)
        self.sampler_config.check_request(params, eos, self._bad_word_ids(params))
        return params

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]] | None:
        if not params.bad_words:
            return None
        return tokenize_bad_words(params.bad_words, lambda t: self.tokenizer.encode(t, add_special_tokens=False))

    def add_request(
        self,
        request_id: str | None,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
        add_special_tokens: bool = True,
    ) -> str:
        """Queue a request (n > 1 becomes n sequences sharing the prompt's cached blocks)."""
        request_id = request_id or f"req-{next(self._ids)}"
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt, add_special_tokens)
        params = self.check_request(prompt_ids, params)
        arrival = arrival_time or time.time()
        children = []
        for i in range(params.n):
            p = params if params.n == 1 else params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            rid = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(rid, prompt_ids, p, arrival_time=arrival, priority=priority,
                                    eos_token_id=self.eos_token_id))
        self.output_processor.add(request_id, children, prompt if isinstance(prompt, str) else None,
                                  output_kind, arrival)
        for req in children:
            words = self._bad_word_ids(req.sampling_params)
            if words:
                self._bad_words[req.request_id] = words
            self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outs = []
        for rid in ids:
            children = self.output_processor.child_ids(rid)
            self.scheduler.abort_requests(children)
            for c in children:
                self._bad_words.pop(c, None)
            out = self.output_processor.abort(rid)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        ro = self.runner.execute(so, self._eos_ids(), self._bad_words)
        finished = self.scheduler.update_from_output(so, ro.sampled)
        live = {s.request_id: self.scheduler.get_request(s.request_id) for s in so.scheduled}
        live.update({r.request_id: r for r in finished})
        outputs, stopped = self.output_processor.process(ro, finished, {k: v for k, v in live.items() if v})
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for r in finished:
            self._bad_words.pop(r.request_id, None)
        for rid in stopped:
            self._bad_words.pop(rid, None)
        return outputs

    def _eos_ids(self) -> tuple[int, ...]:
        return () if self.eos_token_id is None else (self.eos_token_id,)

    @property
    def num_compiles_after_warmup(self) -> int:
        return self.runner.counter.recompiles
