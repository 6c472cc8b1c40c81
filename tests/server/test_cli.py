"""Command-line parsing of `jaxserve serve` (no server is started)."""

from __future__ import annotations

import pytest

from jaxserve.server.cli import build_parser, engine_options, serve_model


def test_model_flag_after_multi_value_bucket_flags():
    args = build_parser().parse_args(["serve", "--token-buckets", "16", "64", "--model", "/m.gguf"])
    assert serve_model(args) == "/m.gguf"
    assert engine_options(args)["token_buckets"] == (16, 64)


def test_positional_model_before_bucket_flags():
    args = build_parser().parse_args(["serve", "/m.gguf", "--request-buckets", "8", "32"])
    assert serve_model(args) == "/m.gguf"
    assert engine_options(args)["request_buckets"] == (8, 32)


def test_no_model_means_the_bundled_default():
    assert serve_model(build_parser().parse_args(["serve"])) is None


def test_two_different_models_is_an_error():
    args = build_parser().parse_args(["serve", "/a.gguf", "--model", "/b.gguf"])
    with pytest.raises(SystemExit, match="two models"):
        serve_model(args)
