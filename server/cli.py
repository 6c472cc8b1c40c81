"""The `jaxserve` command: `serve` (the OpenAI-compatible server), `generate` (one prompt) and
`shard-plan` (sharding experiments: jaxserve/tools/shard_plan.py)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import time
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_bytes(text: str) -> int:
    """'2GiB' → 2147483648, '512MB' → 512000000, '1073741824' → itself."""
    m = _SIZE.match(text)
    if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _buckets(values: list[list[int]] | None) -> tuple[int, ...] | None:
    if not values:
        return None
    return tuple(sorted({x for v in values for x in v}))


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: min(model, 2048))")
    g.add_argument("--max-num-seqs", type=int, default=None, help="max sequences per step (default 32)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: the backend's: 8192 on TPU/GPU, as vLLM; 512 on a CPU, "
                        "where larger steps only delay first tokens; with --token-buckets: the largest)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV cache size in bytes; suffixes allowed (e.g. 2GiB, 512MB)")
    g.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=None,
                   help="tokens per KV page (power of two, default 16); --block-size is vLLM's name")
    g.add_argument("--token-buckets", type=_int_list, nargs="+", default=None,
                   help="padded token counts to compile, e.g. 16 64 512 or 16,64,512 (default: x2 from 16 up to "
                        "the token budget; on TPU/GPU x4 above 1024)")
    g.add_argument("--request-buckets", type=_int_list, nargs="+", default=None,
                   help="padded request counts to compile, e.g. 1 8 32")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="where compiled steps (executables/) and, on a CPU, the weights packed for its kernels "
                        "(weights/) are kept, so that restarts load them (default: <user cache>/jaxserve/xla)")
    g.add_argument("--no-compilation-cache", action="store_true",
                   help="keep no compiled steps or packed weights: compile and pack at every start")
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="weights' dtype (half = float16, float = float32, as in vLLM)")
    g.add_argument("--attention-impl", default=None, help="auto, reference, tpu, gpu; tpu-interpret and gpu-interpret run the kernels on any host (slow, for checking)")
    g.add_argument("--matmul-impl", default=None, choices=["auto", "xla", "amx", "avx512", "avx2"],
                   help="CPU product kernels on packed weights: amx (bfloat16), avx512 or avx2 (float32); "
                        "auto: the one that fits the dtype where it runs, else XLA's dot")
    g.add_argument("--cpu-kernel-target", default=None, choices=["native", "haswell", "x86-64"],
                   help="instruction set the native CPU kernels are built for (default: native; haswell "
                        "emulates an AVX2-only CPU on a newer one)")
    g.add_argument("--seed", type=int, default=None, help="seed for unseeded requests")
    g.add_argument("--quantization", default=None, choices=["int8"],
                   help="weight-only int8 (per-channel scales) of a float checkpoint, quantized at load")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache of shared prompt prefixes (default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default: on; off needs max_num_batched_tokens "
                        ">= max_model_len)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the accelerator's free memory for the KV cache (default 0.9; vLLM's name)")
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache dtype (auto: the model's, float32 on a CPU without the native attention kernel)")
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="fcfs: by arrival; priority: by the requests' priority field (lower first), then arrival")
    g.add_argument("--max-logprobs", type=int, default=None, help="largest logprobs a request may ask (default 20)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap host and device: plan and launch step t+1 while step t runs (default: on)")
    g.add_argument("--generation-config", default=None,
                   help="'auto' (the model's generation_config.json: default sampling settings and EOS ids), "
                        "'vllm' (ignore its sampling defaults) or a folder holding a generation_config.json")
    g.add_argument("--executable-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the compiled steps on disk and load them at the next start, without tracing "
                        "or compiling (default: on; --no-executable-cache compiles at every start)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (n-gram prompt lookup; default: off)')
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="data-parallel ranks (the mesh's data axis): each its own scheduler, requests and KV pages")
    h = p.add_argument_group("several hosts (every host runs the same command, each with its --process-id)")
    h.add_argument("--coordinator-address", default=None,
                   help="HOST:PORT of process 0 (JAX's coordinator), or 'auto' to detect a Cloud TPU, SLURM or "
                        "Kubernetes job; process 0 serves, the others run its steps headless")
    h.add_argument("--num-processes", type=int, default=None, help="processes (hosts) in the run")
    h.add_argument("--process-id", type=int, default=None, help="this process's index (0 = the leader)")
    h.add_argument("--follower-port", type=int, default=None,
                   help="the leader's port for its step channel (default: the coordinator's port + 1)")
    h.add_argument("--step-timeout", type=float, default=None,
                   help="seconds a follower waits for the leader before it exits (default 120)")
    h.add_argument("--heartbeat-timeout", type=int, default=None,
                   help="seconds JAX's coordination service waits for a silent process (default 100)")
    g.add_argument("--tensor-parallel-size", type=int, default=None, help="mesh 'model' axis size")
    g.add_argument("--sharding-rules", default=None, metavar="PRESET|FILE",
                   help="how weights and the KV cache split over the mesh: a preset (tp, tp-replicate-vocab, "
                        "tp-kv-replicated, fsdp, expert-parallel) or a JSON/YAML file mapping logical axes to "
                        "mesh axes (default: tp)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    simple = {"max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
              "max_num_batched_tokens": "max_num_batched_tokens", "kv_cache_memory": "kv_cache_memory_bytes",
              "page_size": "page_size", "compilation_cache_dir": "compilation_cache_dir", "dtype": "dtype",
              "attention_impl": "attention_impl", "matmul_impl": "matmul_impl",
              "cpu_kernel_target": "cpu_kernel_target", "seed": "seed", "max_logprobs": "max_logprobs",
              "async_scheduling": "async_scheduling", "generation_config": "generation_config",
              "quantization": "quantization", "data_parallel_size": "data_parallel_size",
              "tensor_parallel_size": "tensor_parallel_size", "coordinator_address": "coordinator_address",
              "num_processes": "num_processes", "process_id": "process_id", "follower_port": "follower_port",
              "step_timeout": "step_timeout_seconds", "heartbeat_timeout": "heartbeat_timeout_seconds",
              "sharding_rules": "sharding_rules",
              "enable_prefix_caching": "enable_prefix_caching", "enable_chunked_prefill": "enable_chunked_prefill",
              "gpu_memory_utilization": "device_memory_utilization", "kv_cache_dtype": "kv_cache_dtype",
              "scheduling_policy": "policy", "speculative_config": "speculative_config",
              "executable_cache": "enable_executable_cache"}
    for arg, key in simple.items():
        v = getattr(args, arg, None)
        if v is not None:
            opts[key] = v
    if (tb := _buckets(getattr(args, "token_buckets", None))) is not None:
        opts["token_buckets"] = tb
    if (rb := _buckets(getattr(args, "request_buckets", None))) is not None:
        opts["request_buckets"] = rb
    if getattr(args, "no_compilation_cache", False):
        opts["enable_compilation_cache"] = False
    if opts.get("dtype") in DTYPE_ALIASES:
        opts["dtype"] = DTYPE_ALIASES[opts["dtype"]]
    return opts


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's spellings
DEFAULT_ENGINE_CORE = "thread"  # where the engine core runs (--engine-core)


def _add_openai_args(s: argparse.ArgumentParser) -> None:
    """vLLM's serve flags for the OpenAI-compatible front end (templates, tools, logging, TLS)."""
    g = s.add_argument_group("OpenAI-compatible server")
    g.add_argument("--chat-template", default=None,
                   help="a chat template (Jinja) replacing the model's: a file path or the template itself")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto'); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSER_NAMES),
                   help="the model's tool-call format: hermes (Hermes, Qwen2.5/Qwen3 <tool_call> JSON), "
                        "llama3_json (Llama 3.x), mistral ([TOOL_CALLS])")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request received")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["debug", "info", "warning", "error", "critical", "trace"],
                   help="uvicorn's log level (default: --log-level)")
    g.add_argument("--root-path", default=None, help="the path prefix a proxy serves this server under")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (with --ssl-certfile: serve HTTPS)")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file")


