"""The step's anatomy, from the compiler: what one compiled decode or prefill step launches and
moves through HBM, part by part, for TPUs and GPUs compiled on this host without them.

    python benchmarks/step_anatomy.py --preset llama3-8b --layers 2 --context 2048 \
        --decode 1,8,64,256 --prefill 2048 --topology v6e:1x1,v6e:2x2,h100:1x1 \
        [--kv-cache-dtype auto|fp8] [--json benchmarks/results/step_anatomy.jsonl]

The step is the server's own (runner/recipe.py's `StepRecipe`, compiled through
`compile_pool.abstract_step` and `lower_bucket`, as `jaxserve shard-plan` builds it: abstract
weights, KV cache and sampling state laid over a 1xN tensor-parallel mesh with the "tp" rules).
A decode step of S sequences is the bucket (S, S); a prefill of P tokens is (P, 1). The KV
cache holds N x context tokens (plus the null page), the sampling state N slots (N:
--max-num-seqs, default max(decode sizes)), and max_model_len = context: one cache for every
step, as one server would have. TPU targets compile through libtpu's compile-only topologies
(one chip: the 1x1 topology), GPU targets through JAX's CUDA plugin with XLA's target
description of the chip (`jaxserve/tools/chips.py`); nothing runs, no time is measured.

What is read from the compiled step (`compiled.as_text()`, the optimized, scheduled HLO):

Kernels. The entry computation's instructions, except those that launch nothing (parameter,
constant, tuple, get-tuple-element, bitcast, the `-done` halves of async pairs, after-all,
partition-id, opt-barrier, the TPU's PrepareAsyncCall markers). A fusion is one kernel (on the
GPU a Triton GEMM fusion too), a custom call is one (Pallas kernels: `tpu_custom_call`,
Triton, Mosaic GPU; cuBLAS gemms), a bare op is one. `call` (GPU command buffers) and async
wrappers are opened; a `while` body is walked and multiplied by its known trip count; a
`while` whose bound is data-dependent (the reference attention's loop over the pages in use)
is given as many passes as make it read each cache's pages of the step once (the pages the page
table gives; an inner data-dependent loop runs once a pass; the passes are recorded in
`data_dependent_loops`: an estimate), a loop whose condition is `counter < N` N, else one; a
`conditional` is a choice: `plain` takes, at every conditional, the branch that moves the
fewest bytes (the sampler's plain path: no penalties, no masks, no logprobs), `heavy` the one
that moves the most (some row asks for penalties or logprobs). `kernels` and `bytes_moved` are
the plain path's; `*_heavy` the heavy path's; `kernels_static` counts a loop's body once.

Host launches (GPU targets: `gpu_host_launches`). XLA:GPU wraps runs of kernels into command
buffers (CUDA graphs) after the HLO, in its thunk sequence, so what the host launches a step is
read from the thunk sequence XLA dumps while compiling (gpu_thunks.py): command buffers (one
graph launch each), what stays outside them (custom calls that are not command-buffer
compatible, copies, kernels), and conditionals (each reads its predicate back to the host
before it launches a branch: a synchronisation inside the step).

Parts. Each kernel goes to one part, the first rule that matches:
  collectives  an all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute
               (or its async start) is the kernel, or is fused in it;
  kv_write     its source (the stack frames of its instructions, from the HLO's StackFrames
               table: the JAX source path) is pallas_kernels/kv_cache_update, or it writes a
               cache-sized buffer in place (a dynamic-update-slice or scatter into the cache);
  attention    its source is pallas_kernels/ragged_paged_attention or models/layers/attention.py,
               or it is a Pallas call named ragged_paged_attention*;
  sampler      its source is jaxserve/sampling/, or its op_name scope is sampler/sampler_logprobs;
  matmuls      it holds a dot or convolution, is a cuBLAS gemm or a Triton GEMM fusion, or its
               op_name is a dot_general (XLA writes a one-row product as a reduction; the LM
               head included);
  norms_rope   its source is models/layers/norm.py or rotary.py;
  other        the rest (the embedding's gather, the packed inputs' unpacking, ...).
A kernel's source is its own (the fusion's root's) stack; the union of its fused instructions'
decides only where its own says nothing. The rules are tried in that order; a Pallas kernel
that writes the new rows and attends (a name with "attend") is attention's. Then two
hand-overs: a copy XLA inserted (no op_name: copy insertion, a relayout) takes the part of the
kernel whose result it copies (a copy of a sampling-state argument: the sampler's), and an async
copy or slice into on-chip memory (a TPU's prefetch into VMEM) the part of the kernel that
consumes it.

bytes_moved. Per kernel, the bytes of its operands (each once) and of its outputs that live in
HBM (an array whose layout names memory space 1, `S(1)`, is in a TPU's VMEM and is not
counted; an async copy or slice writes its destination only), except what a kernel provably
touches only in part:
  - a fused parameter read only through gather / dynamic-slice / slice counts the bytes those
    produce (the embedding table: the T rows gathered; the reference attention: the pages it
    gathers), and a parameter that is only the in-place target of a dynamic-update-slice or
    scatter counts nothing read, its output the update's bytes written;
  - an operand of the KV cache's size given to a custom call (the Pallas attention kernel reads
    only the pages of its sequences) counts the pages the page table gives it: requests x
    ceil(context / page_size) pages (a prefill: its own ceil(P / page_size)), and none for a
    kernel variant of the other phase (the GPU's `..._prefill` attention kernel in a decode
    step has no rows: it is launched and reads no pages); a cache-sized
    output it aliases (output_to_operand_aliasing: the kernel writes in place) counts the T
    rows written.
`minimum` = the weights once (per device; the embedding table by its T gathered rows unless
the LM head reads it whole) + the KV read (requests x context tokens of K and V, every layer)
+ the KV write (T tokens) + the float32 logits of the rows that need them (R rows, the
vocabulary's share of one device). Bytes are per device.

cache_copies. Kernels whose output holds a cache-sized array (its elements a whole multiple of
one layer's K (or V) array on a device: the cache however laid out or padded) and that copy or
rewrite it: copy / copy-start / transpose, a convert, a
fusion or custom call producing it that is not an in-place update (dynamic-update-slice or
scatter root, or an aliased custom call), and any cache argument that the entry does not
alias to an output (the step would write a new cache). Each counts once per launch.

sampler_bytes: the sampler part's bytes; sampler_share = sampler_bytes / bytes_moved.

XLA's cost_analysis(): its flops and bytes accessed where it returns figures (TPU; for GPUs
compiled without one it returns None). `by_part[*]["us_at_hbm"]`: the part's bytes over the
chip's HBM bandwidth (chips.py), a lower bound on its time, predicted, not measured.

Compiled HLO is cached (by the lowered program's hash, the target and jax's version) under
$JAXSERVE_STEP_ANATOMY_CACHE (default ~/.cache/jaxserve/step_anatomy), so a rerun only lowers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "step_anatomy.jsonl"
sys.path.insert(0, str(HERE))
import gpu_thunks  # noqa: E402
from results_log import append_results  # noqa: E402

from jaxserve.tools.hlo_collectives import take_shape  # noqa: E402
CACHE = pathlib.Path(
    os.environ.get(
        "JAXSERVE_STEP_ANATOMY_CACHE", pathlib.Path.home() / ".cache" / "jaxserve" / "step_anatomy"
    )
)
PARTS = ("matmuls", "attention", "kv_write", "norms_rope", "sampler", "collectives", "other")

# ------------------------------------------------------------------------------ the HLO parser
_NO_KERNEL = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "copy-done",
    "async-done",
    "call-done",
    "all-reduce-done",
    "all-gather-done",
    "collective-permute-done",
    "send-done",
    "recv-done",
    "domain",
}
# custom calls that launch nothing: markers, and a TPU's concatenation of slices already side by
# side in on-chip memory
_MARKERS = ("PrepareAsyncCallStart", "PrepareAsyncCallDone", "AllocateBuffer", "ConcatBitcast")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_ALIASED_PARAMS = re.compile(r"\{[\d,\s]*\}:\s*\((\d+),")
_OUT_ALIAS = re.compile(r"output_to_operand_aliasing=\{([^}]*)\}")
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}


def _dtype_bytes(dtype: str) -> float:
    return 1 if dtype.startswith("f8") else _DTYPE_BYTES.get(dtype, 0)


def arrays(shape: str) -> list[tuple[int, int, bool]]:
    """(elements, bytes, on chip) of every array in an HLO shape string (a tuple's elements in
    order); on chip: its layout puts it in memory space 1 (a TPU's VMEM: `S(1)`), not HBM."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in dims.split(",") if d)
        out.append((n, int(n * _dtype_bytes(dtype)), "S(1)" in layout))
    return out


def shape_bytes(shape: str) -> int:
    return sum(b for _, b, _ in arrays(shape))


def hbm_bytes(shape: str) -> int:
    """The bytes of a shape's arrays that live in HBM."""
    return sum(b for _, b, vmem in arrays(shape) if not vmem)


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    line: str
    root: bool

    @property
    def target(self) -> str:
        m = _TARGET.search(self.line)
        return m.group(1) if m else ""

    @property
    def calls(self) -> list[str]:
        b = _BRANCHES.search(self.line)
        names = [x.strip().lstrip("%") for x in b.group(1).split(",")] if b else []
        return names + _CALLS.findall(self.line)


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    frames: dict[int, tuple[int, int]]  # stack frame -> (its file, its parent frame or 0)
    files: dict[int, str]
    aliased_params: set[int]  # entry parameters aliased to an output (donated and reused)

    def instr(self, comp: str) -> dict[str, Instr]:
        return {i.name: i for i in self.computations[comp]}

    def source(self, line: str) -> list[str]:
        """The files of an instruction's stack, innermost first."""
        m = _FRAME.search(line)
        out, seen = [], set()
        frame = int(m.group(1)) if m else 0
        while frame and frame not in seen and frame in self.frames:
            seen.add(frame)
            loc, parent = self.frames[frame]
            out.append(self.files.get(loc, ""))
            frame = parent
        return out


def parse_module(text: str) -> Module:
    """The computations of an optimized HLO module's text, with its stack-frame table."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    section, files, locations, frames = None, {}, {}, {}
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and re.match(r"^\d+ ", line):
            idx, rest = line.split(" ", 1)
            if section == "FileNames":
                files[int(idx)] = rest.strip('"')
            elif section == "FileLocations":
                locations[int(idx)] = int(re.search(r"file_name_id=(\d+)", rest).group(1))
            elif section == "StackFrames":
                loc = int(re.search(r"file_location_id=(\d+)", rest).group(1))
                parent = int(re.search(r"parent_frame_id=(\d+)", rest).group(1))
                # printed one above the parent's id (0: none)
                frames[int(idx)] = (loc, parent - 1)
            continue
        section = None
        m = _COMP.match(line)
        if m and "=" not in line.split("(", 1)[0]:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        shape, rest = take_shape(line[m.end() :])
        opcode = rest.split("(", 1)[0].strip()
        args = rest[len(opcode) :]
        depth, end = 0, len(args)
        for i, c in enumerate(args):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i:
                end = i
                break
        comps[current].append(
            Instr(
                m.group(2), shape, opcode, _OPERAND.findall(args[: end + 1]), line, bool(m.group(1))
            )
        )
    header = text.split("\n", 1)[0]
    alias = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout", header)
    aliased = {int(x) for x in _ALIASED_PARAMS.findall(alias.group(1))} if alias else set()
    frame_files = {k: (locations.get(loc, 0), parent) for k, (loc, parent) in frames.items()}
    return Module(comps, entry, frame_files, files, aliased)


@dataclasses.dataclass
class Kernel:
    name: str
    kind: str  # the opcode, or "custom-call:<target>"
    part: str
    bytes: int
    cache_copy: bool
    label: str  # a Pallas kernel's name, or the op_name's last scopes
    cache_reads: tuple[int, ...] = ()  # bytes it reads of each cache-sized operand


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """What the byte rules need of the step's KV cache (per device)."""

    elements: int  # one layer's K (or V) array
    pages: int
    pages_touched: int  # pages of the step's requests: requests x ceil(context / page_size)
    tokens: int  # rows the step writes (T)
    row_elements: int  # one token's elements in one layer's K (or V) array
    page_bytes: int = 0  # one page of one layer's K (or V) array
    phase: str = ""  # "decode" (every row a decode row) or "prefill" (every row a prompt's)

    def is_cache_sized(self, n: int) -> bool:
        """An array of n elements is one layer's K or V cache, however laid out (or a whole
        multiple of one: K and V together, a padded copy)."""
        return n >= self.elements and n % self.elements == 0


def _classify(
    own: list[str],
    files: list[str],
    op_names: list[str],
    opcodes: set[str],
    target: str,
    label: str,
    in_place: bool,
) -> str:
    """The part of a kernel: `own` the source files of the kernel itself (its root), `files` of
    everything fused in it, `op_names` its own op_name first (see the module docstring)."""
    own_src, all_src = " ".join(own), " ".join(files)
    scope = op_names[0] if op_names else ""
    if any(o.removesuffix("-start") in _COLLECTIVES for o in opcodes):
        return "collectives"
    if label.startswith("ragged_paged_attention") or "attend" in target:
        return "attention"  # a kernel that writes the new rows and attends is attention's
    if in_place or "kv_cache_update" in own_src:
        return "kv_write"
    if "ragged_paged_attention" in own_src or "layers/attention.py" in own_src:
        return "attention"
    if re.search(r"(^|/)sampler(_logprobs)?(/|$)", scope) or "/sampling/" in own_src:
        return "sampler"
    if opcodes & {"dot", "convolution"} or "gemm" in target.lower() or "dot_general" in scope:
        return "matmuls"  # a matrix-vector product XLA wrote as a reduction keeps its op_name
    if "layers/norm.py" in (own_src or all_src) or "layers/rotary.py" in (own_src or all_src):
        return "norms_rope"
    if (
        not own
        and "/sampling/" in all_src
        and not re.search(r"(^|/)(embed|lm_head|layer_\d+)(/|$)", scope)
    ):
        return "sampler"
    return "other"


def _innermost_project_files(module: Module, lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for f in module.source(line):
            if (
                "site-packages" not in f
                and ("/jaxserve/" in f or "/models/" in f or "/pallas_kernels/" in f)
                and not f.endswith(("step_fn.py", "compile_pool.py", "recipe.py"))
            ):
                out.append(f)
                break
    return out


def _fused_lines(module: Module, comp: str, seen: set[str] | None = None) -> list[Instr]:
    seen = set() if seen is None else seen
    if comp in seen or comp not in module.computations:
        return []
    seen.add(comp)
    out = []
    for i in module.computations[comp]:
        out.append(i)
        for c in i.calls:
            out += _fused_lines(module, c, seen)
    return out


def _through_bitcasts(instrs: dict[str, Instr], name: str) -> Instr:
    i = instrs[name]
    while i.opcode in ("bitcast", "reshape", "copy") and i.operands and i.operands[0] in instrs:
        i = instrs[i.operands[0]]
    return i


def _users(comp: list[Instr]) -> dict[str, list[tuple[Instr, int]]]:
    users: dict[str, list[tuple[Instr, int]]] = {}
    for i in comp:
        for k, o in enumerate(i.operands):
            users.setdefault(o, []).append((i, k))
    return users


def _params(comp: list[Instr]) -> list[Instr]:
    return sorted(
        (x for x in comp if x.opcode == "parameter"),
        key=lambda x: int(re.search(r"parameter\((\d+)\)", x.line).group(1)),
    )


def _read_bytes(module: Module, comp: list[Instr], param: Instr) -> int:
    """Bytes a fused computation reads of one parameter (see the module docstring); a nested
    fusion is followed into."""
    users = _users(comp)
    total, todo = 0, [param]
    while todo:
        p = todo.pop()
        if p is not param and not users.get(p.name):
            return shape_bytes(param.shape)  # it leaves the computation: read whole
        for u, k in users.get(p.name, []):
            if u.opcode in ("bitcast", "reshape"):
                todo.append(u)
            elif u.opcode == "fusion" and u.calls and u.calls[0] in module.computations:
                nested = module.computations[u.calls[0]]
                if all(x.opcode in ("parameter", "bitcast", "reshape") for x in nested):
                    todo.append(u)  # a fusion of bitcasts: its user reads
                else:
                    total += _read_bytes(module, nested, _params(nested)[k])
            elif u.opcode in ("gather", "dynamic-slice", "slice") and k == 0:
                total += shape_bytes(u.shape)
            elif u.opcode in ("dynamic-update-slice", "scatter") and k == 0:
                continue  # the in-place target
            else:
                return shape_bytes(param.shape)
    return total


def _written_bytes(module: Module, comp: list[Instr]) -> tuple[int, bool]:
    """(bytes a fused computation's outputs write, whether an output is updated in place) of
    its root: an in-place update writes its update only; a nested fusion is followed into."""
    instrs = {i.name: i for i in comp}
    root = next(i for i in comp if i.root)
    outs = [instrs[o] for o in root.operands] if root.opcode == "tuple" else [root]
    total, in_place = 0, False
    for o in outs:
        src = _through_bitcasts(instrs, o.name) if o.opcode != "tuple" else o
        if src.opcode == "dynamic-update-slice" and len(src.operands) > 1:
            total += shape_bytes(instrs[src.operands[1]].shape) if src.operands[1] in instrs else 0
            in_place = True
        elif src.opcode == "scatter" and len(src.operands) > 2:
            upd = src.operands[
                len(src.operands) // 2 + 1 :
            ]  # scatter(operands..., indices, updates...)
            total += sum(shape_bytes(instrs[u].shape) for u in upd if u in instrs)
            in_place = True
        elif src.opcode == "fusion" and src.calls and src.calls[0] in module.computations:
            nested, nested_in_place = _written_bytes(module, module.computations[src.calls[0]])
            total += nested
            in_place |= nested_in_place
        else:
            total += shape_bytes(o.shape)
    return total, in_place


def _other_phases_kernel(label: str, phase: str) -> bool:
    """A kernel variant for the other phase's rows (the GPU attention's `..._prefill` kernel in
    a decode step, `..._decode` in a prefill): launched, but it has no rows to read pages for."""
    other = {"decode": "prefill", "prefill": "decode"}.get(phase)
    return bool(other) and label.endswith("_" + other)


def _outputs(i: Instr) -> list[tuple[int, int, bool]]:
    """The arrays an instruction writes: an async copy's or slice's destination only (its
    tuple also names the source and a context)."""
    outs = arrays(i.shape)
    if i.opcode == "copy-start":
        return outs[:1]  # (destination, source, context)
    if i.opcode.endswith("-start") and i.shape.startswith("((") and len(outs) > 2:
        return outs[-2:-1]  # ((operands...), result, context): slices, async calls
    return outs


def _kernel(module: Module, comp: dict[str, Instr], i: Instr, geo: CacheGeometry) -> Kernel | None:
    if (
        i.opcode in _NO_KERNEL
        or i.opcode.endswith("-done")
        or (i.opcode == "custom-call" and i.target in _MARKERS)
    ):
        return None
    cache_sized = any(geo.is_cache_sized(n) for n, _, _ in _outputs(i))
    if i.opcode in ("fusion", "call-start", "async-start") and i.calls:
        body_name = i.calls[0]
        body = module.computations.get(body_name, [])
        lines = _fused_lines(module, body_name)
        own_lines = [i.line] + [x.line for x in body if x.root]
        params = _params(body)
        cache_reads: list[int] = []
        read = 0
        for k, p in enumerate(params):
            if k < len(i.operands) and i.operands[k] in i.operands[:k]:
                continue  # one operand passed twice is read once
            outer = comp.get(i.operands[k]) if k < len(i.operands) else None
            if outer is not None and shape_bytes(outer.shape) and not hbm_bytes(outer.shape):
                continue  # read from on-chip memory
            r = _read_bytes(module, body, p)
            read += r
            if outer is not None and geo.is_cache_sized(sum(n for n, _, _ in arrays(outer.shape))):
                cache_reads.append(r)
        written, in_place = _written_bytes(module, body) if body else (shape_bytes(i.shape), False)
        outs = _outputs(i)
        if sum(b for _, b, _ in outs):
            written = int(
                written * sum(b for _, b, vmem in outs if not vmem) / sum(b for _, b, _ in outs)
            )
        opcodes = {x.opcode for x in lines}
        copies = cache_sized and not in_place
    else:
        lines = [i]
        cache_reads = []
        own_lines = [i.line]
        opcodes = {i.opcode}
        base = i.opcode.removesuffix("-start")
        operands = list(dict.fromkeys(i.operands))
        read = 0
        aliased_out = set()
        if i.opcode == "custom-call":
            m = _OUT_ALIAS.search(i.line)
            if m:
                aliased_out = {int(x) for x in re.findall(r"\{(\d*)\}:\s*\(\d+", m.group(1)) if x}
        for o in operands:
            src = comp.get(o)
            if src is None:
                continue
            a = arrays(src.shape)
            if a and all(vmem for _, _, vmem in a):
                continue  # read from on-chip memory
            if i.opcode == "custom-call" and geo.is_cache_sized(sum(n for n, _, _ in a)):
                per_page = sum(b for _, b, _ in a) / geo.pages
                if not _other_phases_kernel(_label(i, []), geo.phase):
                    read += int(per_page * min(geo.pages, geo.pages_touched))
            elif i.opcode in ("dynamic-update-slice", "scatter") and o == i.operands[0]:
                continue
            elif base in ("gather", "dynamic-slice", "slice") and o == i.operands[0]:
                read += sum(b for _, b, _ in _outputs(i))
            else:
                read += hbm_bytes(src.shape)
        written = 0
        in_place = False
        for k, (n, b, vmem) in enumerate(_outputs(i)):
            if vmem:
                continue
            if geo.is_cache_sized(n) and (
                k in aliased_out
                or (
                    not aliased_out
                    and i.opcode == "custom-call"
                    and "output_to_operand_aliasing" in i.line
                )
            ):
                written += int(b / n * geo.row_elements * geo.tokens)  # the T rows, in place
                in_place = True
            elif i.opcode in ("dynamic-update-slice", "scatter") and k == 0:  # in place
                upd = i.operands[1:2] if i.opcode == "dynamic-update-slice" else i.operands[2:]
                written += sum(shape_bytes(comp[u].shape) for u in upd if u in comp)
                in_place = True
            else:
                written += b
        copies = cache_sized and not in_place
    names = [m.group(1) for m in map(_OP_NAME.search, own_lines + [x.line for x in lines]) if m]
    target = i.target if i.opcode == "custom-call" else ""
    label = _label(i, names)
    part = _classify(
        _innermost_project_files(module, own_lines),
        _innermost_project_files(module, [x.line for x in lines]),
        names,
        opcodes,
        target + (" gemm" if "__triton_gemm" in i.line else ""),
        label,
        in_place and cache_sized,
    )
    kind = f"custom-call:{target}" if target else i.opcode
    return Kernel(i.name, kind, part, int(read + written), bool(copies), label, tuple(cache_reads))


def _label(i: Instr, op_names: list[str]) -> str:
    m = _OP_NAME.search(i.line)
    scopes = (m.group(1) if m else (op_names[0] if op_names else "")).split("/")
    call = next((x for x in ("pallas_call", "mpmd_map") if x in scopes[1:]), None)
    if call:
        return scopes[scopes.index(call) - 1]
    return "/".join(s for s in scopes if not s.startswith("jit("))[-80:]


@dataclasses.dataclass
class Path:
    kernels: list[Kernel]

    @property
    def bytes(self) -> int:
        return sum(k.bytes for k in self.kernels)


DYNAMIC_LOOPS: list[int] = []  # the passes given to data-dependent loop nests (for the record)


def walk(
    module: Module, comp_name: str, geo: CacheGeometry, in_dynamic_loop: bool = False
) -> tuple[Path, Path]:
    """(plain path, heavy path) of a computation's kernels (see the module docstring)."""
    comp = module.instr(comp_name)
    plain, heavy = Path([]), Path([])
    made: dict[str, Kernel] = {}
    for i in module.computations[comp_name]:
        if i.opcode == "while":
            body = next((c for c in _CALLS.finditer(i.line) if c.group(0).startswith("body")), None)
            trip = _TRIP.search(i.line)
            n = int(trip.group(1)) if trip else _trip_from_condition(module, i)
            if body:
                dynamic = not trip and n == 1
                p, h = walk(module, body.group(1), geo, in_dynamic_loop or dynamic)
                reads = [r for k in p.kernels for r in k.cache_reads if r]
                if dynamic and reads and not in_dynamic_loop:
                    # a loop nest over the pages in use (its bound is data-dependent): as many
                    # passes as make it read each cache's pages of the step once
                    n = max(
                        1, math.ceil(geo.pages_touched * geo.page_bytes / (sum(reads) / len(reads)))
                    )
                    DYNAMIC_LOOPS.append(n)
                plain.kernels += p.kernels * n
                heavy.kernels += h.kernels * n
            continue
        if i.opcode == "conditional":
            paths = [
                walk(module, c, geo, in_dynamic_loop) for c in i.calls if c in module.computations
            ]
            if paths:
                plain.kernels += min((p for p, _ in paths), key=lambda p: p.bytes).kernels
                heavy.kernels += max((h for _, h in paths), key=lambda h: h.bytes).kernels
            continue
        if i.opcode == "call" and i.calls:
            p, h = walk(module, i.calls[0], geo, in_dynamic_loop)
            plain.kernels += p.kernels
            heavy.kernels += h.kernels
            continue
        k = _kernel(module, comp, i, geo)
        if k is not None:
            plain.kernels.append(k)
            heavy.kernels.append(k)
            made[i.name] = k
    _prefetches_take_their_consumers_part(module.computations[comp_name], made)
    return plain, heavy


def _trip_from_condition(module: Module, loop: Instr) -> int:
    """A while loop's trip count where XLA did not annotate one: its condition compares the
    counter with a constant (LT N from 0: N); else 1."""
    m = re.search(r"condition=%?([\w.\-]+)", loop.line)
    cond = module.computations.get(m.group(1), []) if m else []
    consts = {
        x.name: int(c.group(1))
        for x in cond
        if x.opcode == "constant"
        for c in [re.search(r"constant\((-?\d+)\)", x.line)]
        if c
    }
    for x in cond:
        if x.opcode == "compare" and "direction=LT" in x.line:
            bound = [consts[o] for o in x.operands if o in consts]
            if bound and bound[0] > 0:
                return bound[0]
    return 1


def _prefetches_take_their_consumers_part(instrs: list[Instr], made: dict[str, Kernel]) -> None:
    """A copy XLA inserted (it has no op_name: copy insertion, a relayout) joins the part of the
    kernel whose result it copies (a sampling-state argument's copy: the sampler's). An async
    copy or slice into on-chip memory (a TPU's prefetch of a weight or of cache
    pages) is read for the kernel that takes its result: it joins that kernel's part."""
    users: dict[str, list[str]] = {}
    for i in instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i.name)
    by_name = {i.name: i for i in instrs}
    for name, k in made.items():  # copies XLA inserted (no op_name of their own)
        i = by_name[name]
        if (
            k.kind not in ("copy", "copy-start")
            or k.part != "other"
            or _OP_NAME.search(i.line)
            or not i.operands
        ):
            continue
        src = by_name.get(i.operands[0])
        while (
            src is not None
            and src.opcode in ("bitcast", "get-tuple-element", "copy-done")
            and src.operands
        ):
            if src.name in made:
                break
            src = by_name.get(src.operands[0])
        if src is None:
            continue
        if src.name in made:
            k.part = made[src.name].part
        elif src.opcode == "parameter" and src.name.startswith("sstate_"):
            k.part = "sampler"  # the sampling state's argument
    for name, k in made.items():
        if k.kind not in ("copy-start", "slice-start", "dynamic-slice-start") or k.part != "other":
            continue
        todo, seen = list(users.get(name, [])), set()
        while todo:
            u = todo.pop(0)
            if u in seen:
                continue
            seen.add(u)
            if u in made and made[u].kind not in (
                "copy-start",
                "slice-start",
                "dynamic-slice-start",
            ):
                k.part = made[u].part
                break
            if u in by_name and (
                by_name[u].opcode in ("bitcast", "get-tuple-element", "tuple")
                or by_name[u].opcode.endswith("-done")
                or by_name[u].target in _MARKERS
            ):
                todo += users.get(u, [])


def anatomy(text: str, geo: CacheGeometry, cache_params: list[int]) -> dict:
    """The step's kernels, bytes by part and cache copies, read from its optimized HLO text."""
    module = parse_module(text)
    DYNAMIC_LOOPS.clear()
    plain, heavy = walk(module, module.entry, geo)
    out_loops = list(DYNAMIC_LOOPS)
    unaliased = [p for p in cache_params if p not in module.aliased_params]
    out: dict = {}
    for tag, path in (("", plain), ("_heavy", heavy)):
        by_part = {p: {"kernels": 0, "bytes": 0} for p in PARTS}
        for k in path.kernels:
            by_part[k.part]["kernels"] += 1
            by_part[k.part]["bytes"] += k.bytes
        total = path.bytes
        out[f"kernels{tag}"] = len(path.kernels)
        out[f"kernels_static{tag}"] = len({id(k) for k in path.kernels})  # a loop's body once
        out[f"bytes_moved{tag}"] = total
        out[f"by_part{tag}"] = by_part
        out[f"sampler_bytes{tag}"] = by_part["sampler"]["bytes"]
        out[f"sampler_share{tag}"] = (
            round(by_part["sampler"]["bytes"] / total, 4) if total else None
        )
    copies = [k for k in heavy.kernels if k.cache_copy]
    out["cache_copies"] = len(copies) + len(unaliased)
    out["cache_copy_bytes"] = sum(k.bytes for k in copies)
    out["data_dependent_loops"] = out_loops  # passes assumed for each (both paths walked)
    entry = module.computations[module.entry]
    params = {
        int(m.group(1)): x.shape
        for x in entry
        if x.opcode == "parameter"
        for m in [re.search(r"parameter\((\d+)\)", x.line)]
        if m
    }
    out["cache_layout"] = params.get(cache_params[0]) if cache_params else None
    out["cache_copy_ops"] = [f"{k.name} ({k.kind}, {k.part}, {k.label})" for k in copies][:20] + [
        f"cache argument {p} not aliased to an output" for p in unaliased
    ]
    out["kernel_labels"] = _top_kernels(plain.kernels)
    out["sampler_kernels_heavy"] = _top_kernels(
        [k for k in heavy.kernels if k.part == "sampler"], 24
    )
    return out


def _top_kernels(kernels: list[Kernel], n: int = 12) -> list[str]:
    """The largest of `kernels` by bytes, for the record (the plain path's; the heavy path's
    sampler kernels: `sampler_kernels_heavy`)."""
    top = sorted(kernels, key=lambda k: -k.bytes)[:n]
    return [f"{k.part}: {k.kind} {k.label} {k.bytes}" for k in top]


# ------------------------------------------------------------------------------ compiling
def target_devices(target: str):
    """(devices, platform, chip name or "cpu") of a target: cpu, v6e:1x1, v6e:2x2, h100:1x1, ..."""
    import jax

    if target == "cpu":
        return jax.devices()[:1], "cpu", "cpu"
    from jaxserve.tools.chips import parse_target, target_chip_count

    t = parse_target(target)
    if t["kind"] == "tpu":
        from jax.experimental import topologies

        kwargs = {"chips_per_host_bounds": [1, 1, 1]} if target_chip_count(t) == 1 else {}
        desc = topologies.get_topology_desc(topology_name=t["topology"], platform="tpu", **kwargs)
        return list(desc.devices), "tpu", target.split(":")[0]
    from jaxserve.tools.chips import gpu_devices

    return gpu_devices(t), "gpu", t["chip"]


def _installed(package: str) -> str:
    """The installed version of `package` (the compilers' versions key the HLO cache)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _compiled_text(lowered, target: str) -> tuple[str, dict | None, float, bool, dict | None]:
    """(optimized HLO text, cost analysis, compile seconds, from the cache, the host's launches
    from XLA's thunk sequence: GPU only, see gpu_thunks.py) of a lowered step."""
    import jax

    compilers = " ".join(f"{n}={_installed(n)}" for n in ("jaxlib", "libtpu", "jax-cuda12-plugin"))
    key = hashlib.sha256((lowered.as_text() + target + jax.__version__ + compilers).encode()).hexdigest()[:24]
    path = CACHE / f"{key}.json"
    gpu = target.startswith(("h100", "h200"))
    if path.exists():
        rec = json.loads(path.read_text())
        if not gpu or "thunks" in rec:
            return rec["hlo"], rec["cost"], rec["compile_s"], True, rec.get("thunks")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump} if gpu else None
        compiled = lowered.compile(compiler_options=options)
        thunks = gpu_thunks.read_dump(dump) if gpu else None
    seconds = round(time.perf_counter() - t0, 2)
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    cost = (
        {
            k: float(v)
            for k, v in cost.items()
            if k in ("flops", "bytes accessed", "transcendentals")
        }
        if cost
        else None
    )
    text = compiled.as_text()
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"hlo": text, "cost": cost, "compile_s": seconds, "thunks": thunks}))
    tmp.replace(path)
    return text, cost, seconds, False, thunks


