"""Train an EAGLE-3 draft head for a Llama-family target on text the target itself generates,
save it in the `speculators` layout that models/eagle3_checkpoint.py `load_eagle3` reads, and measure its
offline acceptance length.

The recipe (each step a function below, so that tests run them on a tiny target):

1. data: the target (`LLM(model).generate`, default: SmolLM2-135M-Instruct) answers
   chat-templated instructions from a built-in list (sampled, seeded); for every sequence the
   target's hidden states at the tap layers (`default_aux_layer_ids`: (2, L // 2, L - 3)) and
   its own greedy next token at every position (`TargetTaps`: one paged forward a sequence);
2. draft vocabulary: the D most frequent of the target's next tokens (`draft_vocabulary`:
   d2t[d] = target_id - d over the sorted ids, t2d marks them);
3. training (`train`): the drafter's dense step (`Eagle3Drafter.__call__`) with EAGLE-3's
   training-time test: `ttt` steps unrolled per position, each step's hidden the drafter's own
   previous output, its input token the sequence's (teacher-forced), its keys those of the
   context and of its own chain; loss = cross entropy against the target's next tokens in the
   draft vocabulary (tokens outside it masked), summed over the steps; AdamW written out
   (warmup, cosine decay, global-norm clipping); the target's embedding table stays frozen;
4. `save_drafter`: config.json + model.safetensors in the speculators layout (no embedding
   table: the target's is used), checked by loading it back with `load_eagle3`;
5. `acceptance`: on held-out prompts answered greedily, at every position of the answer the
   drafter's chain of k drafts (its own drafts as the later steps' inputs) against the
   target's next k greedy tokens: accepted = the leading matches; the mean accepted length
   (+1, the bonus token) and the per-position acceptance rates.

    .venv/bin/python benchmarks/train_eagle3.py --out /tmp/eagle3-smollm2 [--sequences 240]
        [--steps 300] [--draft-vocab 4096] [--model DIR]

One JSON line to benchmarks/results/eagle3_smollm2/results.jsonl (recipe, wall times, loss,
acceptance; results_log's header: commit, CPU, versions), every step's loss to loss_curve.json
and the recipe with the curve in windows to loss_curve.md there; the weights stay in --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "eagle3_smollm2"

# Varied instructions: the training prompts.
INSTRUCTIONS = [
    "Explain how a rainbow forms.",
    "Write a short poem about the sea.",
    "What are three tips for staying focused while studying?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between weather and climate?",
    "Write a short story about a lost dog who finds its way home.",
    "How do I reverse a list in Python?",
    "List five fruits that are high in vitamin C.",
    "Explain what photosynthesis is to a ten-year-old.",
    "What should I pack for a weekend camping trip?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "Write a polite email asking my manager for a day off.",
    "What are the benefits of regular exercise?",
    "Explain the rules of chess briefly.",
    "How does a bicycle stay upright?",
    "Give me three ideas for a birthday party.",
    "What is a prime number? Give some examples.",
    "Describe a sunset over the mountains.",
    "How can I save money on groceries?",
    "Explain what a computer virus is.",
    "Write a haiku about autumn leaves.",
    "What causes earthquakes?",
    "How do I make a good first impression at a job interview?",
    "Explain the difference between a list and a tuple in Python.",
    "What are some good habits for better sleep?",
    "Tell me a fun fact about octopuses.",
    "How does the moon affect the tides?",
    "Write a short dialogue between a cat and a mouse.",
    "What is the capital of France, and what is it famous for?",
    "Give me a simple explanation of how vaccines work.",
    "How do plants grow from seeds?",
    "Describe your ideal weekend.",
    "What are the main parts of a cell?",
    "Explain what inflation means in economics.",
    "Write a limerick about a clumsy wizard.",
    "How do I boil an egg perfectly?",
    "What is machine learning?",
    "List some ways to reduce plastic waste at home.",
    "Why do leaves change color in the fall?",
    "Explain how to write a for loop in JavaScript.",
    "What are the planets of the solar system?",
    "Give me advice for learning a new language.",
    "Describe how a car engine works in simple words.",
    "Write a motivational message for someone starting a new job.",
    "What is the Pythagorean theorem?",
    "How do bees make honey?",
]
# Held out from training: the acceptance measurement's prompts.
HELD_OUT = [
    "Explain how airplanes fly.",
    "Write a short poem about the city at night.",
    "What are some tips for keeping a houseplant healthy?",
    "Describe how a volcano erupts.",
    "How do I sort a dictionary by value in Python?",
    "What are the benefits of reading books?",
    "Write a short story about a robot who learns to paint.",
    "Why do we have seasons on Earth?",
    "Give me a recipe for pancakes.",
    "Explain what gravity is to a child.",
    "What should I do if I feel stressed at work?",
    "Describe the life cycle of a butterfly.",
]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that decides a run (recorded with its results)."""

    sequences: int = 240  # training completions
    max_tokens: int = 160  # per completion
    temperature: float = 0.7
    seed: int = 0
    draft_vocab: int = 4096
    ttt_steps: int = 3  # drafting steps unrolled per position
    steps: int = 300  # optimizer steps
    batch: int = 8  # sequences per step
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 20
    clip_norm: float = 1.0
    eval_prompts: int = len(HELD_OUT)
    eval_tokens: int = 128
    k: int = 3  # drafts per step in the acceptance measurement