# (kept in sync with jaxserve.server.tool_parsers.TOOL_PARSERS, which a test checks; the CLI
# does not import the server to parse its arguments)
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral")


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template: a file's contents if the value names a file, else the template itself."""
    if value is None:
        return None
    import pathlib

    path = pathlib.Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's options from the serve flags."""
    opts: dict[str, Any] = dict(host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                                timeout_keep_alive=5,
                                timeout_graceful_shutdown=graceful_shutdown_timeout(args.shutdown_grace))
    if args.root_path:
        opts["root_path"] = args.root_path
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_keyfile:
        opts.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
    return opts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", default=None, help="HF model directory or .gguf file (default: bundled model)")
    s.add_argument("--model", dest="model_flag", default=None,
                   help="the model as an option; it can follow multi-value flags such as --token-buckets")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use; the first is reported")
    s.add_argument("--api-key", nargs="+", action="extend", default=None,
                   help="key(s) required on every route but /health, /version and /metrics")
    s.add_argument("--allowed-origins", nargs="+", default=None, help="CORS origins, e.g. '*'")
    s.add_argument("--disable-request-id-header", action="store_true", help="do not send X-Request-Id")
    s.add_argument("--max-request-body", type=parse_bytes, default=None,
                   help="largest request body in bytes, suffixes allowed (default: 1 MiB plus 256 bytes per "
                        "token of context, enough for several full-context prompts)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates sent with requests (Jinja code, run in a sandbox); refused otherwise")
    s.add_argument("--shutdown-grace", type=_non_negative, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/Ctrl-C before they are aborted")
    s.add_argument("--max-waiting-requests", type=_positive_int, default=None,
                   help="refuse new requests (503 with Retry-After) while this many sequences wait to be "
                        "scheduled (n > 1 and each prompt of a batch count one each); default: "
                        "max(max_num_seqs, 4 * KV cache tokens // max_model_len), enough queued "
                        "sequences to fill the KV cache four times at full context")
    s.add_argument("--engine-core", choices=["thread", "process"], default=None,
                   help="where the engine core (scheduler, runner, device calls) runs: on a thread of the "
                        "server's process, or in a process of its own, so that the HTTP event loop and "
                        "detokenizing never share an interpreter with the steps (default: " + DEFAULT_ENGINE_CORE
                        + "; see README, Performance)")
    s.add_argument("--request-timeout", type=_positive_seconds, default=None,
                   help="seconds from a request's arrival to its last token: past it the request is "
                        "aborted (its KV freed) and the client gets a 504, or an error event in a "
                        "stream (default: no deadline)")
    s.add_argument("--enable-sleep-mode", action="store_true",
                   help="serve POST /sleep, POST /wake_up and GET /is_sleeping (free and restore the device memory)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    _add_openai_args(s)
    _add_engine_args(s)

    g = sub.add_parser("generate", help="generate text for one prompt and print it")
    g.add_argument("prompt")
    g.add_argument("--model", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error", "critical"])
    _add_engine_args(g)

    from jaxserve.tools.shard_plan import add_arguments as add_shard_plan_arguments

    sp = sub.add_parser("shard-plan", help="compile the step for meshes, sharding rules and buckets (simulated "
                        "CPU devices or TPU topologies) and report memory, collectives and cost per device")
    add_shard_plan_arguments(sp)
    return parser


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jaxserve.config import EngineConfig
    from jaxserve.engine.client import FingerprintMismatch, FollowerRole, open_engine
    from jaxserve.server.app import build_app
    from jaxserve.server.draining import DrainingServer
    from jaxserve.startup_timer import StartupTimer

    model = serve_model(args)
    names = args.served_model_name
    opts = engine_options(args)
    if names:
        opts["served_model_name"] = names[0]
    try:
        if args.enable_auto_tool_choice and not args.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        chat_template = chat_template_arg(args.chat_template)
        server_opts = uvicorn_options(args)
        config = EngineConfig.from_kwargs(model=model, **opts)
    except (ValueError, TypeError) as e:
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 2
    log = logging.getLogger(__name__)
    timer = StartupTimer(since_launch=True)
    try:
        aengine = open_engine(config, core=args.engine_core or DEFAULT_ENGINE_CORE, timer=timer,
                              max_waiting_requests=args.max_waiting_requests)
    except FollowerRole as follower:  # headless: the leader serves HTTP, this process runs its steps
        return _follow(follower, log)
    except FingerprintMismatch as e:  # several processes started with different flags or models
        log.error("%s", e)
        return 2
    except ValueError as e:  # a setting the model or the devices cannot take (e.g. too few devices)
        log.debug("the engine could not be built", exc_info=True)
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 2
    server_t0 = time.perf_counter()
    app = build_app(aengine, served_model_names=names, api_keys=args.api_key, allowed_origins=args.allowed_origins,
                    max_body_bytes=args.max_request_body, request_id_header=not args.disable_request_id_header,
                    shutdown_grace_seconds=args.shutdown_grace, enable_sleep_mode=args.enable_sleep_mode,
                    trust_request_chat_template=args.trust_request_chat_template,
                    request_timeout=args.request_timeout, chat_template=chat_template,
                    tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                    log_requests=not args.disable_log_requests)
    scheme = "https" if args.ssl_certfile else "http"
    log.info("serving %s on %s://%s:%d%s (at most %d waiting sequences, request timeout %s)",
             (names or [aengine.model_name])[0], scheme, args.host, args.port, args.root_path or "",
             aengine.max_waiting_requests, f"{args.request_timeout:g} s" if args.request_timeout else "off")
    uvicorn_config = uvicorn.Config(app, **server_opts)

    def started() -> None:
        timer.add("server", time.perf_counter() - server_t0)
        log.info("%s", timer.summary())

    DrainingServer(uvicorn_config, aengine, args.shutdown_grace, on_started=started).run()
    if aengine.error is not None:
        # The engine failed for good (a device error, a lost follower): exit non-zero so that a
        # supervisor restarts the server; in-flight requests have been answered with the error.
        log.error("exiting: the engine failed (%r)", aengine.error)
        if config.parallel.coordinator_address is not None:
            # Not through the interpreter's exit: JAX's distributed shutdown would wait for the
            # lost process at its barrier (minutes), and the engine thread may be stuck in a
            # collective. The run is over for every process.
            logging.shutdown()
            os._exit(1)
        return 1
    aengine.close()  # several processes: the followers shut down with the leader
    return 0


def _follow(follower, log: logging.Logger) -> int:
    """A follower process: run the leader's steps; exit 0 when it shuts down, 1 when it is lost."""
    from jaxserve.engine.client import LeaderLostError

    try:
        return follower.run()
    except LeaderLostError as e:
        # Not through the interpreter's exit: JAX's distributed shutdown would wait at its
        # barrier for the leader that is gone.
        log.error("exiting: %s", e)
        logging.shutdown()
        os._exit(1)


def graceful_shutdown_timeout(grace_seconds: float) -> int:
    """uvicorn's limit on open connections at shutdown: the drain's grace plus a margin for the
    last responses, in whole seconds (uvicorn takes an int, and None would wait forever)."""
    return math.ceil(grace_seconds) + 5


def _generate(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    opts = engine_options(args)
    opts.setdefault("show_progress", False)
    # One prompt needs one running sequence: a small request bucket keeps start-up short.
    opts.setdefault("max_num_seqs", 8)
    llm = LLM(args.model, **opts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def serve_model(args: argparse.Namespace) -> str | None:
    """The model `serve` was given, positionally or with --model (not two different ones)."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise SystemExit(f"jaxserve serve: two models given ({args.model!r} and --model "
                         f"{args.model_flag!r}); pass one")
    return args.model or args.model_flag


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "shard-plan":
            from jaxserve.tools.shard_plan import run as shard_plan

            return shard_plan(args)
        return _generate(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
