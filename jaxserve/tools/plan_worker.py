"""The worker process of `jaxserve shard-plan`: one device set (a simulated CPU device count,
a compile-only TPU or GPU topology, or the real devices) per process, since JAX fixes its
devices when its backend starts. Reads a job (JSON) on stdin; writes one record per
configuration on stdout, each line prefixed with RECORD_PREFIX (libraries may print on stdout
too)."""

from __future__ import annotations

import json
import logging
import sys
import traceback

RECORD_PREFIX = "@@shard-plan@@ "


def target_devices(target: dict):
    """(devices, device kind, per-device memory or None) of a job's target."""
    import jax

    from jaxserve.tools.chips import CHIPS, HBM_BY_DEVICE_KIND, gpu_devices, tpu_devices

    if target["kind"] == "tpu":
        devices = tpu_devices(target)
        kind = devices[0].device_kind
        return devices, kind, HBM_BY_DEVICE_KIND.get(kind)
    if target["kind"] == "gpu":
        chip = CHIPS[target["chip"]]
        return gpu_devices(target), chip.device_kind, chip.hbm_bytes
    devices = jax.devices()
    kind = devices[0].device_kind
    if target["kind"] == "cpu":
        hosts = target.get("hosts", 1)
        return devices, f"{kind} (simulated{f', {hosts} processes' if hosts > 1 else ''})", None
    stats = devices[0].memory_stats() or {}
    return devices, kind, stats.get("bytes_limit")


def run_job(job: dict, emit) -> None:
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.tools.plan_compile import PlanSettings, does_not_fit_record, plan_one

    settings = PlanSettings(**job["settings"])
    devices, kind, memory = target_devices(job["target"])
    if settings.device_memory is None and memory is not None:
        settings = PlanSettings(**{**job["settings"], "device_memory": memory})
    for data, model in job["meshes"]:
        if data * model > len(devices):
            emit({"mesh": f"{data}x{model}", "error": f"needs {data * model} devices, the target has {len(devices)}"})
            continue
        mesh = make_mesh(data, model, devices=devices)
        for rules in job["rules"]:
            for bucket in job["buckets"]:
                base = {"mesh": f"{data}x{model}", "rules": rules, "bucket": list(bucket), "device_kind": kind,
                        "num_devices": data * model}
                try:
                    emit(plan_one(settings, mesh, rules, tuple(bucket), kind))
                except Exception as e:  # one configuration failing does not stop the others
                    verdict = does_not_fit_record(e, settings.device_memory)
                    logging.getLogger(__name__).debug("configuration failed", exc_info=True)
                    emit({**base, "memory": verdict, "error": None if verdict else f"{type(e).__name__}: {e}"[:2000],
                          "traceback": None if verdict else traceback.format_exc()[-4000:]})


def main() -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    job = json.loads(sys.stdin.read())
    if job.get("distributed"):  # one of several local processes forming one mesh (--hosts)
        import jax

        jax.distributed.initialize(**job["distributed"])
    logging.getLogger().setLevel(job.get("log_level", "WARNING").upper())
    out = sys.stdout

    def emit(record: dict) -> None:
        out.write(RECORD_PREFIX + json.dumps(record, default=str) + "\n")
        out.flush()

    run_job(job, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