# ---------------------------------------------------------------------------- 1. data
def chat_prompts(tokenizer, instructions: Sequence[str]) -> list[list[int]]:
    """Each instruction as a one-turn chat, templated with the generation prompt: token ids."""
    hf = getattr(tokenizer, "hf_tokenizer", tokenizer)
    return [list(hf.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False))
            for text in instructions]


def generate(llm, instructions: Sequence[str], *, max_tokens: int, temperature: float,
             seed: int) -> list[tuple[list[int], int]]:
    """The target's answers to `instructions` (cycled), one request each seeded seed + i:
    [(prompt + answer token ids, prompt length)]."""
    from jaxserve import SamplingParams

    prompts = chat_prompts(llm.get_tokenizer(), instructions)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids))
            for o in outs]


def cycled(items: Sequence[str], n: int) -> list[str]:
    return [items[i % len(items)] for i in range(n)]


class TargetTaps:
    """The target over one sequence at a time (the paged path, with a small cache): its hidden
    states at `taps` and its greedy next token at every position."""

    def __init__(self, model_dir, taps: Sequence[int], page_size: int = 16):
        from jaxserve.models.weights import load_model

        self.model = load_model(model_dir)
        self.config = self.model.config
        self.taps = tuple(taps)
        self.page_size = page_size
        graphdef, self.state = nnx.split(self.model)
        self._kv: dict[int, object] = {}

        @jax.jit
        def forward(state, kv, inputs):
            m = nnx.merge(graphdef, state)
            h, _, tapped = m(inputs.input_ids, inputs.positions, kv, inputs.md, taps=self.taps)
            return jnp.argmax(m.compute_logits(h), axis=-1).astype(jnp.int32), tapped

        self._forward = forward

    def embedding_table(self) -> np.ndarray:
        """The target's [V, E] embedding table (the drafter's)."""
        return np.asarray(self.model.embed_tokens(jnp.arange(self.config.vocab_size)))

    def __call__(self, seq: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(taps [n, A*E] float32, next token ids [n] int32) of the n-token `seq`."""
        from jaxserve.models.sharding import single_device_mesh
        from jaxserve.runner.kv_cache import allocate_kv_cache
        from jaxserve.runner.step_inputs import StepRequest, pack_step

        n = len(seq)
        bucket = max(self.page_size, 1 << (n - 1).bit_length())
        pages = bucket // self.page_size
        if bucket not in self._kv:
            self._kv[bucket] = allocate_kv_cache(self.config, pages + 1, self.page_size,
                                                 jnp.float32, single_device_mesh())
        inputs = pack_step([StepRequest(list(seq), 0, list(range(1, pages + 1)))],
                           num_tokens=bucket, num_reqs=2, pages_per_req=pages,
                           page_size=self.page_size)
        ids, tapped = self._forward(self.state, self._kv[bucket],
                                    jax.tree.map(jnp.asarray, inputs))
        return np.asarray(tapped)[:n], np.asarray(ids)[:n]


@dataclasses.dataclass
class Examples:
    """Sequences laid out for the drafter, padded to `length`: at position i (the target has
    processed token s[i]) `taps` [N, T, A*E] are the target's hidden states there, `input_ids`
    [N, T] the token s[i+1] the drafter takes with them, `labels` [N, T] the target's greedy
    next token after s[i+1] (what the first draft of i predicts), `valid` [N, T] whether s[i+1]
    exists; `answer_start` [N] the first position whose input token is an answer's (prompt
    length - 1)."""

    taps: np.ndarray
    input_ids: np.ndarray
    labels: np.ndarray
    valid: np.ndarray
    answer_start: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def build_examples(seqs: Sequence[tuple[list[int], int]], target: TargetTaps, length: int
                   ) -> Examples:
    """`seqs` (token ids, prompt length) through the target, cut to `length` + 1 tokens."""
    A = len(target.taps) * target.config.hidden_size
    N = len(seqs)
    out = Examples(np.zeros((N, length, A), np.float32), np.zeros((N, length), np.int32),
                   np.zeros((N, length), np.int32), np.zeros((N, length), bool),
                   np.zeros((N,), np.int32))
    for j, (seq, prompt_len) in enumerate(seqs):
        seq = seq[: length + 1]
        taps, nxt = target(seq)
        n = len(seq) - 1  # positions with a next token
        out.taps[j, :n] = taps[:n]
        out.input_ids[j, :n] = seq[1:]
        out.labels[j, :n] = nxt[1:]
        out.valid[j, :n] = True
        out.answer_start[j] = prompt_len - 1
    return out


# ---------------------------------------------------------------------------- 2. vocabulary
def draft_vocabulary(examples: Examples, target_vocab: int, size: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The `size` target ids most frequent among the target's next tokens (ties: the lower id),
    as (d2t int64 [size], t2d bool [V]): draft id d is target id d + d2t[d], ids ascending."""
    counts = np.bincount(examples.labels[examples.valid], minlength=target_vocab)
    order = np.lexsort((np.arange(target_vocab), -counts))  # by count, then id
    ids = np.sort(order[:size])
    t2d = np.zeros(target_vocab, bool)
    t2d[ids] = True
    return (ids - np.arange(size)).astype(np.int64), t2d


