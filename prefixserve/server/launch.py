"""`prefixserve serve`: build the engine and the app from command-line options, then run uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Optional

from ..config import EngineConfig
from ..http import DEFAULT_MAX_REQUEST_BYTES, load_api_keys

logger = logging.getLogger("prefixserve.server")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: built-in prefixserve-tiny)")
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require this API key (tenant 'default')")
    parser.add_argument("--api-keys-file", default=None, help='JSON file {"key": "tenant", ...}; each tenant gets its own cache scope')
    parser.add_argument("--admin-api-key", default=None,
                        help="the operator's key for /v1/kv_events and /v1/cache/* (what a router reads); without it those are off")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"request bodies over this many bytes get HTTP 413 before they are read (default {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--shared-prefix", default=None, help="text file of a system prompt every tenant may share from the cache")
    parser.add_argument("--max-waiting", type=int, default=256, help="waiting requests past which new ones get HTTP 429")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool budget (CPU default 2 GiB)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching (a baseline)")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"])
    parser.add_argument("--prefix-ttl", type=float, default=None, help="seconds an unused cached prefix lives")
    parser.add_argument("--enable-kv-events", action="store_true", help="publish KV events at /v1/kv_events (for the router)")
    parser.add_argument("--log-level", default="info")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        prefix_ttl=args.prefix_ttl,
        enable_kv_events=args.enable_kv_events,
    )


def build_server(args: argparse.Namespace):
    """The engine and the FastAPI app for these options (no socket yet)."""
    from ..engine.async_engine import AsyncLLMEngine
    from .api import ServerSettings, build_app

    config = engine_config_from_args(args)
    engine = AsyncLLMEngine(config)
    name = args.served_model_name or (Path(args.model).name if args.model else "prefixserve-tiny")
    if args.shared_prefix:
        text = Path(args.shared_prefix).read_text()
        tokenizer = engine.engine.tokenizer
        # Shared both as a chat system message and as the raw start of a completion prompt.
        as_system = tokenizer.encode_chat([{"role": "system", "content": text}], add_generation_prompt=False)
        blocks = engine.engine.declare_shared_prefix(as_system) + engine.engine.declare_shared_prefix(tokenizer.encode(text))
        logger.info("shared prefix %s: %d public blocks", args.shared_prefix, blocks)
    settings = ServerSettings(served_model_name=name, api_keys=load_api_keys(args.api_keys_file, args.api_key),
                              admin_api_key=args.admin_api_key, max_waiting=args.max_waiting,
                              max_request_bytes=args.max_request_bytes)
    return engine, build_app(engine, settings)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, app = build_server(args)  # the engine logs its model, dtype, device and KV pool
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0
