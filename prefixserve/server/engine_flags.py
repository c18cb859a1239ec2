"""The engine's command-line flags, built from EngineConfig's fields: a field's name with dashes is its
flag, its default the flag's default and its metadata (config.option) the help, metavar or choices.
A new config field is a new flag; nothing here restates a default.

    bool, default False   --enable-kv-events          store_true
    bool, default True    --no-prefix-caching         the field's own flag name; given, it turns the field off
    anything else         --block-size N              type from the annotation (Optional[...] may be left out)
    metadata parse=F      --kv-events-config JSON     F turns the text into the field's value
"""

from __future__ import annotations

import argparse
import re
import typing
from dataclasses import Field, fields
from typing import Optional

from ..config import EngineConfig

_TYPES = {int: int, float: float, str: str}


def flag_of(item: Field) -> str:
    return item.metadata.get("flag", "--" + item.name.replace("_", "-"))


def _parser_of(parse):
    """argparse shows a ValueError as "invalid value"; the parser's own message names the fix."""

    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse_flag


def _value_type(item: Field):
    if "parse" in item.metadata:
        return _parser_of(item.metadata["parse"])
    annotation = typing.get_type_hints(EngineConfig)[item.name]
    candidates = [arg for arg in typing.get_args(annotation) if arg is not type(None)] or [annotation]
    if len(candidates) != 1 or candidates[0] not in (*_TYPES, bool):
        raise TypeError(f"EngineConfig.{item.name}: no flag for a field of type {annotation}")
    return candidates[0]


def add_engine_argument(parser: argparse._ActionsContainer, name: str) -> None:
    """Add EngineConfig field `name`'s flag to `parser` (or an argument group)."""
    item = next(item for item in fields(EngineConfig) if item.name == name)
    kind, help_text = _value_type(item), item.metadata["help"]  # the CLI's formatter adds the default
    if kind is bool:
        parser.add_argument(
            flag_of(item), dest=item.name, action="store_false" if item.default else "store_true", help=help_text
        )
        return
    options = {key: item.metadata[key] for key in ("metavar", "choices") if key in item.metadata}
    parser.add_argument(
        flag_of(item), dest=item.name, type=_TYPES.get(kind, kind), default=item.default, help=help_text, **options
    )


def add_engine_arguments(parser: argparse._ActionsContainer) -> None:
    """Every EngineConfig field's flag, in the dataclass's order."""
    for item in fields(EngineConfig):
        add_engine_argument(parser, item.name)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The config the parsed flags give (fields with no flag in `args` keep their defaults)."""
    options: dict[str, Optional[object]] = {
        item.name: getattr(args, item.name) for item in fields(EngineConfig) if hasattr(args, item.name)
    }
    options.update(overrides)
    return EngineConfig(**options)


def with_flag_names(message: str) -> str:
    """EngineConfig speaks in field names (block_size); a CLI user typed flags (--block-size)."""
    for item in sorted(
        (item for item in fields(EngineConfig) if "_" in item.name), key=lambda item: len(item.name), reverse=True
    ):
        message = re.sub(rf"(?<![\w-]){item.name}\b", flag_of(item), message)
    return message