# ---------------------------------------------------------------------------- 3. training
def layer_hf_config(target_hf: dict) -> dict:
    """The drafter's decoder layer config: the target's, one layer, untied."""
    keep = {k: v for k, v in target_hf.items() if k not in ("architectures", "torch_dtype")}
    return {**keep, "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False}


def drafter_hf_config(target_hf: dict, draft_vocab: int, taps: Sequence[int], k: int) -> dict:
    """config.json of the drafter in the speculators layout."""
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"architectures": list(target_hf.get("architectures") or []),
                         "name_or_path": None},
        },
        "transformer_layer_config": layer_hf_config(target_hf),
        "draft_vocab_size": int(draft_vocab),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in taps],
        "norm_before_residual": False,
        "norm_output": False,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def new_drafter(hf_config: dict, embed: np.ndarray, d2t: np.ndarray, t2d: np.ndarray,
                seed: int):
    """A small-random drafter of `hf_config` over the target's embedding table."""
    from jaxserve.models.eagle3 import Eagle3Config, Eagle3Drafter

    drafter = Eagle3Drafter(Eagle3Config.from_hf(hf_config), rngs=nnx.Rngs(seed))
    drafter.embed.set_value(jnp.asarray(embed, jnp.float32))
    drafter.d2t.set_value(jnp.asarray(d2t, jnp.int32))
    drafter.t2d.set_value(jnp.asarray(t2d))
    return drafter


def trainable(path, value) -> bool:
    """The drafter's trained parameters: all but the target's embedding table."""
    return isinstance(value, nnx.Param) and path[0] != "embed"


