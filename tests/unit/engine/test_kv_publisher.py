"""KV events over ZMQ (engine/kv_publisher.py): vLLM 0.33.0's wire format, replay, settings (no Ray).

The real run: the in-process engine (tests/support/engine_harness.py) with dp=2 publishes on tcp port 0; a
subscriber in its own process (tests/support/kv_zmq_subscriber.py, vLLM's structs written out) decodes every batch,
fills a gap from the replay socket and rebuilds the index, which must equal the router's for every group.
"""

import asyncio
import importlib.util
import json
import queue
import selectors
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq
from pydantic import ValidationError

from deployment.settings import Settings
from engine import kv_publisher
from engine.errors import EngineError
from engine.kv_index import KVIndex
from engine.kv_publisher import KVEventPublisher, offset_endpoint
from engine.routing_record import salt_label
from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent, prompt_keys
from tests.support.engine_harness import make_engine, settled
from workers.sampling_params import SamplingParams

B = 16
SUBSCRIBER = Path(__file__).resolve().parents[2] / "support" / "kv_zmq_subscriber.py"
SALTS = ("tenant-a-secret", "tenant-b-secret")


def readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """One line of the subscriber's stdout, or fail after timeout_s (never hang the suite)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            raise AssertionError(f"the subscriber said nothing in {timeout_s} s: {proc.stderr.read()}")
    line = proc.stdout.readline()
    assert line, f"the subscriber exited ({proc.wait()}): {proc.stderr.read()}"
    return line


async def ask(eng, prompt, salt=None, max_tokens=4):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [ev.token_id async for ev in eng.generate(None, prompt, params, salt)]


def test_a_subscriber_process_rebuilds_every_groups_index_from_the_wire():
    async def main():
        eng = await make_engine(dp=2, kv_cache_bytes=256 << 10, host_cache_bytes=256 << 10, max_seq_len=256,
                                routing="round_robin", kv_events_publisher="zmq", kv_events_endpoint="tcp://*:0",
                                kv_events_replay_endpoint="tcp://*:0", kv_events_topic="kvfleet-test")
        pub = eng.hub.publisher
        local = [tuple(e.replace("0.0.0.0", "127.0.0.1") for e in eps) for eps in pub.endpoints]
        cfg = {"pub": [p for p, _ in local], "replay": [r for _, r in local], "topic": "kvfleet-test",
               "secrets": list(SALTS)}
        proc = subprocess.Popen([sys.executable, str(SUBSCRIBER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert readline(proc, 30) == "ready\n"
            prompts = []
            for i in range(12):  # enough distinct prompts that both groups evict to the host tier and drop
                salt = SALTS[i % 2] if i % 3 == 0 else None
                prompt = [1 + (i * 37 + j) % 250 for j in range(40 + 8 * (i % 4))]
                prompts.append((prompt, salt))
                await ask(eng, prompt, salt)
                if i % 4 == 3:
                    await ask(eng, prompts[i - 3][0], prompts[i - 3][1])  # a reuse
            await settled(eng)
            assert await asyncio.to_thread(pub.flush, 10.0)
            try:
                proc.stdin.write(json.dumps({"last": [pub.last_seq(dp) for dp in range(2)]}) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:
                raise AssertionError(f"the subscriber failed: {proc.stderr.read()}") from None
            got = json.loads(readline(proc, 60))
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for dp in range(2):
            full = {k: t for k, t in eng.hub.index.blocks[dp].items() if k not in eng.hub.index.partial[dp]}
            assert {int(k): t for k, t in got["index"][dp].items()} == full  # partial blocks stay off the wire
            c = got["counts"][dp]
            assert c["batches"] == pub.last_seq(dp) + 1  # every batch decoded, none twice
            assert c["replays"] >= 1 and c["replayed"] >= 1  # the dropped first batch came back by replay
            assert c["stored"] and c["removed"] and c["cleared"]
        assert eng.hub.index.errors == 0
        assert sum(c["cpu_stored"] for c in got["counts"]) > 0  # offloads: removed from GPU, stored on CPU
        assert set(got["labels"]) == {salt_label(s) for s in SALTS}  # the salts' labels, never the salts
        tokens = {int(k): n for k, n in got["tokens"].items()}
        for prompt, salt in prompts:
            for key in prompt_keys(prompt, B, salt):
                if key in tokens and tokens[key]:  # (a tier move's BlockStored carries no tokens either)
                    assert salt is None and tokens[key] == B
        await eng.shutdown()
        assert pub._thread is None and not pub._groups

    asyncio.run(main())


def test_the_endpoint_is_offset_per_dp_group_as_vllm_does():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"  # the OS picks each group's port
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"


@pytest.mark.parametrize(("overrides", "setting"), [
    ({"kv_events_publisher": "kafka"}, "kv_events_publisher"),
    ({"kv_events_endpoint": "tcp://*"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:port"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "udp://*:5557"}, "kv_events_endpoint"),
    ({"kv_events_endpoint": "tcp://*:65535", "dp": 2}, "kv_events_endpoint"),
    ({"kv_events_replay_endpoint": "tcp://*"}, "kv_events_replay_endpoint"),
    ({"kv_events_replay_endpoint": "tcp://*:5558", "dp": 2}, "kv_events_replay_endpoint"),  # group 1's PUB port
    ({"kv_events_buffer_steps": 0}, "kv_events_buffer_steps"),
])
def test_a_bad_setting_fails_at_start_naming_it(overrides, setting):
    with pytest.raises(ValidationError, match=setting):
        Settings(**{"model": "random", "kv_events_publisher": "zmq", **overrides})


def test_an_endpoint_in_use_fails_start_naming_the_setting():
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://*:0")
    port = taken.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
    try:
        s = Settings(model="random", dp=1, kv_events_publisher="zmq", kv_events_endpoint=f"tcp://*:{port}")
        pub = KVEventPublisher(s.engine_config().kv_events, s.tokens_per_block, 1, None, salt_label)
        with pytest.raises(EngineError, match="kv_events_endpoint"):
            pub.start()
        assert pub._thread is None and pub._ctx is None
    finally:
        taken.close(linger=0)
        ctx.term()


class _Index:
    def __init__(self, blocks):
        self.blocks, self.resync = blocks, [False] * len(blocks)
        self.partial = [{} for _ in blocks]


def test_a_full_queue_drops_the_batch_then_sends_a_snapshot_without_blocking(monkeypatch):
    monkeypatch.setattr(kv_publisher, "MAX_QUEUE", 1)
    s = Settings(model="random", dp=1, kv_events_publisher="zmq")
    index = _Index([{11: 0, 12: 1}])
    pub = KVEventPublisher(s.engine_config().kv_events, s.tokens_per_block, 1, index, salt_label)
    pub._thread = object()  # as if started, with a thread that never drains: the step loop must not wait
    pub.publish(0, [KVEvent(STORED, 11, tokens=tuple(range(B)))])
    pub.publish(0, [KVEvent(STORED, 12, tokens=tuple(range(B)))])  # full: dropped at once
    assert pub.dropped == 1
    assert pub._queue.get_nowait()[2][0].key == 11
    pub.publish(0, [KVEvent(STORED, 13, tokens=tuple(range(B)))])
    events = pub._queue.get_nowait()[2]  # the index (which has every event so far) instead of this step's
    assert [e.kind for e in events] == [CLEARED, STORED, STORED] and {e.key for e in events[1:]} == {11, 12}
    with pytest.raises(queue.Empty):
        pub._queue.get_nowait()


def test_the_wire_is_vllm_0_33s_encoding():
    """Positional batch, tagged-map events, every required field present (vLLM 0.33.0's msgspec options)."""
    events = [KVEvent(STORED, 2**64 - 1, None, tuple(range(B)), 0, "salt"), KVEvent(CLEARED)]
    batch = kv_publisher.KVEventBatch(1.5, kv_publisher.wire_events(events, B, salt_label, set()), 1)
    ts, evs, dp = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert (ts, dp) == (1.5, 1)
    assert evs[0] == {"type": "BlockStored", "block_hashes": [2**64 - 1], "parent_block_hash": None,
                      "token_ids": [], "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None,
                      "extra_keys": [[salt_label("salt")]]}
    assert evs[1] == {"type": "AllBlocksCleared"}


def test_a_batch_is_byte_for_byte_what_vllms_structs_encode():
    """The subscriber's structs are vLLM 0.33.0's, written out: the same events encode to the same bytes."""
    spec = importlib.util.spec_from_file_location("kv_zmq_subscriber", SUBSCRIBER)
    vllm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm)
    events = [KVEvent(STORED, 2**64 - 5, None, tuple(range(B)), 0, None),
              KVEvent(STORED, 8, None, tuple(range(B)), 0, "salt"), KVEvent(MOVED, 8, tier=1),
              KVEvent(REMOVED, 8, tier=1), KVEvent(CLEARED)]
    wire = kv_publisher.wire_events(events, B, salt_label, set())
    ours = msgspec.msgpack.encode(kv_publisher.KVEventBatch(1.25, wire, 1))
    theirs = msgspec.msgpack.encode(vllm.KVEventBatch(1.25, [
        vllm.BlockStored([2**64 - 5], None, list(range(B)), B, None, "GPU", None, [None]),
        vllm.BlockStored([8], None, [], B, None, "GPU", None, [(salt_label("salt"),)]),
        vllm.BlockRemoved([8], "GPU"), vllm.BlockStored([8], None, [], B, None, "CPU", None, [None]),
        vllm.BlockRemoved([8], "CPU"), vllm.AllBlocksCleared()], 1))
    assert ours == theirs


