"""A KV event consumer as a vLLM router would write it, run as its own process by
tests/unit/engine/test_kv_publisher.py.

The structs are vLLM 0.33.0's (vllm/distributed/kv_events.py), written out here, not imported from kvfleet,
and stricter: an unknown field fails the decode. Per dp group it subscribes to the PUB socket and treats the
first live batch as lost, so the next one shows a gap that it fills from the replay socket (a DEALER: a REQ
socket takes one reply per request). It rebuilds the index (block hash -> tier) and, once the line
`{"last": [seq per group]}` arrives on stdin and every group has reached it (from replay if need be), prints
the index and its counts as one JSON line.

argv[1]: JSON {"pub": [endpoint per group], "replay": [...], "topic": str, "secrets": [salts that must never
appear in a payload]}.
"""

import json
import sys
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
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


TIER = {"GPU": 0, "CPU": 1}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
WAIT_MS = 20_000


class Group:
    def __init__(self, ctx: zmq.Context, dp: int, pub: str, replay: str, topic: bytes, secrets: list[bytes]) -> None:
        self.dp, self.topic, self.secrets = dp, topic, secrets
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(pub)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.last = -1
        self.dropped_one = False
        self.index: dict[int, int] = {}
        self.counts = {"batches": 0, "replayed": 0, "replays": 0, "stored": 0, "removed": 0, "cleared": 0,
                       "cpu_stored": 0, "labelled": 0}
        self.labels: set = set()
        self.tokens: dict[int, int] = {}  # block hash -> tokens its last BlockStored carried

    def live(self, decoder: msgspec.msgpack.Decoder) -> None:
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic, topic
        seq = int.from_bytes(seq_bytes, "big")
        if not self.dropped_one:  # as if the network lost it: the replay socket must give it back
            self.dropped_one = True
            return
        if seq <= self.last:
            return
        if seq > self.last + 1:
            self.fill(decoder, seq - 1)
        self.apply(decoder, seq, payload)

    def fill(self, decoder: msgspec.msgpack.Decoder, upto: int) -> None:
        """Ask the replay socket for everything after `last`; apply up to `upto`."""
        self.counts["replays"] += 1
        self.replay.send_multipart([b"", (self.last + 1).to_bytes(8, "big")])
        while True:
            assert self.replay.poll(WAIT_MS), "the replay socket did not answer"
            empty, topic, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == self.topic
            seq = int.from_bytes(seq_bytes, "big")
            if self.last < seq <= upto:
                self.counts["replayed"] += 1
                self.apply(decoder, seq, payload)
        assert self.last >= upto, f"group {self.dp}: replay ended at {self.last}, needed {upto}"

    def apply(self, decoder: msgspec.msgpack.Decoder, seq: int, payload: bytes) -> None:
        assert seq == self.last + 1, (seq, self.last)
        assert not any(secret in payload for secret in self.secrets), "a raw salt left the engine"
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == self.dp
        self.counts["batches"] += 1
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.index.clear()
                self.counts["cleared"] += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert self.index.pop(h) == TIER[ev.medium], "removed from a medium it was not on"
                self.counts["removed"] += 1
            else:
                self.stored(ev)
        self.last = seq

    def stored(self, ev: BlockStored) -> None:
        assert len(ev.extra_keys) == len(ev.block_hashes) and 0 <= len(ev.token_ids) <= ev.block_size
        for h, extra in zip(ev.block_hashes, ev.extra_keys, strict=True):
            assert 0 <= h < 1 << 64
            self.index[h] = TIER[ev.medium]
            self.tokens[h] = len(ev.token_ids)
            if extra is not None:
                (label,) = extra
                self.labels.add(label)
                self.counts["labelled"] += 1
        self.counts["stored"] += 1
        self.counts["cpu_stored"] += ev.medium == "CPU"


def main() -> None:
    cfg = json.loads(sys.argv[1])
    ctx = zmq.Context()
    topic = cfg["topic"].encode()
    secrets = [s.encode() for s in cfg["secrets"]]
    groups = [Group(ctx, dp, pub, rep, topic, secrets) for dp, (pub, rep) in enumerate(zip(cfg["pub"], cfg["replay"],
                                                                                    strict=True))]
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    poller = zmq.Poller()
    for g in groups:
        poller.register(g.sub, zmq.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    print("ready", flush=True)
    last = None
    while last is None:
        ready = dict(poller.poll(WAIT_MS))
        assert ready, "no batch and no end line"
        for g in groups:
            if g.sub in ready:
                g.live(decoder)
        if stdin in ready:
            last = json.loads(sys.stdin.readline())["last"]
    for g, upto in zip(groups, last, strict=True):
        while g.sub.poll(0):  # what is still on the wire
            g.live(decoder)
        if g.last < upto:
            g.fill(decoder, upto)
        assert g.last == upto, (g.dp, g.last, upto)
    print(json.dumps({"index": [{str(k): t for k, t in g.index.items()} for g in groups],
                      "counts": [g.counts for g in groups],
                      "tokens": {str(k): n for g in groups for k, n in g.tokens.items()},
                      "labels": sorted(set().union(*[g.labels for g in groups]))}), flush=True)
    for g in groups:
        g.sub.close(linger=0)
        g.replay.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