def chain_mask(n: int, step: int) -> jax.Array:
    """[n, (step + 1) * n]: the keys position i's draft of `step` sees: step 0's up to i, and
    its own chain's earlier drafts at i."""
    causal = jnp.tril(jnp.ones((n, n), bool))
    return jnp.concatenate([causal] + [jnp.eye(n, dtype=bool)] * step, axis=1)


def shifted(x: jax.Array, k: int) -> jax.Array:
    """x[i + k] at i, zero past the end."""
    return x if k == 0 else jnp.concatenate([x[k:], jnp.zeros((k,) + x.shape[1:], x.dtype)])


def sequence_losses(drafter, taps, input_ids, labels, valid, steps: int) -> jax.Array:
    """Training-time test over one sequence: the mean cross entropy of each of `steps` chained
    drafts, [steps] (step k at i: input token s[i+1+k], hidden the previous step's output,
    label the target's next token after s[i+1+k], masked outside the draft vocabulary)."""
    from jaxserve.models.eagle3 import DenseKV

    T = input_ids.shape[0]
    t2d = drafter.t2d[...]
    target_to_draft = jnp.cumsum(t2d) - 1  # target id -> its draft id where t2d marks it
    hidden = drafter.combine_hidden(taps)
    kv = DenseKV.empty(drafter.config)
    losses = []
    for k in range(steps):
        lbl = shifted(labels, k)
        mask = shifted(valid, k) & t2d[lbl]
        step, kv = drafter(shifted(input_ids, k), jnp.arange(T) + k, hidden, kv, chain_mask(T, k))
        logp = jax.nn.log_softmax(step.logits, axis=-1)
        nll = -jnp.take_along_axis(logp, target_to_draft[lbl][:, None], axis=-1)[:, 0]
        losses.append(jnp.sum(nll * mask) / jnp.maximum(mask.sum(), 1))
        hidden = step.hidden
    return jnp.stack(losses)


def lr_at(step, recipe: Recipe):
    """Linear warmup, then cosine decay to a tenth."""
    warm = (step + 1) / max(recipe.warmup, 1)
    frac = jnp.clip((step - recipe.warmup) / max(recipe.steps - recipe.warmup, 1), 0.0, 1.0)
    cos = 0.1 + 0.9 * 0.5 * (1 + jnp.cos(math.pi * frac))
    return recipe.lr * jnp.where(step < recipe.warmup, warm, cos)


def make_train_step(graphdef, frozen, recipe: Recipe):
    """A jitted (params, opt, batch, step) -> (params, opt, loss, per-step losses): one AdamW
    step (β = 0.9, 0.95; decoupled weight decay on matrices only) on the summed TTT loss."""
    b1, b2, eps = 0.9, 0.95, 1e-8

    def loss_fn(params, batch):
        drafter = nnx.merge(graphdef, params, frozen)
        per = jax.vmap(lambda *a: sequence_losses(drafter, *a, recipe.ttt_steps))(*batch)
        per = per.mean(axis=0)
        return per.sum(), per

    @jax.jit
    def train_step(params, opt, batch, step):
        (loss, per), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, recipe.clip_norm / (norm + 1e-6))
        grads = jax.tree.map(lambda g: g * scale, grads)
        m, v = opt
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        t = step + 1
        lr = lr_at(step, recipe)

        def update(p, m, v):
            upd = (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + eps)
            decay = recipe.weight_decay * p if p.ndim > 1 else 0.0
            return p - lr * (upd + decay)

        params = jax.tree.map(update, params, m, v)
        return params, (m, v), loss, per

    return train_step


