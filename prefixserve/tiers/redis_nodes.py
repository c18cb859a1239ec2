"""Which Redis server each of the remote tier's commands goes to: one server, or the masters of a Redis Cluster.

    one server      every command in one pipeline, one back-off (redis_backoff.py) for the tier
    Redis Cluster   the names grouped by the master that owns their slot (CRC16 of the whole name: no hash
                    tag, so a model's records spread over every master), one pipeline and one back-off per
                    master: a master that fails costs its own keys' hits, never the others'

`connect_nodes` tells them apart by asking the server (INFO cluster); a single-server client that later gets
MOVED replies (the server turned out to be a cluster node) switches over (RedisTier calls `to_cluster`).

On a cluster a fault, or a MOVED or ASK reply (a failover or resharding moved the slot), refreshes the slot map
from any master that answers, at most once per back-off interval; the commands that met it were misses, or
dropped writes, and the next ones go to the new owner. SCAN and INFO memory go to every master; the tier's used
and maximum bytes are their sums.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .redis_backoff import Backoff
from .redis_client import require_redis

logger = logging.getLogger("prefixserve.tiers")


@dataclass
class NodeGroup:
    """Commands for one server: where (for messages), its client, its back-off, the names' indices."""

    where: str
    client: Any
    backoff: Backoff
    indices: list[int] = field(default_factory=list)


class SingleNode:
    is_cluster = False

    def __init__(self, client: Any, where: str, backoff: Backoff) -> None:
        self.client, self.where, self.backoff = client, where, backoff

    def split(self, names: Sequence[bytes]) -> list[NodeGroup]:
        return [NodeGroup(self.where, self.client, self.backoff, list(range(len(names))))]

    def every_node(self) -> list[NodeGroup]:
        return [NodeGroup(self.where, self.client, self.backoff)]

    @property
    def all_backing_off(self) -> bool:
        return self.backoff.is_backing_off

    def node_failed(self) -> None:
        pass

    def moved(self) -> None:
        pass

    def close(self) -> None:
        self.client.close()


class ClusterNodes:
    is_cluster = True

    def __init__(self, cluster: Any, seconds: float, clock: Callable[[], float]) -> None:
        self.cluster = cluster
        self._seconds, self._clock = seconds, clock
        self._backoffs: dict[str, Backoff] = {}
        self._refresh_after = float("-inf")

    def _group(self, node: Any) -> NodeGroup:
        backoff = self._backoffs.get(node.name)
        if backoff is None:
            backoff = self._backoffs[node.name] = Backoff(self._seconds, self._clock)
        return NodeGroup(
            f"cluster master {node.name}", node.redis_connection or self.cluster.get_redis_connection(node), backoff
        )

    def split(self, names: Sequence[bytes]) -> list[NodeGroup]:
        """The names' indices grouped by the master owning each one's slot (the client's slot map)."""
        groups: dict[str, NodeGroup] = {}
        for index, name in enumerate(names):
            node = self.cluster.get_node_from_key(name)
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = self._group(node)
            group.indices.append(index)
        return list(groups.values())

    def every_node(self) -> list[NodeGroup]:
        return [self._group(node) for node in self.cluster.get_primaries()]

    @property
    def all_backing_off(self) -> bool:
        backoffs = [self._backoffs.get(node.name) for node in self.cluster.get_primaries()]
        return bool(backoffs) and all(backoff is not None and backoff.is_backing_off for backoff in backoffs)

    def node_failed(self) -> None:
        """A master failed: its replica may take over; ask the cluster who owns what (at most once per interval)."""
        self._refresh()

    def moved(self) -> None:
        """A MOVED or ASK reply: the slot map is stale."""
        self._refresh()

    def _refresh(self) -> None:
        now = self._clock()
        if now < self._refresh_after:
            return
        self._refresh_after = now + self._seconds
        try:
            self.cluster.nodes_manager.initialize()
        except Exception as error:  # no master answers now: the next interval tries again
            logger.info(
                "remote tier: refreshing the Redis Cluster slot map failed (%s: %s)", type(error).__name__, error
            )

    def close(self) -> None:
        self.cluster.close()


def connect_nodes(
    client: Any,
    url: str,
    connect_timeout: float,
    read_timeout: float,
    backoff: Backoff,
    where: str,
    clock: Callable[[], float],
):
    """SingleNode over `client`, or ClusterNodes when the server says it is a cluster node. A server that does
    not answer yet is taken as a single one (a MOVED reply switches later)."""
    try:
        enabled = int(client.info("cluster").get("cluster_enabled", 0))
    except Exception:
        return SingleNode(client, where, backoff)
    if not enabled:
        return SingleNode(client, where, backoff)
    client.close()
    return cluster_nodes(url, connect_timeout, read_timeout, backoff.seconds, clock)


def cluster_nodes(
    url: str, connect_timeout: float, read_timeout: float, seconds: float, clock: Callable[[], float] = time.monotonic
) -> ClusterNodes:
    """A RedisCluster client for the cluster `url`'s node belongs to. Its own retries are off: a failed command
    ends the call, and the tier's per-master back-off and slot-map refresh take over."""
    redis = require_redis()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    cluster = redis.cluster.RedisCluster.from_url(
        url,
        socket_connect_timeout=connect_timeout,
        socket_timeout=read_timeout,
        decode_responses=False,
        retry=Retry(NoBackoff(), 0),
        require_full_coverage=False,
    )
    return ClusterNodes(cluster, seconds, clock)


def is_moved(reply: Any) -> bool:
    """A MOVED or ASK error reply (redis-py's MovedError, a kind of AskError)."""
    return isinstance(reply, require_redis().exceptions.AskError)
