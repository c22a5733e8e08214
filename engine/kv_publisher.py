"""KV events over ZMQ, in vLLM 0.33.0's wire format, so a router written for vLLM's DP engines reads ours.

One PUB socket (and, if asked for, one replay ROUTER socket) per dp group, at the configured endpoint offset
by the group's fleet-wide dp rank (engine replica rank x dp + dp rank, so replicas on one node never share a
port) as vLLM's `ZmqEventPublisher.offset_endpoint_port` offsets by its global dp rank (tcp: port + rank;
inproc and ipc: a `_dp<N>` suffix; a tcp port 0 is left to the OS). A batch's `data_parallel_rank` is that
fleet-wide rank too. Each step's events of a group (tp rank 0's, the same list
the KV index and `/kv_events` get) are one batch: frames `topic`, 8-byte big-endian sequence number (per
group, from 0), msgpack `KVEventBatch`: a positional array `[ts, events, data_parallel_rank]` whose events
are tagged maps (`"type": "BlockStored"` ...), as vLLM 0.33.0 encodes them (msgspec: the batch `array_like`,
the events `tag=True`, all `omit_defaults`). The replay socket answers `[start seq]` (8 bytes, big-endian)
with `[topic, seq, payload]` for every buffered batch from `start` on, then `[b"", -1 (8 bytes, signed), b""]`.

The step loop never waits on ZMQ: `publish` puts the step's event list on a bounded queue; a background
thread converts, encodes, sends (PUB drops at its high-water mark; a subscriber sees the gap in the sequence
numbers and asks the replay socket) and keeps the last `kv_events_buffer_steps` batches for replay. When the
queue is full the batch is dropped and the group's next batch is a snapshot of the engine's index instead
(`AllBlocksCleared`, then every block it holds), so a consumer's view converges again.

Only full blocks go on the wire: vLLM never stores a partial block, and its consumers (llm-d, Dynamo) take
`block_size` tokens per hash, so a trailing partial block (which kvfleet's own `/kv_events` shows with its
token count) is left out, and so are its moves and its removal.

Tenant isolation (docs/http-api.md, /kv_events): a salted block's `token_ids` is empty, and `extra_keys`
carries the salt's label (engine/placement.py `salt_label`), never the salt, on the first block of a chain,
where vLLM puts the raw `cache_salt`.

The replay socket takes requests from any peer that reaches it: a malformed one is dropped (logged once per
doubling of their count), and a start past the buffer gets only the end marker; nothing a peer sends stops
the thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from engine.config import KVEventsConfig
from engine.errors import EngineError
from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent

log = logging.getLogger("kvfleet.engine")

MEDIUM = ("GPU", "CPU")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HWM = 100_000  # vLLM's KVEventsConfig.hwm default: batches a PUB socket queues per subscriber
MAX_QUEUE = 100_000  # vLLM's max_queue_size default: batches waiting for the thread
SHUTDOWN_TIMEOUT_S = 1.0
POLL_S = 0.1  # the thread's wait for a batch: how late a replay request may be answered (vLLM: 0.1 s)


# ---- the wire: the structs of vllm/distributed/kv_events.py in vLLM 0.33.0 -----------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A tagged map: `type` is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    # vLLM 0.33's later fields, never set here (the events follow one life cycle); declared so that a batch is
    # byte for byte what vLLM's structs encode (msgspec sizes a struct's map header by its field count)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def wire_events(events: list[KVEvent], block_size: int, label: Callable[[Any], str], partial: set[int],
                snapshot: bool = False) -> list[KVCacheEvent]:
    """A rank's events as vLLM events (a tier move is removed from one medium, stored on the other). `partial`
    is the group's partial blocks held (kept up to date here): they and their later events stay off the wire.
    A `snapshot`'s stored events are the index's full blocks (it carries no tokens and leaves partial ones out)."""
    out: list[KVCacheEvent] = []
    for ev in events:
        if ev.kind == CLEARED:
            partial.clear()
            out.append(AllBlocksCleared())
        elif ev.key in partial:
            if ev.kind == REMOVED:
                partial.discard(ev.key)
        elif ev.kind == REMOVED:
            out.append(BlockRemoved([ev.key], MEDIUM[ev.tier]))
        elif ev.kind == MOVED:
            out.append(BlockRemoved([ev.key], MEDIUM[1 - ev.tier]))
            out.append(BlockStored([ev.key], None, [], block_size, None, MEDIUM[ev.tier], None, [None]))
        elif ev.kind == STORED and not snapshot and len(ev.tokens) < block_size:
            partial.add(ev.key)
        elif ev.kind == STORED:
            salted = ev.salt is not None
            extra = (label(ev.salt),) if salted and ev.parent is None else None  # vLLM: the salt on a chain's first
            tokens = [] if salted else list(ev.tokens)  # a salted prompt is its tenant's: only keys leave
            out.append(BlockStored([ev.key], ev.parent, tokens, block_size, None, MEDIUM[ev.tier], None, [extra]))
    return out


# ---- endpoints ------------------------------------------------------------------------------------------
def offset_endpoint(endpoint: str, dp: int) -> str:
    """Group `dp`'s endpoint, as vLLM offsets a DP engine's: tcp port + dp (port 0 stays 0), inproc `_dp<N>`;
    ipc (where vLLM raises) gets the `_dp<N>` suffix too."""
    if not endpoint or dp == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{dp}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + dp}"


def endpoint_problem(endpoint: str, groups: int) -> str | None:
    """What is wrong with an endpoint for `groups` dp groups, or None."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None if endpoint.partition("://")[2] else "names no path"
    if not endpoint.startswith("tcp://"):
        return "must start with tcp://, ipc:// or inproc://"
    host, colon, port = endpoint[len("tcp://"):].rpartition(":")
    if not colon or not host or not port.isdigit():
        return "needs a host and a port, e.g. tcp://*:5557"
    top = int(port) + (groups - 1 if int(port) else 0)
    if top > 65535:
        return f"port {port} + {groups - 1} (one port per dp group of every engine replica) passes 65535"
    return None