def train(drafter, examples: Examples, recipe: Recipe, *, log=print) -> list[dict]:
    """`recipe.steps` AdamW steps on batches of `recipe.batch` sequences drawn at random
    (seeded); updates `drafter` in place. Returns the loss curve: one entry a step."""
    graphdef, params, frozen = nnx.split(drafter, trainable, ...)
    params = jax.tree.map(jnp.asarray, params)
    opt = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))
    train_step = make_train_step(graphdef, frozen, recipe)
    rng = np.random.default_rng(recipe.seed)
    curve = []
    start = time.perf_counter()
    for step in range(recipe.steps):
        idx = rng.choice(len(examples), size=min(recipe.batch, len(examples)), replace=False)
        batch = tuple(jnp.asarray(a[idx]) for a in (examples.taps, examples.input_ids,
                                                   examples.labels, examples.valid))
        params, opt, loss, per = train_step(params, opt, batch, jnp.asarray(step, jnp.int32))
        entry = {"step": step, "loss": float(loss),
                 "step_losses": [round(float(x), 4) for x in per],
                 "lr": float(lr_at(step, recipe)), "s": round(time.perf_counter() - start, 2)}
        curve.append(entry)
        if step % 20 == 0 or step == recipe.steps - 1:
            log(f"step {step}: loss {entry['loss']:.4f} {entry['step_losses']} ({entry['s']} s)")
    nnx.update(drafter, params)
    return curve


# ---------------------------------------------------------------------------- 4. saving
def drafter_tensors(drafter) -> dict[str, np.ndarray]:
    """The drafter's weights as the speculators layout names and shapes them ([out, in])."""
    cfg = drafter.config.layer
    E = cfg.hidden_size
    layer = drafter.layer
    a = lambda p: np.asarray(p[...], np.float32)
    heads = lambda w: a(w).reshape(2 * E, -1).T
    pre = "layers.0."
    return {
        "fc.weight": a(drafter.fc).T,
        pre + "input_layernorm.weight": a(layer.input_norm),
        pre + "hidden_norm.weight": a(layer.hidden_norm),
        pre + "self_attn.q_proj.weight": heads(layer.wq),
        pre + "self_attn.k_proj.weight": heads(layer.wk),
        pre + "self_attn.v_proj.weight": heads(layer.wv),
        pre + "self_attn.o_proj.weight": a(layer.wo).reshape(-1, E).T,
        pre + "post_attention_layernorm.weight": a(layer.post_norm),
        pre + "mlp.gate_proj.weight": a(layer.w_gate).T,
        pre + "mlp.up_proj.weight": a(layer.w_up).T,
        pre + "mlp.down_proj.weight": a(layer.w_down).T,
        "norm.weight": a(drafter.final_norm),
        "lm_head.weight": a(drafter.lm_head).T,
        "d2t": np.asarray(drafter.d2t[...], np.int64),
        "t2d": np.asarray(drafter.t2d[...], bool),
    }


