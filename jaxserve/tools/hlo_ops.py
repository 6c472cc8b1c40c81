"""What a compiled XLA program computes, read from its HLO text (`compiled.as_text()`): the
flops of its dot products, and the kernels it calls (custom calls: Pallas kernels, library
calls).

XLA's cost analysis gives flops and bytes for TPU programs, but returns nothing for GPU
programs compiled without a GPU; the dots are where a transformer step's flops are, so they
are counted here instead. A dot's flops are 2 x (elements of its result) x (product of the
left operand's contracting dimensions); dots inside fusions (XLA's Triton GEMM fusions) and
split-K rewrites count alike, and cuBLAS calls (`__cublas$gemm`) by their dimension numbers.
Custom calls (a Pallas kernel is one: `pallas_call`, or `mpmd_map` for Mosaic GPU's
`plgpu.kernel`) are named by the scope they were traced in, and are opaque: their work is not
in the count. Static counts, like `hlo_collectives.py`: a dot inside a loop body counts once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from jaxserve.tools.hlo_collectives import _ARRAY, _INSTR, _OP_NAME, take_shape

_DIMS = {k: re.compile(rf"{k}=\{{([\d,]*)\}}") for k in ("lhs_contracting_dims", "lhs_batch_dims")}
_OPERANDS = re.compile(r"^[\w\-]+\(([^)]*)\)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CUBLAS_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclasses.dataclass(frozen=True)
class Kernel:
    target: str  # custom_call_target: "__gpu$xla.gpu.triton", "tpu_custom_call", "mosaic_gpu_v2"
    name: str  # the Pallas kernel's name (its op_name scope before the call), or the op's


def parse(hlo_text: str) -> tuple[int, list[Kernel]]:
    """(dot flops, kernels called) of an HLO module's text."""
    shapes: dict[str, str] = {}
    lines = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        shape, rest = take_shape(line[m.end() :])
        shapes[m.group(1)] = shape
        lines.append((m.group(1), shape, rest, line))
    flops = 0
    kernels = []
    for name, shape, rest, line in lines:
        opcode = rest.split("(", 1)[0].strip()
        if opcode == "dot":
            ops = _OPERANDS.match(rest)
            lhs = ops.group(1).split(",")[0].strip().lstrip("%") if ops else ""
            contracting = _DIMS["lhs_contracting_dims"].search(line)
            lhs_dims = _dims(shapes.get(lhs, ""))
            k = (
                math.prod(lhs_dims[int(i)] for i in contracting.group(1).split(",") if i)
                if contracting
                else 1
            )
            flops += 2 * math.prod(_dims(shape)) * k
        elif opcode == "custom-call":
            target = _TARGET.search(line)
            target_name = target.group(1) if target else "?"
            if target_name.startswith("__cublas$") and "gemm" in target_name.lower():
                ops = _OPERANDS.match(rest)
                lhs = ops.group(1).split(",")[0].strip().lstrip("%") if ops else ""
                dims = _CUBLAS_DIMS.search(line)
                lhs_dims = _dims(shapes.get(lhs, ""))
                out = _dims(shape.strip("()").split(",")[0] if shape.startswith("(") else shape)
                idx = (
                    [int(json.loads(i)) for i in dims.group(1).split(",") if i.strip()]
                    if dims
                    else []
                )
                flops += 2 * math.prod(out) * math.prod(lhs_dims[i] for i in idx)
                continue
            op_name = _OP_NAME.search(line)
            scopes = op_name.group(1).split("/") if op_name else []
            call = next((x for x in ("pallas_call", "mpmd_map") if x in scopes[1:]), None)
            # Other custom calls (XLA's own, ragged-dot's) by their op name less its ".N"
            # instance suffix: one line a kind in a report, with its count.
            kernel = scopes[scopes.index(call) - 1] if call else re.sub(r"\.\d+$", "", name)
            kernels.append(Kernel(target_name, kernel))
    return flops, kernels


def kernel_counts(kernels: list[Kernel]) -> dict[str, int]:
    """{"<kernel name> (<target>)": calls}, for a report."""
    out: dict[str, int] = {}
    for k in kernels:
        key = f"{k.name} ({k.target})"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))
