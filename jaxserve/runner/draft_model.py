"""A draft model (speculative_config method "draft_model") as the drafting step runs it: a whole
causal LM with the target's vocabulary (any architecture the engine serves), in the target's
dtype on the target's mesh. The step drafts with it as with a head (runner/draft_head_step.py,
`DraftModelHead`), over a paged KV cache of its own (all its layers, the target's pages). Where
the TPU kernel needs lane-dense pages it is served with zero KV heads appended as a target is
(`kv_heads`: `recipe.serving_draft_heads` decides, `ArchConfig.with_kv_heads` and the loader's
`pad_heads` apply)."""

from __future__ import annotations


def draft_model_config(path: str, kv_heads: int = 0):
    """The ArchConfig of the draft model in `path` (its KV pages, its abstract weights), served
    with `kv_heads` KV heads (0: its checkpoint's)."""
    from jaxserve.models.arch_config import ArchConfig
    from jaxserve.models.loader import load_checkpoint

    cfg = ArchConfig.from_hf(load_checkpoint(path).config)
    return cfg.with_kv_heads(kv_heads) if kv_heads else cfg


def abstract_draft_model(path: str, dtype, mesh, rules, attention_impl: str = "auto", kv_heads: int = 0):
    """The draft model in `path` as `load_draft_model` builds it, with abstract weights (the
    compile workers' and the memory probes')."""
    from jaxserve.models.weights import sharded_abstract_model

    return sharded_abstract_model(draft_model_config(path, kv_heads), dtype=dtype, mesh=mesh,
                                  attention_impl=attention_impl, rules=rules)


def load_draft_model(path: str, dtype, mesh, rules, attention_impl: str = "auto", kv_heads: int = 0):
    """The draft model in `path` with its weights, in the target's dtype, on the target's mesh
    (the model's own layers run it: no backend layout), served with `kv_heads` KV heads (0: its
    checkpoint's; the loader appends the zero heads' weights)."""
    from jaxserve.models.loader import load_checkpoint
    from jaxserve.models.weights import create_model

    ckpt = load_checkpoint(path)
    return create_model(draft_model_config(path, kv_heads), dtype=dtype, mesh=mesh, attention_impl=attention_impl,
                        get_tensor=ckpt.get_tensor, rules=rules)
