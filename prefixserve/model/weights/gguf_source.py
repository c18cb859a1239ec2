"""What a GGUF conversion leaves in its directory, read without the gguf reader (no numpy import).

The loader asks this on every load: a directory converted from a GGUF file is
fingerprinted by that file's hash rather than by rehashing its weights.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SOURCE_FILE = "prefixserve_source.json"


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_gguf_source(directory: str | Path) -> dict[str, Any] | None:
    """The record a conversion left in ``directory`` (file name, size, sha256, converter version,
    tensor types), or None when the directory was not converted from a GGUF."""
    record = read_json_object(Path(directory) / SOURCE_FILE)
    return record if record.get("format") == "gguf" and record.get("sha256") else None


def gguf_fingerprint(directory: str | Path) -> str | None:
    """Hex SHA-256 naming a converted checkpoint by its source: the GGUF's hash and the converter
    version (the conversion is deterministic). None when ``directory`` holds no conversion."""
    record = read_gguf_source(directory)
    if record is None:
        return None
    return hashlib.sha256(f"gguf\0{record['sha256']}\0{record['converter_version']}".encode()).hexdigest()
