"""The arguments of `prefixserve.ray:build_app`, checked before anything is deployed.

Ray Serve hands an application builder the `key=value` pairs of `serve run` as strings, or
the `args:` mapping of a `serve deploy` config file with YAML's types. Two kinds of key:

    the deployment's   num_replicas, num_cpus, num_gpus, memory, max_ongoing_requests,
                       ingress_replicas, ingress_resources, routing_stats_period_s,
                       prefill_replicas, local_prefill_tokens (P/D over the shared tier)
    the engine's       every `prefixserve serve` flag, spelled with underscores or dashes
                       (model=DIR, block_size=32, kv_remote_url=redis://..., api_keys_file=...);
                       a switch (`--no-prefix-caching`) takes true or false

A key that is neither, or a value its flag refuses, raises ValueError naming the key and the
fix, so `serve run` stops before a replica starts. Flags that only make sense for a process
of its own (host, port, log level) are refused: Serve's HTTP proxy owns the port; so is `role`, which
prefill_replicas sets.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

DEPLOYMENT_DEFAULTS: dict[str, Any] = {
    "num_replicas": 1,  # engine replicas, one engine each
    "num_cpus": 1.0,  # per engine replica (Ray's scheduling unit: one replica per node of 1 CPU)
    "num_gpus": 0.0,  # per engine replica
    "memory": None,  # bytes per engine replica reserved with Ray's scheduler; None: not reserved
    "max_ongoing_requests": 64,  # per engine replica, what Serve's router sends it at once
    "ingress_replicas": 1,  # the light deployment that reads bodies and routes them (no engine)
    "ingress_resources": None,  # custom Ray resources that place the ingress, e.g. {"head": 0.01}
    "routing_stats_period_s": 1.0,  # how often each replica reports its cached keys and queue to the routers
    "prefill_replicas": 0,  # > 0: prefill/decode disaggregation over the shared tier (needs kv_remote_url)
    "local_prefill_tokens": 0,  # with prefill replicas: prompts this short are prefilled where they decode
}
# serve flags that belong to a process with its own socket: Serve's proxy listens instead
PROCESS_FLAGS = {
    "host": "Serve's HTTP proxy listens (serve start --http-host/--http-port)",
    "port": "Serve's HTTP proxy listens (serve start --http-host/--http-port)",
    "log_level": "Ray's logging applies (RAY_SERVE_LOG_LEVEL or the config's logging_config)",
    "role": "give prefill_replicas=N: the prefill deployment takes role prefill, the engine replicas role decode",
}
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class RayAppArgs:
    num_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: Optional[int] = None
    max_ongoing_requests: int = 64
    ingress_replicas: int = 1
    ingress_resources: Optional[dict] = None
    routing_stats_period_s: float = 1.0
    prefill_replicas: int = 0
    local_prefill_tokens: int = 0
    serve_argv: tuple = field(default_factory=tuple)  # the engine's flags, as `prefixserve serve` parses them

    def serve_namespace(self) -> argparse.Namespace:
        """The flags parsed as `prefixserve serve` parses them (a replica builds its engine from these)."""
        return serve_parser().parse_args(list(self.serve_argv))

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    def role_argv(self, role: str) -> tuple:
        """The engine's flags for a replica of this role: prefill writes each prompt's KV to the shared tier
        before answering; decode fetches every block the tier holds (unless kv_fetch_policy was given)."""
        if role == "both":
            return self.serve_argv
        extra = ["--role", role]
        if role == "decode" and "--kv-fetch-policy" not in self.serve_argv:
            extra += ["--kv-fetch-policy", "always"]
        return (*self.serve_argv, *extra)


def serve_parser() -> argparse.ArgumentParser:
    from ..server.serve_launch import add_serve_arguments

    parser = argparse.ArgumentParser(prog="prefixserve.ray:build_app", add_help=False, exit_on_error=False)
    add_serve_arguments(parser)
    return parser


def parse_app_args(args: Mapping[str, Any]) -> RayAppArgs:
    """RayAppArgs from a builder's arguments; ValueError names the key at fault and what it takes."""
    if not isinstance(args, Mapping):
        raise ValueError(f"build_app takes key=value arguments, got {type(args).__name__}")
    deployment: dict[str, Any] = dict(DEPLOYMENT_DEFAULTS)
    argv: list[str] = []
    actions = _flag_actions()
    for raw_key, value in args.items():
        key = str(raw_key).replace("-", "_")
        if key in DEPLOYMENT_DEFAULTS:
            deployment[key] = _deployment_value(key, value)
        elif key in PROCESS_FLAGS:
            raise ValueError(f"build_app: {raw_key!r} is not taken under Ray Serve: {PROCESS_FLAGS[key]}")
        elif key in actions:
            argv.extend(_flag_words(raw_key, actions[key], value))
        else:
            raise ValueError(
                f"build_app: unknown argument {raw_key!r}; give a deployment option "
                f"({', '.join(DEPLOYMENT_DEFAULTS)}) or a `prefixserve serve` flag without its "
                f"dashes (model=DIR, block_size=32, ...)"
            )
    parsed = RayAppArgs(serve_argv=tuple(argv), **deployment)
    if parsed.disaggregated and "--kv-remote-url" not in argv:
        raise ValueError(
            "build_app: prefill_replicas needs kv_remote_url=redis://HOST:PORT, the shared tier through "
            "which prefill replicas hand each prompt's KV to the engine (decode) replicas"
        )
    check_serve_flags(list(parsed.role_argv("decode" if parsed.disaggregated else "both")))
    return parsed