def _replay(dealer: zmq.Socket, frames: list[bytes]) -> list[list[bytes]] | None:
    """Every message answered to one request up to the end marker, or None when nothing came in 2 s."""
    dealer.send_multipart(frames)
    got = []
    try:
        while True:
            got.append(dealer.recv_multipart())
            if got[-1][2] == kv_publisher.END_SEQ:
                return got
    except zmq.Again:
        return None


def test_no_replay_request_stops_the_publisher():
    """The replay socket takes whatever any peer sends: starts past the buffer (2**63 and up once killed the
    thread), frames of every count and size. Each gets the end marker alone or is dropped; the thread lives,
    publishes and answers a good request after all of them."""
    s = Settings(model="random", dp=1, kv_events_publisher="zmq", kv_events_endpoint="tcp://*:0",
                 kv_events_replay_endpoint="tcp://*:0")
    pub = KVEventPublisher(s.engine_config().kv_events, B, 1, _Index([{}]), salt_label)
    pub.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.RCVTIMEO = 2000
    dealer.connect(pub.endpoints[0][1].replace("0.0.0.0", "127.0.0.1"))
    try:
        pub.publish(0, [KVEvent(STORED, 1, tokens=tuple(range(B)))])
        assert pub.flush(5.0)
        assert len(_replay(dealer, [b"", (0).to_bytes(8, "big")])) == 2  # the batch and the end marker
        for start in (1, 2**63 - 1, 2**63, 2**64 - 1):
            assert len(_replay(dealer, [b"", start.to_bytes(8, "big")])) == 1, start  # the end marker alone
        garbage = [[], [b""], [b"x" * 9], [b"", b""], [b"", b"\x00" * 7], [b"", b"\x00" * 9],
                   [b"", b"\x00" * 1000], [b"not empty", b"\x00" * 8], [b"", b"\x00" * 8, b"extra"]]
        for frames in garbage:
            if frames:
                dealer.send_multipart(frames)
        pub.publish(0, [KVEvent(STORED, 2, tokens=tuple(range(B)))])
        assert pub.flush(5.0) and pub._thread.is_alive()
        got = _replay(dealer, [b"", (0).to_bytes(8, "big")])  # answered after every bad request before it
        assert [int.from_bytes(m[2], "big", signed=True) for m in got] == [0, 1, -1]
        assert pub.bad_requests == len(garbage) - 1
    finally:
        dealer.close(0)
        ctx.term()
        pub.close()