def bind_here(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to any other (a consumer that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ---- the publisher --------------------------------------------------------------------------------------
@dataclass
class _Group:
    pub: zmq.Socket
    replay: zmq.Socket | None
    buffer: deque = field(default_factory=deque)  # (seq, payload), the last buffer_steps batches
    seq: int = 0  # the next batch's sequence number
    partial: set[int] = field(default_factory=set)  # partial blocks held: never on the wire (the thread's)


class KVEventPublisher:
    """Off (`kv_events_publisher: null`) it does nothing; on, `start` binds every group's sockets."""

    def __init__(self, config: KVEventsConfig, block_size: int, num_groups: int, index: Any,
                 label: Callable[[Any], str]) -> None:
        c = config
        self.enabled = c.publisher == "zmq"
        self.num_groups = num_groups
        self.endpoint, self.replay_endpoint = c.endpoint, c.replay_endpoint
        self.topic = c.topic.encode()
        self.buffer_steps = c.buffer_steps
        self.first_group = c.first_group  # the fleet-wide dp rank of group 0: the endpoints' offset
        self.block_size = block_size
        self.index = index  # the engine's KVIndex: what a snapshot after a dropped batch is made of
        self.label = label
        self.endpoints: list[tuple[str, str | None]] = []  # per group (PUB, replay) as bound: tcp port 0 resolved
        self.dropped = 0  # batches dropped because the queue was full
        self.bad_requests = 0  # malformed replay requests dropped
        self._lost = [False] * num_groups
        self._queue: queue.Queue = queue.Queue(MAX_QUEUE)
        self._groups: list[_Group] = []
        self._ctx: zmq.Context | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- the engine's side (the step loop) --------------------------------------------------------------
    def start(self) -> None:
        """Bind (or connect) every group's sockets and start the thread; a bad endpoint fails here, named."""
        if not self.enabled or self._thread is not None:
            return
        self._ctx = zmq.Context()
        try:
            for dp in range(self.num_groups):
                self._groups.append(self._open(dp))
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, dp: int, events: list[KVEvent]) -> None:
        """Queue one step's events of group `dp` as one batch; never blocks (a full queue drops it)."""
        if self._thread is None or not events:
            return
        seed = None
        if self._lost[dp]:
            events, seed = self._snapshot(dp)  # the index already holds this step's events
        try:
            self._queue.put_nowait((dp, time.time(), events, seed))
            self._lost[dp] = False
        except queue.Full:
            self._lost[dp] = True
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: one line per doubling
                log.warning("kv events: queue full, dropped %d batches; dp group %d resyncs", self.dropped, dp)

    def cleared(self, dp: int) -> None:
        self.publish(dp, [KVEvent(CLEARED)])

    def flush(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Wait until every batch queued so far is sent; False after timeout_s."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def last_seq(self, dp: int) -> int:
        """The sequence number of group `dp`'s last sent batch (-1: none); read it after `flush`."""
        return self._groups[dp].seq - 1 if self._groups else -1

    def close(self) -> None:
        """Send what is queued (for up to a second, as vLLM), stop the thread, close the sockets."""
        if self._thread is None:
            return
        self.flush()
        self._stop = True
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._thread = None
        self._close_sockets()

    def _snapshot(self, dp: int) -> tuple[list[KVEvent], set[int]]:
        """The index's full blocks as events, and its partial blocks (kept off the wire from now on)."""
        if self.index.resync[dp]:
            return [KVEvent(CLEARED)], set()
        partial = set(self.index.partial[dp])
        held = [(key, tier) for key, tier in self.index.blocks[dp].items() if key not in partial]
        return [KVEvent(CLEARED)] + [KVEvent(STORED, key, tier=tier) for key, tier in held], partial

    def _open(self, dp: int) -> _Group:
        rank = self.first_group + dp
        ep = offset_endpoint(self.endpoint, rank)
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(HWM)
        replay, replay_at = None, None
        try:
            pub_at = self._attach(pub, ep, "kv_events_endpoint", dp, bind_here(ep))
            if self.replay_endpoint:
                rep = offset_endpoint(self.replay_endpoint, rank)
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))  # a whole replay and its end marker
                replay_at = self._attach(replay, rep, "kv_events_replay_endpoint", dp, True)
        except BaseException:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            raise
        self.endpoints.append((pub_at, replay_at))
        log.info("kv events: dp group %d publishes on %s (replay %s, topic %r)", dp, pub_at, replay_at or "off",
                 self.topic.decode())
        return _Group(pub, replay, deque(maxlen=self.buffer_steps))

    @staticmethod
    def _attach(sock: zmq.Socket, ep: str, setting: str, dp: int, bind: bool) -> str:
        try:
            sock.bind(ep) if bind else sock.connect(ep)
        except zmq.ZMQError as e:
            raise EngineError(f"{setting}: dp group {dp} cannot {'bind' if bind else 'connect'} {ep}: {e}") from e
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) if bind else ep

    def _close_sockets(self) -> None:
        for g in self._groups:
            g.pub.close(linger=0)
            if g.replay is not None:
                g.replay.close(linger=0)
        self._groups = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        replays = {}
        for g in self._groups:
            if g.replay is not None:
                poller.register(g.replay, zmq.POLLIN)
                replays[g.replay] = g
        while not self._stop:
            for sock, _ in poller.poll(0) if replays else ():
                try:
                    self._serve_replay(replays[sock])
                except Exception:  # a peer's request never ends the thread that publishes every group
                    log.exception("kv events: a replay request failed")
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, threading.Event):
                item.set()
                continue
            dp, ts, events, seed = item
            g = self._groups[dp]
            try:
                wire = wire_events(events, self.block_size, self.label, g.partial, snapshot=seed is not None)
                if seed is not None:
                    g.partial |= seed
                if wire:  # a step that stored only a partial block sends nothing (as vLLM: no empty batch)
                    self._send(g, encoder.encode(KVEventBatch(ts, wire, self.first_group + dp)))
            except Exception:
                log.exception("kv events: dp group %d: a batch was not sent", dp)

    def _send(self, g: _Group, payload: bytes) -> None:
        seq = g.seq
        g.seq += 1
        g.buffer.append((seq, payload))
        g.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _serve_replay(self, g: _Group) -> None:
        """One replay request: every buffered batch from its start seq on, then the end marker. A request that
        is not [identity, empty, 8-byte seq] is dropped: the ROUTER socket takes whatever any peer sends."""
        frames = g.replay.recv_multipart()
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            self.bad_requests += 1
            if self.bad_requests & (self.bad_requests - 1) == 0:  # 1, 2, 4, ...: one line per doubling
                log.warning("kv events: dropped %d malformed replay requests (expected identity, empty, "
                            "8-byte seq; the last had %d frames)", self.bad_requests, len(frames))
            return
        client, _, start = frames
        first = g.buffer[0][0] if g.buffer else g.seq
        skip = min(len(g.buffer), max(0, int.from_bytes(start, "big") - first))  # past the buffer: nothing to send
        for seq, payload in itertools.islice(g.buffer, skip, None):
            g.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        g.replay.send_multipart((client, b"", b"", END_SEQ, b""))
