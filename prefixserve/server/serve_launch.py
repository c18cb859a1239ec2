"""`prefixserve serve`: check the options, hold the port, build the engine and the app, then run uvicorn.

Whatever a user can get wrong without loading the model (a flag's value, the --model directory,
the --shared-prefix and keys files, a busy port) is checked first and reported by its flag, in
a second, with no traceback. Only then does the model load, each stage logging what it does.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import time
from pathlib import Path
from typing import Optional

from ..config import CHECKPOINT_LAYOUT, DEFAULT_MAX_CACHE_TTL
from ..http_body import DEFAULT_MAX_REQUEST_BYTES
from ..http_keys import load_api_keys, load_tenant_cache_retentions, load_tenant_cache_ttls, load_tenant_shares
from .engine_flags import add_engine_arguments, engine_config_from_args, with_flag_names
from .lora_modules import LoRAModules, check_lora_flags, load_lora_modules, lora_module_flag
from .response_store import DEFAULT_MAX_STORED, DEFAULT_TTL

logger = logging.getLogger("prefixserve.server")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags, then the engine's (one per EngineConfig field: engine_flags.py)."""
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name clients send and responses carry (default: the --model directory's name, "
        "or prefixserve-tiny)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="listen address: 127.0.0.1 is this machine only, 0.0.0.0 every interface"
    )
    parser.add_argument("--port", type=_port_number, default=8000, help="listen port, checked before the model loads")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require this API key, as tenant 'default' (default: no key needed)",
    )
    parser.add_argument(
        "--api-keys-file",
        metavar="FILE",
        default=None,
        help='JSON {"key": "tenant", ...}; each tenant gets its own cache scope (default: none)',
    )
    parser.add_argument(
        "--admin-api-key",
        metavar="KEY",
        default=None,
        help="the operator's key for /v1/kv_events and /v1/cache/* (what a router reads), which are off "
        "without it; it opens /metrics too (default: none)",
    )
    parser.add_argument(
        "--metrics-api-key",
        metavar="KEY",
        default=None,
        help="a Prometheus scraper's key: it opens /metrics and nothing else. With --api-key or "
        "--api-keys-file, /metrics answers only this key or --admin-api-key (default: none)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="request bodies over this many bytes get HTTP 413 before they are read",
    )
    parser.add_argument(
        "--shared-prefix",
        metavar="FILE",
        default=None,
        help="UTF-8 text every tenant may share from the cache: the file's text with one trailing "
        "newline removed, declared both as a chat system message and as the start of a "
        "completion prompt (default: none)",
    )
    parser.add_argument(
        "--max-waiting", type=int, metavar="N", default=256, help="waiting requests past which new ones get HTTP 429"
    )
    parser.add_argument(
        "--max-cache-ttl",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_MAX_CACHE_TTL,
        help="cap on the cache_ttl a request body or a tenant's keys-file entry asks for",
    )
    parser.add_argument(
        "--responses-max-stored",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_STORED,
        help="stored Responses API responses (store: true) kept for previous_response_id and GET; past it the "
        "least recently used goes",
    )
    parser.add_argument(
        "--responses-ttl",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_TTL,
        help="seconds a stored Responses API response is kept after its last use",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=("auto", "hermes", "llama3_json"),
        help="how tool calls are read from a chat's output (vLLM's names); auto: the chat template's "
        "format, hermes when the template knows no tools (the server teaches it hermes)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module_flag,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under these model names, as vLLM takes them: name=path or "
        'JSON {"name": ..., "path": ...}; needs --enable-lora (default: none)',
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter to the admin key (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="engine and uvicorn logging")
    add_engine_arguments(parser.add_argument_group("engine (each flag an EngineConfig field)"))


def _port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535; 0 picks a free one)")
    return port


def build_server(args: argparse.Namespace):
    """The engine and the FastAPI app for these options (no socket yet)."""
    from ..engine.async_engine import AsyncLLMEngine
    from .api import build_app

    config = with_keys_file_shares(engine_config_from_args(args), args.api_keys_file)
    settings = server_settings_from_args(args)
    check_lora_flags(settings.lora_modules, config.enable_lora)
    engine = AsyncLLMEngine(config)
    load_lora_modules(settings.lora_modules, engine.engine)
    if args.shared_prefix:
        declare_shared_prefix(engine.engine, args.shared_prefix, read_shared_prefix(args.shared_prefix))
    return engine, build_app(engine, settings)


