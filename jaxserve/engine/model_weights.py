"""The engine's weights at start: prepared from the checkpoint (read, converted, quantized where
the plan asks, placed, laid out by the backend), or read back as prepared, from a `jaxserve
compile --weights` directory or the weight cache."""

from __future__ import annotations

from jaxserve.backends import Backend
from jaxserve.backends.base import log_activation_products
from jaxserve.config import jax_dtype
from jaxserve.engine.plan import EnginePlan
from jaxserve.models.weights import create_model, sharded_abstract_model
from jaxserve.runner.compile import weight_cache
from jaxserve.runner.executable_cache import canonical
from jaxserve.runner.prebuilt import prebuilt_weights, weights_material
from jaxserve.startup_timer import StartupTimer


def prepared_model(plan: EnginePlan, ckpt, mesh, backend: Backend, timer: StartupTimer):
    """The model with its weights placed and laid out by the backend: from the directory
    `jaxserve compile --weights` wrote (`--executables DIR`) when they were prepared for this
    engine; else from the weight cache when the backend lays them out (packing for the CPU
    kernels) and they were kept; else from the checkpoint (then kept)."""
    mc, device = plan.config.model, plan.device
    rules = plan.rules
    ahead = plan.config.compile.executables
    if ahead is not None:
        with timer.phase("weights"):
            material = weights_material(ckpt, mesh.devices.flat, backend, dtype=device.dtype,
                                        quantization=mc.quantization, plan=device, rules=rules, arch=plan.arch)
            model = prebuilt_weights(ahead, material, _abstract_prepared(plan, mesh, backend))
        if model is not None:
            timer.note("weights", "prepared ahead, from the executables' directory")
            log_activation_products(model, device)
            return model
    cache = weight_cache(plan.config.compile) if backend.lays_out_weights(device) and mc.quantization is None else None
    if cache is not None:
        with timer.phase("weights"):
            key = cache.key(ckpt.path, ckpt.config, mesh.devices.flat, **backend.fingerprint(),
                            dtype=device.dtype, plan=canonical(device),
                            rules=canonical(rules), arch=canonical(plan.arch))
            model = cache.load(key, _abstract_prepared(plan, mesh, backend))
        if model is not None:
            timer.note("weights", "laid out, from the weight cache")
            log_activation_products(model, device)  # what prepare_model says when it lays them out
            return model
    model = prepare_weights(plan, ckpt, mesh, backend, timer)
    if cache is not None:
        with timer.phase("weight cache"):
            cache.store(key, model)
    return model


def _abstract_prepared(plan: EnginePlan, mesh, backend: Backend):
    """The model `prepare_weights` gives, without any work: ShapeDtypeStructs placed as its
    weights are, laid out as the backend lays them out."""
    mc, device = plan.config.model, plan.device
    abstract = sharded_abstract_model(plan.arch, dtype=jax_dtype(device.dtype), mesh=mesh,
                                      attention_impl=mc.attention_impl, rules=plan.rules, moe_impl=device.moe_impl,
                                      quantization=mc.quantization)
    backend.prepare_model(abstract, device, abstract=True)
    return abstract


def prepare_weights(plan: EnginePlan, ckpt, mesh, backend: Backend, timer: StartupTimer | None = None):
    """The start's work on the weights: `ckpt`'s tensors read, converted, quantized where the
    plan asks, placed on `mesh` (`create_model`), then laid out by the backend
    (`prepare_model`). `jaxserve compile --weights` does the same ahead."""
    timer = timer or StartupTimer()
    mc, device = plan.config.model, plan.device
    with timer.phase("weights"):
        model = create_model(plan.arch, dtype=jax_dtype(device.dtype), mesh=mesh, attention_impl=mc.attention_impl,
                             get_tensor=ckpt.get_tensor, quantization=mc.quantization, rules=plan.rules,
                             moe_impl=device.moe_impl)
    with timer.phase("packing"):
        backend.prepare_model(model, device)
    return model