def test_partial_blocks_never_go_on_vllms_wire():
    """vLLM stores only full blocks and its consumers take block_size tokens per hash: a partial block, its
    moves and its removal stay off the wire; a snapshot leaves out the partial blocks the index holds."""
    full, part = KVEvent(STORED, 1, tokens=tuple(range(B))), KVEvent(STORED, 2, parent=1, tokens=(1,) * 9)
    partial: set[int] = set()
    wire = kv_publisher.wire_events([full, part, KVEvent(MOVED, 2, tier=1), KVEvent(MOVED, 1, tier=1)], B,
                                    salt_label, partial)
    assert [(type(e).__name__, e.block_hashes) for e in wire] == [
        ("BlockStored", [1]), ("BlockRemoved", [1]), ("BlockStored", [1])]
    assert partial == {2}
    wire = kv_publisher.wire_events([KVEvent(REMOVED, 2, tier=1), KVEvent(REMOVED, 1, tier=1)], B, salt_label,
                                    partial)
    assert [(type(e).__name__, e.block_hashes) for e in wire] == [("BlockRemoved", [1])] and not partial

    index = KVIndex(1, 100, B)
    index.apply(0, [KVEvent(CLEARED), full, part])
    assert index.partial[0] == {2: 9}
    s = Settings(model="random", dp=1, kv_events_publisher="zmq")
    pub = KVEventPublisher(s.engine_config().kv_events, B, 1, index, salt_label)
    events, seed = pub._snapshot(0)
    assert [e.key for e in events if e.kind == STORED] == [1] and seed == {2}