def with_keys_file_shares(config, api_keys_file: Optional[str]):
    """`config` with the shares the keys file's entries give (pin_share, min_kv_share, max_kv_share) beside
    --tenant-shares; SystemExit when both name one tenant or the shares cannot hold."""
    from dataclasses import replace

    from_file = load_tenant_shares(api_keys_file)
    if not from_file:
        return config
    both = sorted(set(from_file) & set(config.tenant_shares or {}))
    if both:
        raise SystemExit(f"prefixserve serve: --tenant-shares and --api-keys-file both give shares of {both}; give one")
    try:
        return replace(config, tenant_shares={**(config.tenant_shares or {}), **from_file})
    except ValueError as error:
        raise SystemExit(f"prefixserve serve: --api-keys-file {api_keys_file}: {error}") from None


def server_settings_from_args(args: argparse.Namespace):
    """The server's settings from its flags and keys file, validated: SystemExit names the flag at fault."""
    from .api import ServerSettings

    try:
        return ServerSettings(
            served_model_name=args.served_model_name or served_name_of(args.model),
            api_keys=load_api_keys(args.api_keys_file, args.api_key),
            admin_api_key=args.admin_api_key,
            metrics_api_key=args.metrics_api_key,
            max_waiting=args.max_waiting,
            max_request_bytes=args.max_request_bytes,
            max_cache_ttl=args.max_cache_ttl,
            tenant_cache_ttls=load_tenant_cache_ttls(args.api_keys_file),
            tenant_cache_retentions=load_tenant_cache_retentions(args.api_keys_file),
            tool_call_parser=args.tool_call_parser,
            responses_max_stored=args.responses_max_stored,
            responses_ttl=args.responses_ttl,
            lora_modules=LoRAModules(args.lora_modules, args.allow_runtime_lora_updating),
        )
    except ValueError as error:
        raise SystemExit(f"prefixserve serve: {error}") from None


class QuietPolls(logging.Filter):
    """Keeps successful polls (health checks, KV events, cache keys, scrapes) out of the access log
    unless it logs at debug: a router polls several times a second, and an idle server stays quiet."""

    PATHS = frozenset({"/health", "/metrics", "/v1/kv_events", "/v1/cache/keys", "/v1/cache/info"})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 5):
            return True
        path, status = str(args[2]).split("?", 1)[0], args[4]
        if path in self.PATHS and status == 200:
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..http_protocol import uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    began = time.perf_counter()
    check_options(args)
    sockets = bind_port(args.host, args.port)
    port = sockets[0].getsockname()[1]
    logger.info("holding %s port %d; starting the engine (the port answers once it is ready) ...", args.host, port)
    try:
        engine, app = build_server(args)  # the model loader and the engine log each stage
    except (OSError, ValueError) as error:
        for sock in sockets:
            sock.close()
        logger.debug("start-up failed", exc_info=True)
        raise SystemExit(f"prefixserve serve: {error}") from None
    logger.info("ready in %.1f s: http://%s:%d (OpenAI API under /v1)", time.perf_counter() - began, args.host, port)
    try:
        config = uvicorn_config(app, args.host, port, args.log_level)  # configures logging
        logging.getLogger("uvicorn.access").addFilter(QuietPolls())
        uvicorn.Server(config).run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; the shutdown was clean
        pass
    finally:
        engine.shutdown()
    return 0


# ------------------------------------------------------- checks before the model loads
def check_options(args: argparse.Namespace) -> None:
    """Every mistake that needs no model, reported by its flag (SystemExit, no traceback)."""
    try:
        engine_config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"prefixserve serve: {with_flag_names(str(error))}") from None
    if args.model is not None:
        check_model_dir(args.model)
    if args.shared_prefix:
        read_shared_prefix(args.shared_prefix)
    server_settings_from_args(args)  # the keys file and the server's own settings, as build_server reads them