def save_drafter(drafter, hf_config: dict, out: pathlib.Path) -> pathlib.Path:
    """config.json + model.safetensors (contiguous copies) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = {k: np.ascontiguousarray(v) for k, v in drafter_tensors(drafter).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------------------- 5. acceptance
def make_chain(drafter, k: int):
    """A jitted (state, taps, input_ids) -> [k, T] target ids: at every position i, the chain
    of k drafts (the first from the target's taps at i and token s[i+1], each later one from
    the previous draft and its hidden state), every position at once."""
    from jaxserve.models.eagle3 import DenseKV

    graphdef, state = nnx.split(drafter)

    @jax.jit
    def chain(state, taps, input_ids):
        d = nnx.merge(graphdef, state)
        T = input_ids.shape[0]
        hidden, ids, kv, drafts = d.combine_hidden(taps), input_ids, DenseKV.empty(d.config), []
        for j in range(k):
            step, kv = d(ids, jnp.arange(T) + j, hidden, kv, chain_mask(T, j))
            drafts.append(step.target_ids)
            ids, hidden = step.target_ids, step.hidden
        return jnp.stack(drafts)

    return lambda taps, input_ids: chain(state, taps, input_ids)


def acceptance(drafter, examples: Examples, k: int = 3, *, answers_only: bool = True) -> dict:
    """Offline acceptance of `drafter`'s k-draft chains against the target's greedy next
    tokens (`examples.labels`; for greedily generated text, the text itself): at position i,
    draft j is accepted when drafts 0..j-1 were and it equals the target's token after
    s[i+1+j]. Counted at positions with all k tokens to check (in the answers only unless
    `answers_only` is false). Returns the mean accepted length (+1: the bonus token), the
    per-position rates (the share of steps accepting draft j) and the positions counted."""
    chain = make_chain(drafter, k)
    accepted = []
    for j in range(len(examples)):
        drafts = np.asarray(chain(jnp.asarray(examples.taps[j]),
                                  jnp.asarray(examples.input_ids[j])))  # [k, T]
        valid = examples.valid[j]
        n = int(valid.sum())
        lo = int(examples.answer_start[j]) if answers_only else 0
        for i in range(lo, n - k + 1):
            hits = drafts[:, i] == examples.labels[j, i:i + k]
            accepted.append(int(np.cumprod(hits).sum()))
    acc = np.asarray(accepted)
    if not len(acc):
        return {"mean_acceptance_length": None, "per_position_acceptance": [], "positions": 0}
    return {"mean_acceptance_length": round(float(acc.mean()) + 1, 4),
            "mean_accepted_drafts": round(float(acc.mean()), 4),
            "per_position_acceptance": [round(float((acc > j).mean()), 4) for j in range(k)],
            "positions": int(len(acc))}


# ---------------------------------------------------------------------------- the run
def cpu_name() -> str:
    """The CPU as results_log names it (the record's header repeats it with its details)."""
    sys.path.insert(0, str(HERE))
    from results_log import host

    return host()["cpu"]


def run(recipe: Recipe, out: pathlib.Path, model: str | None, results: pathlib.Path | None,
        log=print) -> dict:
    from jaxserve import LLM
    from jaxserve.models.eagle3 import default_aux_layer_ids
    from jaxserve.models.eagle3_checkpoint import load_eagle3
    from jaxserve.models.loader import resolve_model

    t0 = time.perf_counter()
    model_dir = resolve_model(model)
    target_hf = json.loads((model_dir / "config.json").read_text())
    taps = default_aux_layer_ids(int(target_hf["num_hidden_layers"]))
    longest = max(recipe.max_tokens, recipe.eval_tokens) + 96  # prompt + answer
    length = 1 << (longest - 1).bit_length()  # a power of two

    llm = LLM(str(model_dir), max_model_len=length + 16, seed=recipe.seed)
    train_seqs = generate(llm, cycled(INSTRUCTIONS, recipe.sequences),
                          max_tokens=recipe.max_tokens, temperature=recipe.temperature,
                          seed=recipe.seed)
    eval_seqs = generate(llm, HELD_OUT[: recipe.eval_prompts], max_tokens=recipe.eval_tokens,
                         temperature=0.0, seed=recipe.seed)
    del llm
    generate_s = time.perf_counter() - t0
    log(f"generated {len(train_seqs)} + {len(eval_seqs)} sequences in {generate_s:.0f} s")

    t1 = time.perf_counter()
    target = TargetTaps(model_dir, taps)
    examples = build_examples(train_seqs, target, length - 1)
    held_out = build_examples(eval_seqs, target, length - 1)
    taps_s = time.perf_counter() - t1
    log(f"target taps of {int(examples.valid.sum())} + {int(held_out.valid.sum())} positions "
        f"in {taps_s:.0f} s")

    d2t, t2d = draft_vocabulary(examples, int(target_hf["vocab_size"]), recipe.draft_vocab)
    hf_config = drafter_hf_config(target_hf, recipe.draft_vocab, taps, recipe.k)
    drafter = new_drafter(hf_config, target.embedding_table(), d2t, t2d, recipe.seed)
    del target
    coverage = float(t2d[examples.labels[examples.valid]].mean())
    held_coverage = float(t2d[held_out.labels[held_out.valid]].mean())
    before = acceptance(drafter, held_out, recipe.k)

    t2 = time.perf_counter()
    curve = train(drafter, examples, recipe, log=log)
    train_s = time.perf_counter() - t2

    save_drafter(drafter, hf_config, out)
    loaded = load_eagle3(out, target=model_dir)
    after = acceptance(loaded, held_out, recipe.k)
    on_train = acceptance(loaded, examples, recipe.k)
    total_s = time.perf_counter() - t0
    tail = curve[-20:]
    record = {
        "benchmark": "train_eagle3",
        "cpu": cpu_name(),
        "model": model or "default (SmolLM2-135M-Instruct, bundled GGUF)",
        "recipe": dataclasses.asdict(recipe),
        "taps": list(taps),
        "train_positions": int(examples.valid.sum()),
        "held_out_positions": int(held_out.valid.sum()),
        "draft_vocab_coverage": {"train": round(coverage, 4), "held_out": round(held_coverage, 4)},
        "wall_s": {"generate": round(generate_s, 1), "target_taps": round(taps_s, 1),
                   "train": round(train_s, 1), "total": round(total_s, 1)},
        "first_loss": round(curve[0]["loss"], 4),
        "final_loss": round(float(np.mean([c["loss"] for c in tail])), 4),
        "final_step_losses": [round(float(np.mean([c["step_losses"][j] for c in tail])), 4)
                              for j in range(recipe.ttt_steps)],
        "acceptance_held_out": after,
        "acceptance_held_out_untrained": before,
        "acceptance_train_text": on_train,
        "loaded_with_load_eagle3": True,
    }
    log(json.dumps(record, indent=1))
    if results is not None:
        sys.path.insert(0, str(HERE))
        from results_log import append_results

        results.mkdir(parents=True, exist_ok=True)
        append_results(results / "results.jsonl", [record])
        (results / "loss_curve.json").write_text(json.dumps(
            {"recipe": dataclasses.asdict(recipe), "curve": curve}) + "\n")
        (results / "loss_curve.md").write_text(curve_markdown(record, curve))
    return record


def curve_markdown(record: dict, curve: list[dict], rows: int = 16) -> str:
    """The run as markdown: its recipe, the loss curve (means over windows of steps) and its
    acceptance."""
    recipe, acc = record["recipe"], record["acceptance_held_out"]
    cpu = record.get("cpu") or record.get("host", {}).get("cpu", "this CPU")
    every = max(1, -(-len(curve) // rows))
    lines = ["# EAGLE-3 head for the default model: recipe and loss curve", "",
             "Written by `benchmarks/train_eagle3.py`; the run's JSON line is in results.jsonl, "
             "every step's loss in loss_curve.json.", "",
             "| " + " | ".join(recipe) + " |", "|" + " --- |" * len(recipe),
             "| " + " | ".join(str(v) for v in recipe.values()) + " |", "",
             f"Taps {record['taps']}; {record['train_positions']} training positions; "
             f"wall time {record['wall_s']['total']:.0f} s "
             f"(training {record['wall_s']['train']:.0f} s) on {cpu}.",
             "", "| steps | loss (sum of the TTT steps) | step 0 | step 1 | step 2 |",
             "| --- | --- | --- | --- | --- |"]
    for lo in range(0, len(curve), every):
        win = curve[lo:lo + every]
        per = np.mean([c["step_losses"] for c in win], axis=0)
        lines.append(f"| {lo}-{lo + len(win) - 1} | {np.mean([c['loss'] for c in win]):.3f} | "
                     + " | ".join(f"{x:.3f}" for x in per[:3]) + " |")
    lines += ["", f"Held-out acceptance (k = {recipe['k']}, greedy): mean acceptance length "
              f"{acc['mean_acceptance_length']} (accepted drafts + 1), per-position rates "
              f"{acc['per_position_acceptance']}, over {acc['positions']} positions; untrained: "
              f"{record['acceptance_held_out_untrained']['mean_acceptance_length']}.", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Recipe()
    p.add_argument("--out", required=True, type=pathlib.Path, help="the drafter directory")
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--sequences", type=int, default=d.sequences)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--results", type=pathlib.Path, default=RESULTS,
                   help="where the JSON line and loss curve go ('-': nowhere)")
    a = p.parse_args(argv)
    recipe = dataclasses.replace(d, sequences=a.sequences, max_tokens=a.max_tokens, steps=a.steps,
                                 batch=a.batch, draft_vocab=a.draft_vocab, lr=a.lr, seed=a.seed,
                                 eval_prompts=a.eval_prompts)
    run(recipe, a.out, a.model, None if str(a.results) == "-" else a.results)


if __name__ == "__main__":
    main()
