"""Command-line parsing of `jaxserve serve` (no server is started)."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig
from jaxserve.server.cli import (
    build_parser,
    engine_options,
    main,
    serve_model,
    server_config,
    uvicorn_options,
)
from jaxserve.server.config import ServerConfig


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


def test_vllm_serve_flags_map_to_engine_options():
    from jaxserve.config import EngineConfig

    args = build_parser().parse_args([
        "serve", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "bfloat16", "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048", "--block-size", "32", "--dtype", "half",
        "--scheduling-policy", "priority"])
    opts = engine_options(args)
    assert opts == {"device_memory_utilization": 0.5, "kv_cache_dtype": "bfloat16", "enable_prefix_caching": False,
                    "enable_chunked_prefill": False, "max_num_batched_tokens": 2048, "page_size": 32,
                    "dtype": "float16", "policy": "priority"}
    cfg = EngineConfig.from_kwargs(**opts)
    assert cfg.cache.page_size == 32 and cfg.scheduler.policy == "priority" and not cfg.cache.enable_prefix_caching
    assert engine_options(build_parser().parse_args(["serve", "--dtype", "float", "--enable-prefix-caching"])) == {
        "dtype": "float32", "enable_prefix_caching": True}
    assert engine_options(build_parser().parse_args(["serve"])) == {}


def test_uvicorn_options_tls_root_path_and_log_levels():
    args = build_parser().parse_args(["serve", "--root-path", "/llm", "--ssl-keyfile", "k.pem", "--ssl-certfile",
                                      "c.pem", "--log-level", "warning"])
    opts = uvicorn_options(server_config(args), args.log_level)
    assert opts["root_path"] == "/llm" and opts["ssl_keyfile"] == "k.pem" and opts["ssl_certfile"] == "c.pem"
    assert opts["log_level"] == "warning"
    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "debug", "--ssl-keyfile", "k.pem"])
    with pytest.raises(ValueError, match="go together"):
        server_config(args)
    args = build_parser().parse_args(["serve", "--uvicorn-log-level", "debug"])
    opts = uvicorn_options(server_config(args), args.log_level)
    assert opts["log_level"] == "debug" and "ssl_keyfile" not in opts


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path, capsys):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert server_config(build_parser().parse_args(["serve", "--chat-template", str(f)])
                         ).chat_template_text == "{{ messages[0].content }}"
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert ServerConfig(chat_template=template).chat_template_text == template
    assert ServerConfig().chat_template_text is None  # the model's
    with pytest.raises(ValueError, match="neither a file"):
        ServerConfig(chat_template=str(tmp_path / "missing.jinja"))
    # the command stops before building the engine
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "neither a file nor a Jinja template" in capsys.readouterr().err


def test_a_mesh_larger_than_the_devices_is_a_message_not_a_traceback(tmp_path, capsys):
    import jax

    from tests.model_dirs import write_model_dir

    model = write_model_dir(tmp_path / "m")
    too_many = 2 * len(jax.devices())
    assert main(["serve", str(model), "--data-parallel-size", str(too_many), "--max-num-seqs", str(too_many),
                 "--max-num-batched-tokens", str(16 * too_many)]) == 2
    err = capsys.readouterr().err
    assert f"needs {too_many} devices" in err and "Traceback" not in err


def test_auto_tool_choice_needs_a_parser(capsys):
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.tool_call_parser == "hermes" and not args.disable_log_requests
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])


def test_speculative_config_flag(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    opts = engine_options(build_parser().parse_args(["serve", "--speculative-config", spec]))
    assert opts["speculative_config"] == spec
    config = EngineConfig.from_kwargs(**opts).speculative_config
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 4, 4)
    assert main(["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}']) == 2
    assert "'ngram'" in capsys.readouterr().err
    assert main(["serve", "--speculative-config", "{oops"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_generate_on_the_haswell_kernel_build(tmp_path, compile_cache_dir):
    """`--cpu-kernel-target haswell` (the AVX2-only class of CPUs) serves float32 through the AVX2
    product kernel, and gives the same greedy text as the native build."""
    import os
    import subprocess
    import sys

    from jaxserve.backends.cpu import kernels as cpu
    from tests.model_dirs import write_model_dir

    if cpu.missing_isa("haswell"):
        pytest.skip("this CPU cannot run the haswell build")
    model = write_model_dir(tmp_path / "m")
    texts = {}
    for target in ("haswell", "native"):
        cmd = [sys.executable, "-m", "jaxserve.server.cli", "generate", "w5 w6 w7", "--model", str(model),
               "--dtype", "float32", "--max-tokens", "8", "--token-buckets", "16", "--request-buckets", "8",
               "--cpu-kernel-target", target, "--compilation-cache-dir", compile_cache_dir, "--log-level", "info"]
        env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=1")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        texts[target] = res.stdout
        if target == "haswell":
            assert "for the avx2 matmul kernel" in res.stderr
    assert texts["haswell"] == texts["native"] and texts["native"].strip()