def test_engine_replicas_on_one_node_publish_on_their_own_ports():
    """Replica R's group N is the fleet-wide dp rank R x dp + N: its port offset and its batches' rank."""
    s = Settings(model="random", engine_replicas=3, dp=2, kv_events_publisher="zmq",
                 kv_events_endpoint="tcp://*:6000", kv_events_replay_endpoint="tcp://*:6100")
    assert [s.engine_config(r).kv_events.first_group for r in range(3)] == [0, 2, 4]
    with pytest.raises(ValidationError, match="kv_events_replay_endpoint"):  # 6000..6005 meets 6004
        Settings(model="random", engine_replicas=3, dp=2, kv_events_publisher="zmq",
                 kv_events_endpoint="tcp://*:6000", kv_events_replay_endpoint="tcp://*:6004")
    with pytest.raises(ValidationError, match="65535"):
        Settings(model="random", engine_replicas=4, dp=2, kv_events_publisher="zmq",
                 kv_events_endpoint="tcp://*:65530")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = Settings(model="random", engine_replicas=2, dp=1, kv_events_publisher="zmq",
                 kv_events_endpoint=f"tcp://*:{port}")
    pubs = [KVEventPublisher(s.engine_config(r).kv_events, B, 1, _Index([{}]), salt_label) for r in range(2)]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.RCVTIMEO = 200
    try:
        for p in pubs:
            p.start()  # the second replica once failed here: Address already in use
        assert [p.endpoints[0][0].rpartition(":")[2] for p in pubs] == [str(port), str(port + 1)]
        sub.connect(f"tcp://127.0.0.1:{port + 1}")
        got = None
        for _ in range(50):  # a SUB joins asynchronously: publish until it sees a batch (bounded)
            pubs[1].publish(0, [KVEvent(STORED, 1, tokens=tuple(range(B)))])
            try:
                got = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        assert got is not None and msgspec.msgpack.decode(got[2])[2] == 1  # replica 1's group 0: rank 1
    finally:
        sub.close(0)
        ctx.term()
        for p in pubs:
            p.close()
