"""ServerConfig: the options of `jaxserve serve`'s HTTP front end (vLLM's serve flags where it
has them). Each field documents itself with an attribute docstring and is a flag of the server
group (jaxserve/config_cli.py), as the engine's options are in jaxserve/config.py."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Literal

from jaxserve.config_cli import non_negative, option, parse_bytes, positive, run_checks
from jaxserve.chat.tool_parsers import TOOL_PARSERS

# The names `--tool-call-parser` takes: the parser registry's.
TOOL_PARSER_NAMES = tuple(sorted(TOOL_PARSERS))


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end: address, access, limits, chat templates and tools, logging, TLS."""

    host: str = "127.0.0.1"
    """The address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """The port to listen on."""
    served_model_name: tuple[str, ...] | None = None
    """The name(s) clients use for the model; the first is reported. Default: the model
    argument, or the bundled model's name."""
    api_key: tuple[str, ...] | None = None
    """Key(s) required (Authorization: Bearer) on every route but /health, /ping, /version,
    /metrics and the playground page. Default: none required."""
    allowed_origins: tuple[str, ...] | None = None
    """CORS origins allowed to call the API from a browser, e.g. '*'. Default: none."""
    disable_request_id_header: bool = False
    """Do not send the X-Request-Id response header."""
    max_request_body: int | None = option(None, parse=parse_bytes, check=positive)
    """The largest request body in bytes, suffixes allowed (4MiB). Default: 1 MiB plus 256 bytes
    per token of context, enough for several full-context prompts."""
    trust_request_chat_template: bool = False
    """Render chat templates sent with requests (Jinja code, run in a sandbox); else refused."""
    shutdown_grace: float = option(30.0, check=non_negative, metavar="SECONDS")
    """Seconds in-flight requests get to finish on SIGTERM or Ctrl-C before they are aborted."""
    max_waiting_requests: int | None = option(None, check=positive)
    """Refuse new requests (503 with Retry-After) while this many sequences wait to be scheduled
    (n > 1 and each prompt of a batch count one each). Default: max(max_num_seqs, 4 x KV-cache
    tokens // max_model_len), enough queued sequences to fill the KV cache four times at full
    context."""
    engine_core: Literal["auto", "thread", "process"] = "auto"
    """Where the engine core (scheduler, runner, device calls) runs: on a thread of the server's
    process, or in a process of its own, so that the HTTP event loop and detokenizing never
    share an interpreter with the steps. Default (auto): a process on a TPU or GPU, a thread on
    the CPU, the faster of the two on each as measured (docs/performance.md: the engine core on a
    thread or in a process of its own)."""
    request_timeout: float | None = option(None, check=positive, metavar="SECONDS")
    """Seconds from a request's arrival to its last token: past it the request is aborted (its KV
    freed) and the client gets a 504, or an error event in a stream. Default: no deadline."""
    enable_sleep_mode: bool = False
    """Serve POST /sleep, POST /wake_up and GET /is_sleeping (free and restore device memory)."""
    chat_template: str | None = None
    """A chat template (Jinja) replacing the model's: a file path or the template itself.
    Default: the model's."""
    enable_auto_tool_choice: bool = False
    """Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser."""
    tool_call_parser: str | None = option(None, choices=TOOL_PARSER_NAMES)
    """The model's tool-call format: hermes (Hermes, Qwen2.5/Qwen3 <tool_call> JSON), llama3_json
    (Llama 3.x), mistral ([TOOL_CALLS]), openai (gpt-oss's Harmony calls to functions.NAME; needs
    --reasoning-parser gpt_oss). Default: none (hermes renders tools for tool_choice "required"
    or a named function)."""
    disable_log_requests: bool = False
    """Do not log each request received."""
    uvicorn_log_level: Literal["debug", "info", "warning", "error", "critical", "trace"] | None = (
        None
    )
    """uvicorn's log level. Default: --log-level."""
    root_path: str | None = None
    """The path prefix a proxy serves this server under. Default: none."""
    ssl_keyfile: str | None = None
    """TLS private key file; with --ssl-certfile the server speaks HTTPS. Default: HTTP."""
    ssl_certfile: str | None = None
    """TLS certificate file (with --ssl-keyfile). Default: HTTP."""
    lora_modules: tuple[str, ...] | None = option(None, metavar="NAME=PATH")
    """LoRA adapters served at start (with --enable-lora), each NAME=PATH (a PEFT adapter
    directory): a model name in /v1/models whose parent is the base model; a request picks one
    by its "model". Default: none."""
    allow_runtime_lora_updating: bool = False
    """Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora), as
    vLLM does under VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: adapters added and removed while
    serving. Off: those routes do not exist (404)."""

    def __post_init__(self) -> None:
        run_checks(self)
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r}; available: "
                f"{', '.join(TOOL_PARSER_NAMES)}"
            )
        # Read now: a bad --chat-template stops `jaxserve serve` before the engine is built.
        self.chat_template_text  # noqa: B018

    @functools.cached_property
    def chat_template_text(self) -> str | None:
        """The operator's chat template (`chat_template`): the file's contents where it names a
        file, else the template itself (None: the model's). Resolved here, once, when the
        configuration is made: the flag's meaning is the configuration's, and every builder of
        the app (the command, tests, benchmarks) gets the same text from the same field."""
        value = self.chat_template
        if value is None:
            return None
        path = pathlib.Path(value)
        try:
            if path.is_file():
                return path.read_text()
        except OSError:
            pass
        if "{" not in value:
            raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        return value
