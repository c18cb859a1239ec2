"""How the remote tier's commands reach Redis (RedisCommands): per server, one pipelined round trip,
through that server's back-off (redis_backoff.py); on a cluster, a server per master (redis_nodes.py), and a MOVED
reply refreshes the slot map, or switches a single-server client to the cluster's."""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence

from .redis_backoff import Backoff
from .redis_nodes import NodeGroup, cluster_nodes, is_moved

logger = logging.getLogger("prefixserve.tiers")

BACKOFF_SECONDS = 1.0  # after a fault, calls skip Redis this long before one probe


class MemoryInfo(NamedTuple):
    used_bytes: int
    max_bytes: int  # 0: no maxmemory
    read_at: float


class RedisCommands:
    """The tier's connection to Redis: the servers (one, or a cluster's masters, swapped for a cluster's when a
    single-server client meets MOVED), their back-offs, and the calls through them. Faults and refusals are
    counted and logged through the tier's `count` and `log_once`; none reaches the caller."""

    def __init__(
        self,
        nodes: Any,
        url: str,
        connect: tuple[str, float, float, Callable[[], float]],
        backoff: Backoff,
        faults: tuple[type[BaseException], ...],
        out_of_memory: type[BaseException],
        count: Callable[..., None],
        log_once: Callable[..., None],
    ) -> None:
        self.url = url  # redacted: for logs
        self._nodes = nodes
        self._connect = connect  # (the URL as given, connect timeout, read timeout, clock): to reach a cluster
        self._backoff = backoff
        self._faults = faults  # a call that raises one of these opens or extends a back-off episode
        self._out_of_memory = out_of_memory
        self._count = count
        self._log_once = log_once

    @property
    def is_cluster(self) -> bool:
        return self._nodes.is_cluster

    @property
    def all_backing_off(self) -> bool:
        return self._nodes.all_backing_off

    def close(self) -> None:
        self._nodes.close()

    def pipeline(
        self, operation: str, names: Sequence[bytes], queue: Callable[[Any, bytes], object], per_name: int = 1
    ) -> Optional[list[Any]]:
        """`queue(pipe, name)` queues `per_name` commands for each name; they run in one round trip per server
        (redis_nodes.py), the replies in the names' order. None when no server answered (a fault, or backing
        off); on a cluster, a master that did not answer leaves None for its names' replies. A command Redis
        refused (OOM, READONLY, WRONGTYPE) comes back as its error, counted and logged once."""
        replies: list[Any] = [None] * (len(names) * per_name)
        answered = False
        for group in self._nodes.split(names):
            got = self._call(operation, self._run_group(group, names, queue), group)
            if got is None:
                self._nodes.node_failed()
                continue
            answered = True
            for position, index in enumerate(group.indices):
                replies[index * per_name : (index + 1) * per_name] = got[
                    position * per_name : (position + 1) * per_name
                ]
        if not answered:
            return None
        if any(is_moved(reply) for reply in replies):
            self._moved(replies)
        for reply in replies:
            if isinstance(reply, Exception):
                self._count(errors=1)
                fix = (
                    "set maxmemory-policy allkeys-lru, so Redis evicts instead of refusing writes"
                    if isinstance(reply, self._out_of_memory)
                    else "point kv_remote_url at a writable primary and a database used only by prefixserve"
                )
                self._log_once(
                    operation,
                    type(reply).__name__,
                    "remote tier: Redis at %s refused a %s command (%s: %s). Fix: %s",
                    self.url,
                    operation,
                    type(reply).__name__,
                    reply,
                    fix,
                )
        return replies

    @staticmethod
    def _run_group(group: NodeGroup, names: Sequence[bytes], queue: Callable[[Any, bytes], object]):
        def run() -> list[Any]:
            pipe = group.client.pipeline(transaction=False)
            for index in group.indices:
                queue(pipe, names[index])
            return pipe.execute(raise_on_error=False)

        return run

    def _moved(self, replies: list[Any]) -> None:
        """MOVED or ASK replies: the commands were misses; a single-server client learns it talks to a cluster
        node and switches, a cluster client refreshes its slot map."""
        self._count(errors=sum(1 for reply in replies if is_moved(reply)))
        for index, reply in enumerate(replies):
            if is_moved(reply):
                replies[index] = None
        if self._nodes.is_cluster:
            self._nodes.moved()
            return
        url, connect_timeout, read_timeout, clock = self._connect
        logger.warning(
            "remote tier: Redis at %s answered MOVED: it is a Redis Cluster node; the tier now sends "
            "each key to its master",
            self.url,
        )
        try:
            nodes = cluster_nodes(url, connect_timeout, read_timeout, BACKOFF_SECONDS, clock)
        except self._faults as error:
            logger.warning(
                "remote tier: connecting to the Redis Cluster at %s failed (%s: %s); retried at the next MOVED reply",
                self.url,
                type(error).__name__,
                error,
            )
            return
        old, self._nodes = self._nodes, nodes
        old.close()

    def scan(self, operation: str, prefix: bytes) -> Optional[list[bytes]]:
        """Every name starting with `prefix`, on every server (SCAN); None when none answered."""
        found, answered = [], False
        for group in self._nodes.every_node():
            names = self._call(
                operation, lambda group=group: list(group.client.scan_iter(match=prefix + b"*", count=1000)), group
            )
            if names is not None:
                answered = True
                found += names
        return found if answered else None

    def _call(self, operation: str, call: Callable[[], Any], group: Optional[NodeGroup] = None) -> Any:
        """`call()`, or None while backing off or on a fault (which opens or extends an episode) of the server
        `group` names (the tier's own server by default)."""
        backoff, where = (self._backoff, f"Redis at {self.url}") if group is None else (group.backoff, group.where)
        if not backoff.try_begin():
            return None
        try:
            result = call()
        except self._faults as error:
            self._count(errors=1)
            if backoff.failed():
                logger.warning(
                    "remote tier: %s failed during %s (%s: %s); lookups miss and writes are dropped until it "
                    "answers again (retried every %.0f s, faults counted in stats.errors). Fix: "
                    "check that redis-server is running and reachable, and the URL's host, port, database and password",
                    where,
                    operation,
                    type(error).__name__,
                    error,
                    BACKOFF_SECONDS,
                )
            return None
        episode = backoff.succeeded()
        if episode is not None:
            logger.warning(
                "remote tier: %s answers again after %.1f s (%d failed calls)",
                where,
                episode.seconds,
                episode.num_faults,
            )
        return result

    def read_memory(self, operation: str) -> Optional[dict]:
        """INFO memory of every server, summed (a cluster's masters; 0 maxmemory if any has none)."""
        infos = [
            info
            for group in self._nodes.every_node()
            if (info := self._call(operation, lambda group=group: group.client.info("memory"), group)) is not None
        ]
        if not infos:
            return None
        limits = [int(info["maxmemory"]) for info in infos]
        total = {
            "used_memory": sum(int(info["used_memory"]) for info in infos),
            "maxmemory": 0 if 0 in limits else sum(limits),
            "maxmemory_policy": next(
                (info["maxmemory_policy"] for info in infos if info.get("maxmemory_policy") != "allkeys-lru"),
                infos[0].get("maxmemory_policy", ""),
            ),
        }
        return total
