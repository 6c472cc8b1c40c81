"""The flags generated from the configuration dataclasses (jaxserve/config_cli.py): every field
is a flag or says why not, every flag reaches its field, and `--help` shows them by group."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing

import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.speculative_config import SpeculativeConfig
from jaxserve.config_cli import (
    CHOICES,
    NOT_A_FLAG,
    PARSE,
    field_docs,
    flag_fields,
    flag_name,
    parse_bytes,
)
from jaxserve.server.cli import build_parser, engine_options, server_config
from jaxserve.server.config import ServerConfig

ENGINE_PARTS = EngineConfig.parts()  # help group -> class
CLASSES = [*ENGINE_PARTS.values(), EngineConfig, ServerConfig]


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def options_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {a.dest: a.option_strings for a in parser._actions if a.option_strings}


# ------------------------------------------------------------------ every field is accounted for
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_a_flag_or_says_why_not(cls):
    serve = options_by_dest(subparser("serve"))
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
        if NOT_A_FLAG in f.metadata:
            assert f.metadata[NOT_A_FLAG].strip(), (
                f"{cls.__name__}.{f.name}: not a flag, but no reason"
            )
            continue
        assert flag_name(f) in serve.get(f.name, []), f"{cls.__name__}.{f.name} is not a serve flag"
        if f.default is None:  # the help must say what unset means
            assert "Default:" in docs[f.name], f"{cls.__name__}.{f.name}: what does unset mean?"


def test_every_serve_flag_is_a_field():
    """Nothing hand-written beside the fields but the model argument and the log level."""
    fields = {f.name for cls in CLASSES for f in flag_fields(cls)}
    dests = set(options_by_dest(subparser("serve"))) - {"help", "log_level", "model_flag"}
    assert dests == fields
    owners = [f.name for cls in CLASSES for f in flag_fields(cls)]
    assert len(owners) == len(set(owners)), "two flag fields share a name"


def test_the_speculative_flag_lists_its_keys():
    spec = next(a for a in subparser("serve")._actions if a.dest == "speculative_config")
    docs = field_docs(SpeculativeConfig)
    for f in dataclasses.fields(SpeculativeConfig):
        assert f.name in spec.help and docs.get(f.name)


# ------------------------------------------------------------------------- each flag round-trips
def _sample(cls, f) -> tuple[list[str], object]:
    """(argv after the flag, the field's expected value): a value other than the default."""
    tp = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    flag = flag_name(f)
    if f.name == "chat_template":  # a file or the template itself: this is a template
        return [flag, "{{ messages }}"], "{{ messages }}"
    if tp is bool:
        return ([f"--no-{flag[2:]}"], False) if f.default else ([flag], True)
    if dataclasses.is_dataclass(tp):
        return [flag, '{"method": "ngram", "num_speculative_tokens": 3}'], tp(
            num_speculative_tokens=3
        )
    if typing.get_origin(tp) is tuple:
        element = typing.get_args(tp)[0]
        return (
            ([flag, "8,16", "32"], (8, 16, 32))
            if element is int
            else ([flag, "a", "b"], ("a", "b"))
        )
    choices = (
        typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else f.metadata.get(CHOICES)
    )
    if choices:
        value = [c for c in choices if c != f.default][-1]
        return [flag, str(value)], value
    if f.metadata.get(PARSE) is parse_bytes:
        return [flag, "3MiB"], 3 << 20
    if tp is int:
        value = 2 * f.default if f.default else 2
    elif tp is float:
        value = f.default / 2 if f.default else 0.5
    else:
        value = "some/value"
    return [flag, str(value)], value


# Flags that need another to make sense.
_WITH = {
    "ssl_keyfile": ["--ssl-certfile", "c.pem"],
    "ssl_certfile": ["--ssl-keyfile", "k.pem"],
    "enable_auto_tool_choice": ["--tool-call-parser", "hermes"],
}


@pytest.mark.parametrize(
    ("cls", "name"),
    [(c, f.name) for c in CLASSES for f in flag_fields(c)],
    ids=lambda x: x if isinstance(x, str) else x.__name__,
)
def test_each_flag_reaches_its_field(cls, name):
    """parse -> configuration -> the field's value, for every flag, with a value other than the
    default."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    argv, expected = _sample(cls, f)
    assert expected != f.default
    args = build_parser().parse_args(["serve", *argv, *_WITH.get(name, [])])
    if cls is ServerConfig:
        assert getattr(server_config(args), name) == expected
        assert engine_options(args) == {}
        return
    config = EngineConfig.from_kwargs(**engine_options(args))
    part = (
        config
        if cls is EngineConfig
        else getattr(config, next(k for k, v in ENGINE_PARTS.items() if v is cls))
    )
    assert getattr(part, name) == expected
    assert server_config(args) == ServerConfig()


def test_vllm_spellings_and_aliases():
    parse = build_parser().parse_args
    for argv, key, value in (
        (["--block-size", "32"], "page_size", 32),
        (["--dtype", "half"], "dtype", "float16"),
        (["--dtype", "float"], "dtype", "float32"),
        (["--gpu-memory-utilization", "0.5"], "device_memory_utilization", 0.5),
        (["--kv-cache-memory", "2GiB"], "kv_cache_memory_bytes", 2 << 30),
        (["--kv-cache-memory-bytes", "1000"], "kv_cache_memory_bytes", 1000),
        (["--scheduling-policy", "priority"], "policy", "priority"),
        (["--no-compilation-cache"], "enable_compilation_cache", False),
        (
            ["--token-buckets", "64", "16", "--token-buckets", "16,256"],
            "token_buckets",
            (64, 16, 16, 256),
        ),
    ):
        assert engine_options(parse(["serve", *argv])) == {key: value}, argv
    # The buckets reach the configuration sorted, once each, and set the token budget.
    config = EngineConfig.from_kwargs(
        **engine_options(parse(["serve", "--token-buckets", "64", "16,64"]))
    )
    assert (
        config.compile.token_buckets == (16, 64) and config.scheduler.max_num_batched_tokens == 64
    )
    # Python callers get vLLM's dtype spellings too.
    assert ModelConfig(dtype="half").dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="fp8")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-memory", "2XB"], "not a byte size"),
        (["--token-buckets", "16,x"], "integers separated"),
        (["--max-num-seqs", "many"], "expected an integer"),
        (["--shutdown-grace", "-1"], "finite number >= 0"),
        (["--request-timeout", "nan"], "finite number > 0"),
        (["--max-waiting-requests", "0"], "finite number > 0"),
        (["--dtype", "fp8"], "invalid choice"),
        (["--tool-call-parser", "nope"], "invalid choice"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    err = capsys.readouterr().err
    assert argv[0] in err and message in err


def test_server_rules_hold_for_python_callers_too():
    with pytest.raises(ValueError, match="shutdown_grace"):
        ServerConfig(shutdown_grace=-1.0)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ServerConfig(tool_call_parser="nope")


def test_the_context_a_user_gives_is_the_schedulers_before_the_model_loads():
    """Without chunked prefill the token budget must cover the context: the one asked for, not
    the default one."""
    config = EngineConfig.from_kwargs(
        max_model_len=512, enable_chunked_prefill=False, max_num_batched_tokens=1024
    )
    assert config.model.max_model_len == config.scheduler.max_model_len == 512
    with pytest.raises(ValueError, match="Without chunked prefill"):
        EngineConfig.from_kwargs(
            max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=1024
        )


# ------------------------------------------------------------------------------------------ --help
def _help_sections(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """The flags listed under each heading of a help text."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in parser.format_help().splitlines():
        if re.fullmatch(r"[a-z][\w -]*:", line):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            current.extend(re.findall(r"--[\w-]+", line.split("  ")[1]))
    return sections


def test_serve_help_lists_every_group_with_its_flags_and_defaults():
    serve = subparser("serve")
    sections = _help_sections(serve)
    assert list(sections) == [
        "positional arguments",
        "options",
        "model",
        "cache",
        "scheduler",
        "parallel",
        "compile",
        "lora",
        "server",
    ]
    groups = {**ENGINE_PARTS, "server": ServerConfig}
    for title, cls in groups.items():
        for f in flag_fields(cls):
            assert flag_name(f) in sections[title], (title, f.name)
    for f in flag_fields(EngineConfig):  # the engine's own options join the group they belong to
        assert flag_name(f) in sections[f.metadata["group"]]
    text = " ".join(serve.format_help().split())
    for fragment in (
        "Sequences in one step at most",
        "(default: 32)",
        "(default: 16)",
        "(default: 0.9)",
        "(default: 127.0.0.1)",
        "(default: 8000)",
        "--no-enable-prefix-caching",
        "(default: on)",
        "Default: the model's max_position_embeddings",
    ):
        assert fragment in text, fragment


def test_generate_and_shard_plan_share_the_engine_flags():
    generate = _help_sections(subparser("generate"))
    for title, cls in ENGINE_PARTS.items():
        assert {flag_name(f) for f in flag_fields(cls)} <= set(generate[title])
    plan = _help_sections(subparser("shard-plan"))
    assert {"--max-model-len", "--dtype", "--quantization", "--max-num-seqs"} <= {
        x for s in plan.values() for x in s
    }
    assert {"--page-size", "--block-size", "--kv-cache-memory", "--kv-cache-dtype"} <= set(
        plan["cache"]
    )
    # A command may say how it uses a flag differently; the spelling and parsing stay the engine's.
    args = build_parser().parse_args(
        ["shard-plan", "--kv-cache-memory", "1GiB", "--block-size", "32"]
    )
    assert (args.kv_cache_memory_bytes, args.page_size) == (1 << 30, 32)
    assert "largest request bucket" in " ".join(subparser("shard-plan").format_help().split())


def test_defaults_live_in_the_dataclasses():
    """The parser's defaults are all None (unset): what a flag left out means is the field's
    default, written once."""
    for action in subparser("serve")._actions:
        if action.dest not in ("help", "log_level"):
            assert action.default is None, action.dest
    assert (
        EngineConfig.from_kwargs(**engine_options(build_parser().parse_args(["serve"])))
        == EngineConfig()
    )
    assert server_config(build_parser().parse_args(["serve"])) == ServerConfig()