def served_name_of(model: Optional[str]) -> str:
    """The name clients send by default: the model name, the .gguf file's stem, or the directory's name."""
    if model is None:
        return "prefixserve-tiny"
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def check_model_dir(model: str) -> None:
    from ..model.weights.named_models import NAMED_MODELS, named_model_file

    path = Path(model)
    if not path.exists() and model.lower() in NAMED_MODELS:
        try:
            named_model_file(model.lower())
        except FileNotFoundError as error:
            raise SystemExit(f"prefixserve serve: --model {model}: {error}") from None
        return
    if not path.exists():
        problem = "no such directory, file or model name"
    elif path.is_file():
        if path.suffix.lower() == ".gguf":
            return
        problem = "is a file but not a .gguf file"
    elif not (path / "config.json").is_file():
        if any(path.glob("*.gguf")):
            return
        problem = "has no config.json (and no .gguf file)"
    elif not any(path.glob("*.safetensors")):
        problem = "has no *.safetensors weights"
    else:
        return
    raise SystemExit(
        f"prefixserve serve: --model {model}: {problem}; pass {CHECKPOINT_LAYOUT}, "
        "or leave --model out for the built-in prefixserve-tiny"
    )


def bind_port(host: str, port: int) -> list[socket.socket]:
    """Bind host:port now, before the model loads, and keep the sockets for uvicorn.

    Bound but not yet listening, so a client is refused at once (not left hanging) until the
    engine is ready; uvicorn listens on these same sockets, so no other process can take the
    port in between. One socket per address the host resolves to, as uvicorn itself would bind.
    """
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise SystemExit(f"prefixserve serve: --host {host}: cannot resolve it ({error.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, protocol, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, protocol)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))  # port 0: the others take the one the first got
            port = sock.getsockname()[1]
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise SystemExit(f"prefixserve serve: {_bind_problem(error, host, port)}") from None
    return sockets


def _bind_problem(error: OSError, host: str, port: int) -> str:
    if error.errno == errno.EADDRINUSE:
        return (
            f"--port {port}: already in use on {host} (another server listens there); stop it or choose another --port"
        )
    if error.errno == errno.EACCES:
        return (
            f"--port {port}: permission denied on {host} (ports below 1024 need privileges); "
            "choose --port 1024 or above"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; use 127.0.0.1, 0.0.0.0 or one of its addresses"
    return f"--host {host} --port {port}: cannot listen there ({error.strerror or error})"


# ------------------------------------------------------------------ shared prefix
def read_shared_prefix(path: str) -> str:
    """The text a --shared-prefix file declares: its UTF-8 text with one trailing newline removed.

    Editors end a file with a newline that the system prompt clients send does not carry; a
    prefix is shared only if the client's tokens match it exactly.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SystemExit(f"prefixserve serve: --shared-prefix {path}: not UTF-8 text") from None
    except OSError as error:
        raise SystemExit(f"prefixserve serve: --shared-prefix {path}: cannot read it ({error.strerror})") from None
    text = text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
    if not text:
        raise SystemExit(
            f"prefixserve serve: --shared-prefix {path}: the file is empty; leave the flag out "
            "or write the shared system prompt into it"
        )
    return text


def declare_shared_prefix(core, path: str, text: str) -> None:
    """Declare `text` public in both forms a client may send it, logging what each form covers."""
    tokenizer, block_size = core.tokenizer, core.config.block_size
    forms = {
        "chat system message": tokenizer.encode_chat(
            [{"role": "system", "content": text}], add_generation_prompt=False
        ),
        "completion prompt": tokenizer.encode(text),
    }
    for form, token_ids in forms.items():
        num_blocks = core.declare_shared_prefix(token_ids)
        logger.info(
            "shared prefix %s as a %s: %d tokens, %d full blocks of %d shared by every tenant",
            path,
            form,
            len(token_ids),
            num_blocks,
            block_size,
        )
        if num_blocks == 0:
            logger.warning(
                "shared prefix %s as a %s is shorter than one block (%d tokens): nothing of it is shared",
                path,
                form,
                block_size,
            )
