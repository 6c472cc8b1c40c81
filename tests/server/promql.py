"""A small PromQL evaluator over two /metrics scrapes: enough for the expressions of vLLM's
example Grafana dashboard (selectors with label matchers and a range, rate, increase,
`sum by(...)`, histogram_quantile, `/`), with each selector's series checked for presence and
for a metric type the expression can use (rate and increase over counters and histogram
parts; a bare selector over a gauge; histogram_quantile over `_bucket` series).

A range selector's window is the interval between the two scrapes: rate = (after - before) /
seconds between them, increase = after - before."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]


@dataclass
class Scrape:
    time: float
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # sample name -> its family's type

    @classmethod
    def parse(cls, text: str, time: float) -> Scrape:
        s = cls(time)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                s.samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
                s.types[sample.name] = family.type
        return s


_TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<dur>\[[^\]]+\])'
                    r'|(?P<op>=~|!~|!=|[(){},=/])|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*))')
AGGREGATIONS = {"sum": sum, "max": max, "min": min}


def tokenize(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot tokenize {expr[pos:]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]]
    ranged: bool


class Evaluator:
    """evaluate(expr) -> the instant vector at the second scrape. `selectors` records every
    (metric name, how it was used) the expressions referenced."""

    def __init__(self, before: Scrape, after: Scrape, variables: dict[str, str]):
        self.before, self.after, self.variables = before, after, variables
        self.selectors: list[tuple[str, str]] = []
        self._quantile = False  # inside histogram_quantile's argument

    def evaluate(self, expr: str) -> Vector:
        for name, value in self.variables.items():
            expr = expr.replace(name, value)
        self.tokens, self.pos, self._quantile = tokenize(expr), 0, False
        vec = self._expr(context="instant")
        if self.pos != len(self.tokens):
            raise ValueError(f"unparsed tail: {self.tokens[self.pos:]}")
        return vec

    # ------------------------------------------------------------------ parsing + evaluation
    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.tokens[self.pos]
        if value is not None and tok[1] != value:
            raise ValueError(f"expected {value!r}, got {tok[1]!r}")
        self.pos += 1
        return tok

    def _expr(self, context: str) -> Vector:
        left = self._term(context)
        while self._peek() == ("op", "/"):
            self._take("/")
            right = self._term(context)
            left = {k: (v / right[k] if right[k] else math.nan) for k, v in left.items() if k in right}
        return left

    def _term(self, context: str) -> Vector | float:
        kind, value = self._peek()
        if kind == "num":
            self._take()
            return float(value)
        if kind != "name":
            raise ValueError(f"unexpected {value!r}")
        if value in AGGREGATIONS and self.tokens[self.pos + 1][1] in ("by", "("):
            return self._aggregate(context)
        if value in ("rate", "increase"):
            self._take()
            self._take("(")
            sel = self._selector("range")
            self._take(")")
            return self._range_function(value, sel)
        if value == "histogram_quantile":
            self._take()
            self._take("(")
            q = self._term(context)
            self._take(",")
            self._quantile = True
            vec = self._expr(context)
            self._quantile = False
            self._take(")")
            return histogram_quantile(q, vec)
        sel = self._selector(context)
        if sel.ranged:
            raise ValueError(f"a range vector outside rate/increase: {sel.name}")
        return {k: v for k, v in self._series(self.after, sel).items()}

    def _aggregate(self, context: str) -> Vector:
        fn = AGGREGATIONS[self._take()[1]]
        by: list[str] = []
        if self._peek() == ("name", "by"):
            self._take()
            self._take("(")
            while self._peek() != ("op", ")"):
                by.append(self._take()[1])
                if self._peek() == ("op", ","):
                    self._take()
            self._take(")")
        self._take("(")
        inner = self._expr(context)
        self._take(")")
        groups: dict[Labels, list[float]] = {}
        for labels, v in inner.items():
            key = frozenset((k, val) for k, val in labels if k in by)
            groups.setdefault(key, []).append(v)
        return {k: fn(vs) for k, vs in groups.items()}

    def _selector(self, context: str) -> Selector:
        name = self._take()[1]
        matchers = []
        if self._peek() == ("op", "{"):
            self._take("{")
            while self._peek() != ("op", "}"):
                label = self._take()[1]
                op = self._take()[1]
                text = self._take()[1][1:-1]
                matchers.append((label, op, text))
                if self._peek() == ("op", ","):
                    self._take()
            self._take("}")
        ranged = self._peek() is not None and self._peek()[0] == "dur"
        if ranged:
            self._take()
        self.selectors.append((name, context))
        return Selector(name, matchers, ranged)

    # ------------------------------------------------------------------ series
    def _series(self, scrape: Scrape, sel: Selector) -> Vector:
        """The selector's series (metric name dropped, as PromQL does after a function), after
        checking that the name exists with a type its use allows."""
        if sel.name not in scrape.samples:
            raise AssertionError(f"{sel.name} is not in /metrics")
        kind = scrape.types[sel.name]
        if sel.ranged:  # rate / increase need a counter or a histogram's cumulative parts
            ok = (kind == "counter" and sel.name.endswith("_total")) or (
                kind == "histogram" and sel.name.endswith(("_bucket", "_sum", "_count")))
        else:
            ok = kind == "gauge"
        if ok and self._quantile:
            ok = kind == "histogram" and sel.name.endswith("_bucket")
        if not ok:
            raise AssertionError(f"{sel.name} is a {kind}: not usable as {'a range' if sel.ranged else 'an instant'} "
                                 "vector here")
        out: Vector = {}
        for labels, value in scrape.samples[sel.name]:
            if all(_matches(labels.get(k, ""), op, text) for k, op, text in sel.matchers):
                out[frozenset(labels.items())] = value
        if not out:
            raise AssertionError(f"no {sel.name} series matches {sel.matchers}")
        return out

    def _range_function(self, fn: str, sel: Selector) -> Vector:
        before, after = self._series(self.before, sel), self._series(self.after, sel)
        seconds = self.after.time - self.before.time
        out = {}
        for labels, v in after.items():
            delta = v - before.get(labels, 0.0)
            out[labels] = delta / seconds if fn == "rate" else delta
        return out


def _matches(value: str, op: str, text: str) -> bool:
    if op == "=":
        return value == text
    if op == "!=":
        return value != text
    found = re.fullmatch(text, value) is not None
    return found if op == "=~" else not found


def histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus' histogram_quantile: per label set without `le`, linear interpolation inside
    the bucket where the rank falls (the highest finite bound when it falls in +Inf)."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, v in buckets.items():
        le = dict(labels).get("le")
        if le is None:
            raise AssertionError("histogram_quantile over series without an le label")
        groups.setdefault(frozenset(x for x in labels if x[0] != "le"), []).append((float(le), v))
    out = {}
    for key, bs in groups.items():
        bs.sort()
        total = bs[-1][1]
        if not math.isinf(bs[-1][0]) or total <= 0:
            out[key] = math.nan
            continue
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, count in bs:
            if count >= rank:
                if math.isinf(bound):
                    out[key] = lower
                else:
                    out[key] = lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0)
                break
            lower, below = bound, count
    return out
