"""The engine's KV events published over ZMQ in vLLM's wire format (kv_event_wire.py), so vllm-router's
kv_aware policy, llm-d's kv-cache indexer and Dynamo's ZMQ relay read a prefixserve replica unchanged.

    engine thread:     cache events -> EventQueue (cache/events.py); step_done() as each step begins
    publisher thread:  EventQueue.since(cursor) -> one KVEventBatch -> PUB (topic, seq, payload)
                       a ROUTER socket (replay_endpoint) answers "every batch from seq N on" from a buffer

The publisher reads the queue with its own cursor, so GET /v1/kv_events (the same queue) loses nothing.
Events reach the queue from tier threads too (host and disk writes); the thread also wakes every 50 ms,
so those leave while the engine idles. If events the publisher never read were dropped (the queue is
bounded by max_queue_size), it publishes AllBlocksCleared first: a subscriber forgets this replica's
blocks and learns them again from new events, instead of trusting an index with holes.

Token ids leave the process here: the endpoint is loopback by default, and any other is the operator's
choice (logged at start-up). pyzmq and msgspec are optional (pip install 'prefixserve[kv-events]').
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections import deque
from typing import Optional
from urllib.parse import urlsplit

from ..cache.events import AllBlocksCleared, EventQueue
from ..config import EngineConfig, KVEventsConfig

logger = logging.getLogger("prefixserve")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
IDLE_WAKE_SECONDS = 0.05
MISSING_DEPENDENCIES = (
    "kv_events_config with publisher 'zmq' needs pyzmq and msgspec, which are optional: "
    "pip install 'prefixserve[kv-events]' (or set publisher to 'null')"
)


def endpoint_host(endpoint: str) -> Optional[str]:
    """The host of a tcp:// endpoint ('*' for a wildcard); None for ipc:// and inproc://."""
    if not endpoint.startswith("tcp://"):
        return None
    return "*" if "*" in endpoint else urlsplit(endpoint).hostname


def is_loopback(endpoint: str) -> bool:
    host = endpoint_host(endpoint)
    if host is None:
        return endpoint.startswith(("ipc://", "inproc://"))  # this machine's own sockets
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def binds(endpoint: str) -> bool:
    """vLLM binds wildcard, ipc and inproc endpoints and connects to the rest; a loopback endpoint (our
    default) binds too, so subscribers on this machine connect to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")) or is_loopback(endpoint)


class NullKVEventPublisher:
    """Events are off, or kept for GET /v1/kv_events only (publisher "null")."""

    endpoint: Optional[str] = None
    replay_endpoint: Optional[str] = None
    num_batches = 0

    def step_done(self) -> None:
        pass

    def flush(self, timeout: float = 1.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class ZmqKVEventPublisher:
    """A PUB socket (and an optional ROUTER for replay) fed from the engine's EventQueue by one thread."""

    def __init__(self, config: KVEventsConfig, events: EventQueue, data_parallel_rank: int = 0) -> None:
        try:
            import zmq

            from .kv_event_wire import WireTranslator, encoder
        except ImportError:
            raise ValueError(MISSING_DEPENDENCIES) from None
        self._zmq = zmq
        self.config = config
        self._events = events
        self._translator = WireTranslator(data_parallel_rank)
        self._encoder = encoder()
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._cursor = events.next_seq  # events before the publisher existed were never a subscriber's
        self.num_batches = 0  # the next batch's sequence number
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self.endpoint = self._open(self._pub, config.endpoint)
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._open(self._replay, config.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint!r} ({error}); choose a free port "
                "(port 0 picks one) or another endpoint"
            ) from None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="prefixserve-kv-events", daemon=True)
        self._thread.start()

    def _open(self, socket, endpoint: str) -> str:
        """Bind or connect as `binds` says; a tcp port of 0 binds a free port. Returns the endpoint in use."""
        if not binds(endpoint):
            socket.connect(endpoint)
            return endpoint
        if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0":
            base = endpoint.rsplit(":", 1)[0]
            port = socket.bind_to_random_port(base)
            return f"{base}:{port}"
        socket.bind(endpoint)
        return endpoint

    # ----------------------------------------------------------- engine side
    def step_done(self) -> None:
        """Called by the engine as each step begins: what the previous step stored and removed goes out."""
        self._wake.set()

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every event queued so far is published (tests, shutdown); False on timeout."""
        target = self._events.next_seq
        with self._idle:
            self._wake.set()
            return self._idle.wait_for(lambda: self._cursor >= target or self._stopped.is_set(), timeout)

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self.flush()
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)

    # -------------------------------------------------------- publisher side
    def _loop(self) -> None:
        poller = None
        if self._replay is not None:
            poller = self._zmq.Poller()
            poller.register(self._replay, self._zmq.POLLIN)
        while not self._stopped.is_set():
            self._wake.wait(IDLE_WAKE_SECONDS)
            self._wake.clear()
            try:
                if poller is not None:
                    while poller.poll(0):
                        self._answer_replay()
                self._publish_new()
            except Exception:  # a broken socket or event must not stop the engine: log and go on
                logger.exception("publishing KV events failed; the next step's events are tried again")

    def _publish_new(self) -> None:
        events, next_seq, complete = self._events.since(self._cursor)
        if not complete:
            logger.warning(
                "KV events were dropped before they were published (max_queue_size %d); "
                "subscribers are told AllBlocksCleared and relearn this replica from new events",
                self.config.max_queue_size,
            )
            events = [AllBlocksCleared(), *events]
        if events:
            payload = self._encoder.encode(self._translator.batch(events))
            seq = self.num_batches.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload), copy=False)
            self._buffer.append((self.num_batches, payload))
            self.num_batches += 1
        with self._idle:
            self._cursor = next_seq
            self._idle.notify_all()

    def _answer_replay(self) -> None:
        """vLLM's replay: [client, b"", start seq (8 bytes)] -> each buffered (topic, seq, payload) from
        there, then an end marker (b"", -1, b"")."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


def kv_event_queue(config: EngineConfig) -> Optional[EventQueue]:
    """The queue of cache events, kept for GET /v1/kv_events and for the ZMQ publisher; None if neither wants it."""
    publishing = config.kv_events_config is not None and config.kv_events_config.enable_kv_cache_events
    if not (config.enable_kv_events or publishing):
        return None
    return EventQueue(max(20_000, config.kv_events_config.max_queue_size) if publishing else 20_000)


def make_kv_event_publisher(config: Optional[KVEventsConfig], events: Optional[EventQueue]):
    """The publisher the config asks for; a null one unless events are enabled with publisher "zmq"."""
    if config is None or not config.publishes or events is None:
        return NullKVEventPublisher()
    publisher = ZmqKVEventPublisher(config, events)
    if is_loopback(publisher.endpoint):
        logger.info("KV events (vLLM format) published at %s", publisher.endpoint)
    else:
        logger.warning(
            "KV events (vLLM format) published at %s: the token ids of every cached prompt leave the "
            "process there; keep that port on the operator's network",
            publisher.endpoint,
        )
    return publisher