def step_records(
    arch: dict,
    target: str,
    *,
    context: int,
    decode: list[int],
    prefill: int,
    kv_cache_dtype: str = "auto",
    page_size: int = 16,
    kv_cache_memory: int | None = None,
    model_name: str = "",
    attention_impl: str = "auto",
    max_num_seqs: int | None = None,
    num_speculative_tokens: int = 0,
    draft_model: str = "",
    draft_method: str = "eagle3",
    tokens_per_seq: int = 1,
) -> list[dict]:
    """Compile one target's decode steps (S, S) for S in `decode` and a (prefill, 1) step; one
    record each. `max_num_seqs`: the server's sequences (sampling-state slots; default
    max(decode)); `kv_cache_memory`: the KV cache's bytes per device (default: max_num_seqs x
    context tokens). Speculative decoding: `num_speculative_tokens` drafts per request in the
    recipe, a drafter's directory `draft_model` ("": none) of `draft_method` ("eagle3" or
    "draft_model"), and `tokens_per_seq` query tokens (and sampling rows) per sequence of a decode
    step (k + 1 for a step verifying k drafts: the bucket (S (k + 1), S (k + 1)))."""
    import jax
    from jaxserve.models import sharding as ax
    from jaxserve.models.arch_config import ArchConfig

    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.compile_pool import abstract_step, lower_bucket
    from jaxserve.tools.chips import CHIPS
    from jaxserve.tools.plan_compile import PlanSettings, kv_record, plan_recipe, resolve_plan

    devices, plat, chip = target_devices(target)
    max_seqs = max_num_seqs or max(decode or [1])
    settings = PlanSettings(
        arch=arch,
        platform=plat,
        max_model_len=context,
        max_num_seqs=max_seqs,
        page_size=page_size,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=kv_cache_memory,
        attention_impl=attention_impl,
        num_speculative_tokens=num_speculative_tokens,
        draft_model=draft_model,
        draft_method=draft_method if draft_model else "",
    )
    cfg = ArchConfig.from_hf(arch)
    mesh = make_mesh(1, len(devices), devices=devices)
    rules = ax.serving_rules(ax.load_rules("tp"), 1)
    plan = resolve_plan(settings, cfg, mesh, rules)
    if plan["kv_heads"]:  # zero KV heads appended for lane-dense TPU pages
        cfg = cfg.with_kv_heads(plan["kv_heads"])
    _kv, num_pages, _pages_per_req = kv_record(settings, cfg, mesh, rules, plan["kv_dtype"], plan["dtype"],
                                               draft_kv_heads=plan["draft_kv_heads"])
    recipe = plan_recipe(settings, cfg, mesh, rules, plan, num_pages)
    abstract = abstract_step(recipe, devices=devices)
    k0 = getattr(abstract.kv, "target", abstract.kv).k[0]  # the target's (a drafter's KV follows it)
    local_shape = k0.sharding.shard_shape(k0.shape)
    elements = math.prod(local_shape)
    row_bytes = math.prod(local_shape[2:]) * k0.dtype.itemsize  # one token of one layer's K
    weights = [p for p in abstract.params]
    local = [(p.sharding.shard_shape(p.shape), p.dtype.itemsize) for p in weights]
    weight_bytes = sum(math.prod(s) * b for s, b in local)
    embed_local = abstract.model.embed.get_value()  # [V, E] (sharded over the vocabulary)
    embed_shape = embed_local.sharding.shard_shape(embed_local.shape)
    embed_bytes = math.prod(embed_shape) * embed_local.dtype.itemsize
    tied = getattr(abstract.model, "lm_head", None) is None
    vocab_local = embed_shape[0]
    n_params = len(abstract.params)
    cache_params = list(range(n_params, n_params + 2 * cfg.num_layers))
    bw = CHIPS[chip].hbm_bandwidth if chip in CHIPS else None
    q = tokens_per_seq
    steps = [("decode", s, s * q, s * q) for s in decode] + (
        [("prefill", 1, prefill, 1)] if prefill else []
    )
    out = []
    for phase, seqs, T, R in steps:
        ctx = context if phase == "decode" else T
        geo = CacheGeometry(
            elements=elements,
            pages=local_shape[0],
            pages_touched=seqs * -(-ctx // page_size),
            tokens=T,
            row_elements=math.prod(local_shape[2:]),
            page_bytes=elements * k0.dtype.itemsize // local_shape[0],
            phase=phase,
        )
        t0 = time.perf_counter()
        # Pallas's TPU lowering asks the default device which chip it lowers for
        with jax.default_device(devices[0]) if plat == "tpu" else contextlib.nullcontext():
            lowered = lower_bucket(recipe, abstract, (T, R))
        lower_s = time.perf_counter() - t0
        text, cost, compile_s, cached, thunks = _compiled_text(lowered, target)
        rec = anatomy(text, geo, cache_params)
        weights_once = (
            weight_bytes
            - (0 if tied else embed_bytes)
            + (0 if tied else T * embed_shape[1] * embed_local.dtype.itemsize)
        )
        kv_read = 2 * cfg.num_layers * seqs * ctx * row_bytes if phase == "decode" else 0
        kv_write = 2 * cfg.num_layers * T * row_bytes
        logits = R * vocab_local * 4
        minimum = weights_once + kv_read + kv_write + logits
        for tag in ("", "_heavy"):
            for part in rec[f"by_part{tag}"].values():
                part["us_at_hbm"] = round(part["bytes"] / bw * 1e6, 2) if bw else None
        out.append(
            {
                "benchmark": "step_anatomy",
                "target": target,
                "phase": phase,
                "seqs": seqs,
                "context": ctx,
                "bucket": [T, R],
                "tokens_per_seq": q if phase == "decode" else None,
                "num_speculative_tokens": num_speculative_tokens,
                "draft_method": draft_method if draft_model else None,
                "layers": cfg.num_layers,
                "model": model_name,
                "head_dim": cfg.head_dim,
                "kv_cache_dtype": plan["kv_dtype"],
                "dtype": plan["dtype"],
                "attention_impl": plan["attention_impl"],
                "kv_heads_padded": plan["kv_heads_note"],
                "devices": len(devices),
                "page_size": page_size,
                "kv_pages": num_pages,
                "kernels": rec["kernels"],
                "kernels_heavy": rec["kernels_heavy"],
                "kernels_static": rec["kernels_static"],
                "kernels_static_heavy": rec["kernels_static_heavy"],
                "bytes_moved": rec["bytes_moved"],
                "bytes_moved_heavy": rec["bytes_moved_heavy"],
                "minimum": {
                    "total": minimum,
                    "weights_once": weights_once,
                    "kv_read": kv_read,
                    "kv_write": kv_write,
                    "logits": logits,
                },
                "bytes_over_minimum": round(rec["bytes_moved"] / minimum, 3),
                "cache_copies": rec["cache_copies"],
                "cache_copy_bytes": rec["cache_copy_bytes"],
                "cache_copy_ops": rec["cache_copy_ops"],
                "cache_layout": rec["cache_layout"],
                "data_dependent_loops": rec["data_dependent_loops"],
                "sampler_bytes": rec["sampler_bytes"],
                "sampler_share": rec["sampler_share"],
                "sampler_bytes_heavy": rec["sampler_bytes_heavy"],
                "sampler_share_heavy": rec["sampler_share_heavy"],
                "by_part": rec["by_part"],
                "by_part_heavy": rec["by_part_heavy"],
                "largest_kernels": rec["kernel_labels"],
                "sampler_kernels_heavy": rec["sampler_kernels_heavy"],
                "gpu_host_launches": thunks,
                "cache_bytes_per_layer": elements * k0.dtype.itemsize,
                "xla_cost_analysis": cost,
                "hbm_bandwidth": bw,
                "predicted_us_at_hbm": round(rec["bytes_moved"] / bw * 1e6, 1) if bw else None,
                "compile_s": compile_s,
                "compile_cached": cached,
                "lower_s": round(lower_s, 2),
            }
        )
        del lowered
        jax.clear_caches()
    return out


def load_arch(preset: str, layers: int | None) -> dict:
    from jaxserve.tools.shard_plan import model_config

    _, arch = model_config(preset)
    arch = dict(arch)
    if layers:
        arch["num_hidden_layers"] = layers
    return arch


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset",
        default="llama3-8b",
        help="an architecture preset of shard-plan, or a config.json",
    )
    p.add_argument(
        "--layers", type=int, default=2, help="cut the model to this many layers (0: all)"
    )
    p.add_argument(
        "--context", type=int, default=2048, help="the decode steps' context (and max_model_len)"
    )
    p.add_argument(
        "--decode", type=_ints, default=[1, 64], help="decode sizes (sequences), comma-separated"
    )
    p.add_argument(
        "--prefill", type=int, default=2048, help="prefill tokens (one request); 0: none"
    )
    p.add_argument(
        "--topology",
        default="v6e:1x1,h100:1x1",
        help="targets, comma-separated: v6e:1x1, v6e:2x2, h100:1x1, ... or cpu",
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model's), fp8, int8, bfloat16, ..."
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes per device (default: --max-num-seqs x context tokens)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the server's sequences: sampling-state slots and KV cache (default: max(decode))",
    )
    p.add_argument(
        "--attention-impl", default="auto", help="auto (what serve takes on the target), gpu, gpu-mosaic, ..."
    )
    p.add_argument("--json", default=str(RESULTS), help="append one JSON line per step here")
    a = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    arch = load_arch(a.preset, a.layers)
    pathlib.Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    for target in [t for t in a.topology.split(",") if t]:
        recs = step_records(
            arch,
            target,
            context=a.context,
            decode=a.decode,
            prefill=a.prefill,
            kv_cache_dtype=a.kv_cache_dtype,
            page_size=a.page_size,
            kv_cache_memory=a.kv_cache_memory,
            model_name=a.preset,
            attention_impl=a.attention_impl,
            max_num_seqs=a.max_num_seqs,
        )
        for rec in recs:
            rec = {**rec, "compile_only": True, "loadavg": [round(x, 2) for x in os.getloadavg()]}
            append_results(a.json, rec)
            print(
                f"{target:9s} {rec['phase']:7s} seqs={rec['seqs']:4d} {rec['kv_cache_dtype']:14s} "
                f"kernels {rec['kernels']:5d}  moved {rec['bytes_moved'] / 1e6:10.1f} MB "
                f"(x{rec['bytes_over_minimum']:.2f} of min {rec['minimum']['total'] / 1e6:.1f}) "
                f"copies {rec['cache_copies']}  sampler {100 * (rec['sampler_share'] or 0):.1f}% "
                f"(heavy {100 * (rec['sampler_share_heavy'] or 0):.1f}%)  compile {rec['compile_s']}s"
                f"{' cached' if rec['compile_cached'] else ''}",
                flush=True,
            )
            if rec["gpu_host_launches"]:
                print(f"{'':9s} host launches {json.dumps(rec['gpu_host_launches'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
