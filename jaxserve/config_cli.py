"""Command-line flags generated from configuration dataclasses.

A configuration field documents itself once, with an attribute docstring (the string literal
right below it, as vLLM's `EngineArgs` does), and says how the command line spells it only where
that differs from the field's name (`option(flag=..., aliases=...)`). This module turns those
fields into argparse arguments and parsed arguments back into keyword arguments:

    int, float, str        --name VALUE              (type from the annotation)
    bool                   --name / --no-name        (argparse.BooleanOptionalAction)
    Literal[...]           --name {a,b,c}            (choices; `choice_aliases` adds spellings)
    tuple[T, ...]          --name V [V ...]          (repeatable; integers may be comma-separated)
    a dataclass            --name JSON               (the dataclass's fields are its keys)
    X | None               as X; unset is None

A field that is not a flag says why (`option(not_a_flag="...")`). The argparse default of
every flag is None, so that only what the user gave reaches the configuration: every default is
the dataclass's, written once, and the help shows it.

This module knows no particular configuration and imports nothing from jaxserve, so the
configuration modules can use `option` and every command (serve, generate, shard-plan) can
build its flags here.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "add_arguments",
    "field_docs",
    "flag_fields",
    "flag_name",
    "flag_type",
    "non_negative",
    "option",
    "parse_bytes",
    "positive",
    "run_checks",
    "values_from_args",
]

# Field metadata keys.
FLAG = "flag"  # the flag's spelling where it differs from "--" + the field's name with dashes
ALIASES = "aliases"  # other spellings of the same flag (vLLM's names)
PARSE = "parse"  # text -> value, for a type the annotation does not say (byte sizes)
CHECK = "check"  # value -> None or ValueError: run on the parsed flag and on the dataclass's value
CHOICES = "choices"  # allowed values when the annotation cannot list them (a registry's names)
CHOICE_ALIASES = "choice_aliases"  # other spellings of choices, mapped to the canonical value
METAVAR = "metavar"
GROUP = "group"  # the help group of a field whose class has none of its own
NOT_A_FLAG = "not_a_flag"  # why this field has no flag


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    aliases: Sequence[str] = (),
    parse: Callable[[str], Any] | None = None,
    check: Callable[[Any], None] | None = None,
    choices: Sequence[Any] | None = None,
    choice_aliases: Mapping[str, Any] | None = None,
    metavar: str | None = None,
    group: str | None = None,
    not_a_flag: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Any:
    """A dataclass field with its command-line details (see the module's docstring). `metadata`
    is merged in (e.g. jaxserve.config.PER_PROCESS)."""
    meta: dict[str, Any] = dict(metadata or {})
    for key, value in (
        (FLAG, flag),
        (ALIASES, tuple(aliases) or None),
        (PARSE, parse),
        (CHECK, check),
        (CHOICES, tuple(choices) if choices is not None else None),
        (CHOICE_ALIASES, choice_aliases),
        (METAVAR, metavar),
        (GROUP, group),
        (NOT_A_FLAG, not_a_flag),
    ):
        if value is not None:
            meta[key] = value
    return dataclasses.field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------- value parsers
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "ti": 1 << 40,
    "tib": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1073741824' -> itself."""
    m = _SIZE.match(text)
    if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def non_negative(value: float) -> None:
    """A check: a finite number >= 0."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"expected a finite number >= 0, got {value!r}")


def positive(value: float) -> None:
    """A check: a finite number > 0 (an integer >= 1 for integer fields)."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"expected a finite number > 0, got {value!r}")


def run_checks(config: Any) -> None:
    """Run the `check` of every field of a dataclass instance that is set (from __post_init__),
    so that Python callers meet the same rules as the command line. ValueError names the field."""
    for f in dataclasses.fields(config):
        check, value = f.metadata.get(CHECK), getattr(config, f.name)
        if check is not None and value is not None:
            try:
                check(value)
            except ValueError as e:
                raise ValueError(f"{f.name}: {e}") from None


# ----------------------------------------------------------------------------------- introspection
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal after its annotated assignment in the
    class body), whitespace folded; fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def class_doc(cls: type) -> str:
    """A class docstring's first paragraph, whitespace folded (a help group's description)."""
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split())


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags (every field not marked not_a_flag)."""
    return [f for f in dataclasses.fields(cls) if NOT_A_FLAG not in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get(FLAG) or "--" + f.name.replace("_", "-")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"cannot make a flag of the union {tp}")
    return tp


def _element_parser(tp: Any) -> Callable[[str], Any]:
    if tp is int:
        return int
    if tp is float:
        return float
    if tp is str:
        return str
    raise TypeError(f"cannot make a flag of {tp}")


def _split_ints(text: str) -> list[int]:
    """'16,64 512' -> [16, 64, 512]."""
    try:
        return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise ValueError(f"expected integers separated by commas or spaces, got {text!r}") from None


class _ExtendTuple(argparse.Action):
    """nargs="+", repeatable: every value (lists flattened) appended to one tuple."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = list(getattr(namespace, self.dest, None) or ())
        for v in values:
            items.extend(v if isinstance(v, list) else [v])
        setattr(namespace, self.dest, tuple(items))


