"""The `jaxserve` command: `serve` (the OpenAI-compatible server), `generate` (one prompt),
`shard-plan` (sharding experiments: jaxserve/tools/shard_plan.py) and `compile` (the served steps
compiled ahead for a target: jaxserve/tools/compile_ahead.py)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from typing import Any

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config_cli import add_arguments, class_doc, values_from_args
from jaxserve.server.config import TOOL_PARSER_NAMES, ServerConfig

__all__ = ["TOOL_PARSER_NAMES", "build_parser", "engine_options", "main", "server_config",
           "uvicorn_options"]

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]
MODEL_HELP = ("HF model directory, .gguf file or Hugging Face Hub name (org/name, org/name:QUANT; "
              "default: the bundled model)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (EngineConfig.from_kwargs's keywords)."""
    return EngineConfig.cli_options(args)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The front end's options from the serve flags (ValueError on a bad combination)."""
    return ServerConfig(**values_from_args(ServerConfig, args))


def uvicorn_options(server: ServerConfig, log_level: str) -> dict[str, Any]:
    """uvicorn.Config's options from the front end's (`log_level`: the process's, unless
    server.uvicorn_log_level says otherwise)."""
    opts: dict[str, Any] = {
        "host": server.host, "port": server.port, "log_level": server.uvicorn_log_level or log_level,
        "timeout_keep_alive": 5,
        "timeout_graceful_shutdown": graceful_shutdown_timeout(server.shutdown_grace),
    }
    if server.root_path:
        opts["root_path"] = server.root_path
    if server.ssl_keyfile:
        opts.update(ssl_keyfile=server.ssl_keyfile, ssl_certfile=server.ssl_certfile)
    return opts


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.engine.client import PLAN_HELP

    parser = argparse.ArgumentParser(prog="jaxserve", description="LLM inference in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Run the OpenAI-compatible HTTP server. Every option is a field of "
                                   "jaxserve/config.py (engine) or server/config.py (server).",
                       epilog=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    model_group = s.add_argument_group("model", class_doc(ModelConfig))
    model_group.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                             help="The model as an option; it can follow multi-value flags such as "
                                  "--token-buckets.")
    EngineConfig.add_cli_args(s, groups={"model": model_group})
    add_arguments(s.add_argument_group("server", class_doc(ServerConfig)), ServerConfig)

    g = sub.add_parser("generate", help="generate text for one prompt and print it")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS)
    EngineConfig.add_cli_args(g)

    from jaxserve.tools.shard_plan import add_arguments as add_shard_plan_arguments

    sp = sub.add_parser("shard-plan", help="compile the step for meshes, sharding rules and buckets (simulated "
                        "CPU devices or TPU topologies) and report memory, collectives and cost per device")
    add_shard_plan_arguments(sp)

    from jaxserve.tools.compile_ahead import add_arguments as add_compile_arguments

    c = sub.add_parser("compile", help="compile the served steps for a TPU slice, GPU hosts or this CPU into a "
                       "directory that serve --executables loads (no chips or weights needed)")
    add_compile_arguments(c)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from jaxserve.engine.client import FingerprintMismatch, FollowerRole, open_engine
    from jaxserve.engine.client import exit_now
    from jaxserve.startup_timer import StartupTimer

    model = serve_model(args)
    opts = engine_options(args)
    try:
        server = server_config(args)  # reads --chat-template's file
        if server.served_model_name:
            opts["served_model_name"] = server.served_model_name[0]
        server_opts = uvicorn_options(server, args.log_level)
        config = EngineConfig.from_kwargs(model=model, **opts)
    except (ValueError, TypeError) as e:
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 2
    log = logging.getLogger(__name__)
    timer = StartupTimer(since_launch=True)
    several = config.parallel.coordinator_address is not None

    try:
        aengine = open_engine(config, core=server.engine_core, timer=timer,
                              max_waiting_requests=server.max_waiting_requests)
    except FollowerRole as follower:  # headless: the leader serves HTTP, this process runs its steps
        return _follow(follower, log)
    except FingerprintMismatch as e:  # several processes started with different flags or models
        log.error("%s", e)
        return 2
    except ValueError as e:  # a setting the model or the devices cannot take (e.g. too few devices)
        log.debug("the engine could not be built", exc_info=True)
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 2
    try:
        _run_server(aengine, server, server_opts, timer, log)
    except BaseException:
        if several:  # the followers shut down with the leader (else they wait for its steps)
            aengine.close()
        raise
    if aengine.error is not None:
        # The engine failed for good (a device error, a lost follower): exit non-zero so that a
        # supervisor restarts the server; in-flight requests have been answered with the error.
        log.error("exiting: the engine failed (%r)", aengine.error)
        if several:
            # Not through the interpreter's exit: JAX's distributed shutdown would wait for the
            # lost process at its barrier (minutes), and the engine thread may be stuck in a
            # collective. The run is over for every process.
            exit_now(1)
        return 1
    aengine.close()  # several processes: the followers shut down with the leader
    return 0


def _run_server(aengine, server: ServerConfig, server_opts: dict, timer, log) -> None:
    """The HTTP server over a built engine, until it is stopped."""
    import uvicorn

    from jaxserve.server.app import build_app
    from jaxserve.server.draining import DrainingServer

    server_t0 = time.perf_counter()
    app = build_app(aengine, server)
    scheme = "https" if server.ssl_certfile else "http"
    log.info("serving %s on %s://%s:%d%s (at most %d waiting sequences, request timeout %s)",
             app.state.server.model_name, scheme, server.host, server.port, server.root_path or "",
             aengine.max_waiting_requests, f"{server.request_timeout:g} s" if server.request_timeout else "off")
    uvicorn_config = uvicorn.Config(app, **server_opts)

    def started() -> None:
        timer.add("server", time.perf_counter() - server_t0)
        log.info("%s", timer.summary())

    DrainingServer(uvicorn_config, aengine, server.shutdown_grace, on_started=started).run()


def _follow(follower, log: logging.Logger) -> int:
    """A follower process: run the leader's steps; exit 0 when it shuts down, 1 when it is lost."""
    from jaxserve.engine.client import LeaderLostError
    from jaxserve.engine.client import exit_now

    try:
        return follower.run()
    except LeaderLostError as e:
        log.error("exiting: %s", e)
        exit_now(1)


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
    try:
        llm = LLM(args.model, **opts)
    except ValueError as e:  # a model that cannot be had (a missing file, a Hub error)
        logging.getLogger(__name__).debug("the engine could not be built", exc_info=True)
        print(f"jaxserve generate: {e}", file=sys.stderr)
        return 2
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
        if args.command == "compile":
            from jaxserve.tools.compile_ahead import run as compile_ahead

            return compile_ahead(args)
        if args.command == "shard-plan":
            from jaxserve.tools.shard_plan import run as shard_plan

            return shard_plan(args)
        return _generate(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
