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


def test_generate_on_the_haswell_kernel_build(tmp_path, compile_cache_dir):
    """`--cpu-kernel-target haswell` (the AVX2-only class of CPUs) serves float32 through the AVX2
    product kernel, and gives the same greedy text as the native build."""
    import os
    import subprocess
    import sys

    from jaxserve.pallas_kernels import cpu
    from tests.model_dirs import write_model_dir

    if cpu.missing_isa("haswell"):
        pytest.skip("this CPU cannot run the haswell build")
    model = write_model_dir(tmp_path / "m")
    texts = {}
    for target in ("haswell", "native"):
        cmd = [sys.executable, "-m", "jaxserve.server.cli", "generate", "w5 w6 w7", "--model", str(model),
               "--dtype", "float32", "--max-tokens", "8", "--token-buckets", "16", "--request-buckets", "8",
               "--cpu-kernel-target", target, "--compilation-cache-dir", compile_cache_dir, "--log-level", "info"]
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        texts[target] = res.stdout
        if target == "haswell":
            assert "for the avx2 matmul kernel" in res.stderr
    assert texts["haswell"] == texts["native"] and texts["native"].strip()