_WHAT = {int: "an integer", float: "a number"}


def flag_type(parse: Callable[[str], Any], check: Callable[[Any], None] | None = None):
    """An argparse `type` from a parser (and a check) that raise ValueError: the message reaches
    the user (argparse shows only its own "invalid value" for a plain ValueError)."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"expected {_WHAT[parse]}, got {text!r}" if parse in _WHAT else str(e)
            ) from None
        if check is not None:
            for v in value if isinstance(value, list) else [value]:
                try:
                    check(v)
                except ValueError as e:
                    raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return convert


def _default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING or f.default is None:
        return ""  # the docstring says what unset means
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    if isinstance(f.default, tuple):
        return " ".join(str(x) for x in f.default)
    return str(f.default)


def field_help(cls: type, f: dataclasses.Field, extra: str = "") -> str:
    """The help of a field's flag: its docstring (and `extra`), then its default."""
    doc = field_docs(cls).get(f.name, "") + extra
    default = _default_text(f)
    text = f"{doc} (default: {default})" if default else doc
    return text.replace("%", "%%")


def argument_spec(
    cls: type, f: dataclasses.Field, help_override: str | None = None
) -> tuple[list[str], dict]:
    """(option strings, add_argument keywords) of one field's flag. `help_override`, a
    command's own help for it, is the whole help (its default included)."""
    meta, tp = f.metadata, _unwrap_optional(_hints(cls)[f.name])
    names = [flag_name(f), *meta.get(ALIASES, ())]
    kw: dict[str, Any] = {"dest": f.name, "default": None, "help": field_help(cls, f)}
    check = meta.get(CHECK)
    origin = typing.get_origin(tp)
    if tp is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif dataclasses.is_dataclass(tp):  # a JSON object, given to the configuration as text
        keys = ", ".join(x.name for x in dataclasses.fields(tp))
        kw.update(type=str, metavar="JSON")
        kw["help"] = field_help(cls, f, f" Keys: {keys}.")
    elif origin is tuple:
        element = typing.get_args(tp)[0]
        parse = meta.get(PARSE) or (_split_ints if element is int else _element_parser(element))
        kw.update(nargs="+", action=_ExtendTuple, type=flag_type(parse, check))
        if element is int:
            kw["metavar"] = "N"
    else:
        choices = meta.get(CHOICES)
        if origin is typing.Literal:
            choices = typing.get_args(tp)
            tp = type(choices[0])
        aliases = meta.get(CHOICE_ALIASES)
        if aliases:
            kw["type"] = lambda text, _a=aliases: _a.get(text, text)
        else:
            parse = meta.get(PARSE) or _element_parser(tp)
            kw["type"] = flag_type(parse, check)
        if choices is not None:
            kw["choices"] = tuple(choices)
            if aliases:  # the aliases are accepted and shown, the canonical value is stored
                kw["metavar"] = "{" + ",".join([*map(str, choices), *aliases]) + "}"
    if help_override is not None:
        kw["help"] = help_override.replace("%", "%%")
    if meta.get(METAVAR):
        kw["metavar"] = meta[METAVAR]
    elif (
        "metavar" not in kw
        and "choices" not in kw
        and kw.get("action") is not argparse.BooleanOptionalAction
    ):
        kw["metavar"] = names[0].lstrip("-").upper().replace("-", "_")
    return names, kw


def add_arguments(
    group: argparse._ActionsContainer,
    cls: type,
    names: Iterable[str] | None = None,
    help_overrides: Mapping[str, str] | None = None,
) -> list[str]:
    """Add the flags of `cls`'s flag fields (those in `names`, in that order, when given) to a
    parser or argument group; returns their dests (the fields' names)."""
    fields = {f.name: f for f in flag_fields(cls)}
    chosen = list(fields) if names is None else list(names)
    overrides = help_overrides or {}
    for name in chosen:
        if name not in fields:
            raise KeyError(f"{cls.__name__}.{name} is not a flag field")
        option_strings, kw = argument_spec(cls, fields[name], overrides.get(name))
        group.add_argument(*option_strings, **kw)
    return chosen


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values the user gave for `cls`'s flag fields (None: not given, left out)."""
    out = {}
    for f in flag_fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:
            out[f.name] = value
    return out