def check_serve_flags(argv: list[str]) -> None:
    """The engine's and the server's settings as `serve` checks them before its model loads; the model path is
    left to the replicas (it must exist on their nodes, not necessarily on the one running `serve run`)."""
    from ..server.engine_flags import engine_config_from_args, with_flag_names
    from ..server.serve_launch import server_settings_from_args

    try:
        namespace = serve_parser().parse_args(argv)
        engine_config_from_args(namespace)
        server_settings_from_args(namespace)
    except (argparse.ArgumentError, SystemExit) as error:  # exit_on_error=False still exits on some errors
        raise ValueError(f"build_app: {error}") from None
    except ValueError as error:
        raise ValueError(f"build_app: {with_flag_names(str(error))}") from None


def _flag_actions() -> dict[str, tuple[argparse.Action, bool]]:
    """Each serve flag's action by its destination (block_size, enable_prefix_caching) and by its own name
    (no_prefix_caching); the flag says whether the key names the flag itself."""
    actions: dict[str, tuple[argparse.Action, bool]] = {}
    for action in serve_parser()._actions:
        if action.option_strings:
            actions.setdefault(action.dest, (action, False))
            for option in action.option_strings:
                actions.setdefault(option.lstrip("-").replace("-", "_"), (action, True))
    return actions


def _flag_words(key: str, found: tuple[argparse.Action, bool], value: Any) -> list[str]:
    action, names_flag = found
    flag = action.option_strings[-1]
    if action.nargs == 0:  # a switch: given or not (enable_prefix_caching=false gives --no-prefix-caching)
        wanted = _boolean(key, value)
        return [flag] if wanted == (True if names_flag else bool(action.const)) else []
    if isinstance(value, (dict, list)):  # a JSON flag given as YAML (kv_events_config: {...})
        value = json.dumps(value)
    return [flag, str(value)]


def _boolean(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"build_app: {key} is a switch: give true or false, not {value!r}")


def _deployment_value(key: str, value: Any):
    if key == "ingress_resources":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(
                    f"build_app: ingress_resources must be a JSON object of Ray resources, such as "
                    f"'{{\"head\": 0.01}}', not {value!r}"
                ) from None
        if value is not None and not (
            isinstance(value, dict)
            and all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in value.items()
            )
        ):
            raise ValueError(
                'build_app: ingress_resources maps resource names to positive amounts, such as {"head": 0.01}'
            )
        return value
    if key == "memory" and value in (None, "", "none", "None"):
        return None
    integer = key in (
        "num_replicas",
        "max_ongoing_requests",
        "ingress_replicas",
        "memory",
        "prefill_replicas",
        "local_prefill_tokens",
    )
    try:
        number = int(value) if integer else float(value)
        if isinstance(value, bool) or (integer and isinstance(value, float) and value != int(value)):
            raise ValueError
    except (TypeError, ValueError):
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"build_app: {key} must be {kind}, not {value!r}") from None
    if number < (0 if key in ("prefill_replicas", "local_prefill_tokens") or not integer else 1) or (
        key == "routing_stats_period_s" and number == 0
    ):
        least = (
            ("at least 0" if key in ("prefill_replicas", "local_prefill_tokens") else "at least 1")
            if integer
            else ("positive" if key == "routing_stats_period_s" else "at least 0")
        )
        raise ValueError(f"build_app: {key} must be {least}, not {value!r}")
    return number
