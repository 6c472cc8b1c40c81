"""The collectives of a compiled XLA program, read from its HLO text (`compiled.as_text()`).

Each collective instruction is counted once: an async pair (`all-reduce-start` /
`all-reduce-done`) counts as its start, and ops wrapped in `async-start` are counted where they
sit in their called computation. For each op: its kind, its bytes (the result: for an
all-gather the gathered output, for a reduce-scatter the scattered output, for an async start
the output half of its tuple), the size of its replica groups, and where it comes from: the
layer whose `jax.named_scope("layer_{i}")` it was traced under (the op's metadata), or "other".
The counts are static: an op inside a loop body or a conditional branch counts once.

Wire bytes per device estimate what a ring algorithm sends over n devices: all-reduce
2(n-1)/n x S, all-gather (n-1)/n x S_out, reduce-scatter (n-1) x S_out, all-to-all (n-1)/n x
S, collective-permute S.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
    "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
    "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "token": 0,
}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_LAYER = re.compile(r"(?:^|/)layer_(\d+)(?:/|$)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    is_async: bool  # an async start (its done is not counted)
    bytes: int  # result bytes (see the module docstring)
    group_size: int  # devices per replica group (collective-permute: 2)
    layer: int | None  # the layer_{i} scope it came from, else None
    name: str

    @property
    def wire_bytes(self) -> float:
        n, s = self.group_size, self.bytes
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * s
        if self.kind in ("all-gather", "all-to-all"):
            return (n - 1) / n * s
        if self.kind == "reduce-scatter":
            return (n - 1) * s
        return float(s)  # collective-permute


def _split_top(text: str) -> list[str]:
    """The top-level comma-separated elements of a tuple's inside."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [x.strip() for x in out if x.strip()]


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape string (a tuple's elements added up)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return int(total)


def take_shape(rest: str) -> tuple[str, str]:
    """Split 'SHAPE opcode(...)...' into (SHAPE, the rest)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
        return rest, ""
    j = rest.find(" ")
    return (rest, "") if j < 0 else (rest[:j], rest[j + 1 :].lstrip())


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\})", line)  # {{0,1,2,3},{4,5,6,7}}
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x.strip()])
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)  # iota form [groups,size]<=[...]
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh['a'=1,'b'=4] {'b'}
    if m:
        sizes = {k.strip(" '\""): int(v) for k, v in (p.split("=") for p in m.group(1).split(",") if "=" in p)}
        n = 1
        for axis in m.group(2).split(","):
            n *= sizes.get(axis.strip(" '\""), 1)
        return n
    return num_devices  # replica_groups={} (or absent): every device


def parse_collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective op of an HLO module's text (`compiled.as_text()`)."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        shape, rest = take_shape(line[m.end():])
        opcode = rest.split("(", 1)[0].strip()
        kind, is_async = opcode, False
        if opcode.endswith("-start"):
            kind, is_async = opcode[: -len("-start")], True
        if kind not in KINDS:
            continue
        if is_async and kind != "all-reduce" and shape.startswith("("):
            parts = _split_top(shape[1:-1])
            nbytes = shape_bytes(parts[1] if len(parts) > 1 else parts[0])
        else:
            nbytes = shape_bytes(shape)
        op_name = _OP_NAME.search(line)
        layer = _LAYER.search(op_name.group(1)) if op_name else None
        group = 2 if kind == "collective-permute" else _group_size(line, num_devices)
        out.append(Collective(kind, is_async, nbytes, group, int(layer.group(1)) if layer else None, m.group(1)))
    return out


@dataclasses.dataclass
class KindTotals:
    count: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    group_sizes: set[int] = dataclasses.field(default_factory=set)

    def add(self, c: Collective) -> None:
        self.count += 1
        self.bytes += c.bytes
        self.wire_bytes += c.wire_bytes
        self.group_sizes.add(c.group_size)

    def as_dict(self) -> dict:
        return {"count": self.count, "bytes": self.bytes, "wire_bytes": round(self.wire_bytes),
                "group_sizes": sorted(self.group_sizes)}


def summarize(collectives: Iterable[Collective], num_layers: int) -> dict:
    """Totals per kind (async starts under their own `<kind>-start` key), for the whole step,
    for one layer on average ("per_layer": the layer scopes' totals / num_layers), and for the
    ops outside every layer ("other")."""
    def key(c: Collective) -> str:
        return f"{c.kind}-start" if c.is_async else c.kind

    total: dict[str, KindTotals] = {}
    layers: dict[str, KindTotals] = {}
    other: dict[str, KindTotals] = {}
    for c in collectives:
        total.setdefault(key(c), KindTotals()).add(c)
        (layers if c.layer is not None else other).setdefault(key(c), KindTotals()).add(c)
    L = max(num_layers, 1)
    return {
        "total": {k: v.as_dict() for k, v in sorted(total.items())},
        "per_layer": {k: {"count": v.count / L, "bytes": v.bytes / L, "wire_bytes": round(v.wire_bytes / L)}
                      for k, v in sorted(layers.items())},
        "other": {k: v.as_dict() for k, v in sorted(other.items())},
        "count": sum(v.count for v in total.values()),
        "bytes": sum(v.bytes for v in total.values()),
        "wire_bytes": round(sum(v.wire_bytes for v in total.values())),
    }
