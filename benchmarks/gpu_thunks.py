"""What the host launches for one compiled GPU step: XLA's thunk sequence, read.

XLA:GPU turns the optimized HLO into a sequence of thunks (kernel launches, copies, library
calls, conditionals, loops) and then wraps runs of command-buffer-compatible thunks into
command buffers (CUDA graphs, `--xla_gpu_enable_command_buffer`), each launched by the host as
one graph. Those command buffers exist only in the thunk sequence, not in the HLO, so the
launch count a step costs the host is read here from the file XLA dumps after its thunk passes
(`<module>.thunk_sequence_after_thunk_passes.txt`, written by `xla_dump_to`; without thunk
passes that changed anything only `<module>.thunk_sequence.txt` is written, read then).

The format, one thunk a line, nesting by indentation:

    000: kCommandBuffer [source | next=015 (1)]
        001: kCustomKernel [source | next=002 (1)] gemm_fusion_dot grid: [...] ...
    015: kCustomCall    [prev=000 (1) | next=000 (1)] kCustomCall
    061: kConditional   [prev=000 (1) | next=000 (1)]
      false_branch:
        054: kCustomKernel [source | sink] input_reduce_fusion grid: [...] ...
      true_branch:
        058: kCopy [source | sink] kCopy

A top-level thunk is one host-side launch (a command buffer is one graph launch, however many
kernels it holds). A kConditional makes the host read its predicate from the device before it
launches the chosen branch: a device-to-host synchronisation inside the step, and the branch's
thunks are launched one by one (unless they are command buffers themselves).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

_THUNK = re.compile(r"^(?P<indent> *)\d+: (?P<kind>k\w+)")
_BRANCH = re.compile(r"^(?P<indent> *)(?P<kind>\w*branch\w*|body|condition):\s*$")


@dataclasses.dataclass
class Thunk:
    kind: str
    line: str
    children: list[Thunk] = dataclasses.field(default_factory=list)


def parse(text: str) -> list[Thunk]:
    """The thunk tree of a dumped thunk sequence; a conditional's (or loop's) children are its
    branches (kind `branch`: true_branch, false_branch, branch_N, body, condition), theirs the
    branch's thunks."""
    roots: list[Thunk] = []
    stack: list[tuple[int, Thunk]] = []
    for line in text.splitlines():
        m = _THUNK.match(line)
        b = None if m else _BRANCH.match(line)
        if not (m or b):
            continue
        indent = len((m or b)["indent"])
        if b and b["kind"] == "condition":  # XLA prints a loop's `condition:` at column 0
            loops = [i for i, t in stack if t.kind == "kWhile"]
            indent = loops[-1] + 2 if loops else indent
        t = Thunk(m["kind"] if m else "branch", line.strip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        (stack[-1][1].children if stack else roots).append(t)
        stack.append((indent, t))
    return roots


def _count(thunks: list[Thunk], kinds: tuple[str, ...]) -> int:
    return sum((t.kind in kinds) + _count(t.children, kinds) for t in thunks)


def launches(thunks: list[Thunk], pick=min) -> int:
    """Host-side launches of a thunk list: one per thunk; for a conditional also those of the
    branch `pick` chooses by its launch count (min: the plain path, max: the heavy one); for a
    loop those of its condition and body once (a trip count is not in the dump)."""
    n = 0
    for t in thunks:
        n += 1
        branches = [b for b in t.children if b.kind == "branch"]
        if t.kind == "kConditional" and branches:
            n += pick(launches(b.children, pick) for b in branches)
        elif t.kind == "kWhile":
            n += sum(launches(b.children, pick) for b in branches)
    return n


def summarize(text: str) -> dict:
    """The host's view of one step: `host_launches` (top-level thunks, and those of the branch of
    each conditional with the fewest; `host_launches_heavy`: the most), `command_buffers` (top
    level: graph launches), `kernels_in_command_buffers`, `conditionals` (top level: a predicate
    read back each), `outside` (the top-level thunks that are not command buffers, by kind)."""
    roots = parse(text)
    outside: dict[str, int] = {}
    for t in roots:
        if t.kind != "kCommandBuffer":
            outside[t.kind] = outside.get(t.kind, 0) + 1
    buffers = [t for t in roots if t.kind == "kCommandBuffer"]
    return {
        "host_launches": launches(roots, min),
        "host_launches_heavy": launches(roots, max),
        "command_buffers": len(buffers),
        "kernels_in_command_buffers": _count(
            [c for b in buffers for c in b.children], ("kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul")
        ),
        "conditionals": outside.get("kConditional", 0),
        "outside": dict(sorted(outside.items())),
    }


def read_dump(dump_dir: str | pathlib.Path) -> dict | None:
    """`summarize` of the one module dumped in `dump_dir` (the thunk sequence after the thunk
    passes, else before them); None when XLA wrote neither (not a GPU compile)."""
    d = pathlib.Path(dump_dir)
    for pattern in ("*.thunk_sequence_after_thunk_passes.txt", "*.thunk_sequence.txt"):
        files = sorted(d.glob(pattern))
        if files:
            return summarize(files[-1].read_text())
    return None
