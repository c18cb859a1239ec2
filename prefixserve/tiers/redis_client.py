"""Connecting to the Redis server behind the remote tier: the client from a URL, the URL as messages
show it (no password), and what the server's memory settings mean for a cache."""

from __future__ import annotations

import urllib.parse
from typing import Any, Optional


def require_redis() -> Any:
    """The redis module, imported only when a remote tier is made, so the package imports without it."""
    try:
        import redis
    except ImportError:
        raise ImportError("the remote KV tier (kv_remote_url) needs redis-py. Fix: pip install 'redis>=5'") from None
    return redis


def connect(url: str, connect_timeout: float, read_timeout: float) -> Any:
    """A redis-py client (nothing is sent yet); ValueError naming the fix for a URL that is not Redis's."""
    redis = require_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    try:
        # One immediate retry, on a dropped connection only (a restarted Redis leaves pooled sockets dead).
        # Explicit, because some redis-py versions default to several retries with back-off: seconds of stall.
        return redis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=read_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            decode_responses=False,
        )
    except ValueError as error:
        raise ValueError(
            f"kv_remote_url {redacted(url)!r} is not a Redis URL ({error}). Fix: use "
            "redis://[:password@]host:port/db, rediss://... for TLS, or unix:///path.sock"
        ) from None


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urllib.parse.urlunsplit(parts._replace(netloc=user + netloc))


def memory_advice(info: dict, has_ttl: bool) -> Optional[str]:
    """What is wrong with a server's memory settings (INFO memory) for a cache, with the fix; None if nothing."""
    policy = str(info.get("maxmemory_policy", ""))
    if not int(info.get("maxmemory", 0)):
        return (
            "has no maxmemory, so records pile up until the host runs out of memory. Fix: set maxmemory "
            "(below the host's RAM) and maxmemory-policy allkeys-lru"
        )
    if policy == "noeviction" or (policy.startswith("volatile-") and not has_ttl):
        return f"evicts with {policy}, so it refuses writes once full. Fix: set maxmemory-policy allkeys-lru"
    return None
