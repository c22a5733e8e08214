"""The engine's KV event hub: the ranks' KV events in, every reader of them out.

tp rank 0 of each dp group returns its step's events (kvcache/events.py); the hub applies them to the block
index placement reads (engine/kv_index.py), the /kv_events stream (kv_stream.py) and the ZMQ publisher
(kv_publisher.py), in step order, and keeps each group's free blocks as its rank last reported them. It also
decides whether the ranks record events at all: always for the `kv` policy or when asked, else only while a
/kv_events client listens, so an engine nobody routes by or reads pays nothing for them.
"""

from __future__ import annotations

from typing import Any

from engine.config import KVEventsConfig
from engine.kv_index import KVIndex
from engine.kv_publisher import KVEventPublisher
from engine.kv_stream import KVEventStream
from engine.routing_record import salt_label
from kvcache.events import prompt_keys


class KVEventHub:
    def __init__(self, events: KVEventsConfig, routed_by_kv: bool, tokens_per_block: int, num_groups: int) -> None:
        self.B = tokens_per_block
        self.always = routed_by_kv or events.always or events.publisher == "zmq"
        self.index = KVIndex(num_groups, 1 << 30, self.B)
        self.stream = KVEventStream(events.buffer, self.B, self.index, buffer_always=events.always)
        self.publisher = KVEventPublisher(events, self.B, num_groups, self.index, salt_label)  # ZMQ, vLLM's format
        self.free = [0] * num_groups  # each group's free primary blocks, from its last step
        self.total = [0] * num_groups  # each group's primary blocks
        self.recording = False  # whether the ranks were told to record events at the last step

    def group_started(self, dp: int, info: dict[str, Any]) -> None:
        """Group `dp`'s tp rank 0 is set up (a start or a restart): its cache is empty, all its primary blocks
        free (a room the `kv` score weighs before its first step reports one), and its slots on every tier are
        the most blocks the index may hold for it."""
        self.free[dp] = self.total[dp] = info["max_num_blocks"]
        self.index.max_blocks[dp] = info["kv_slots"]

    @property
    def events_on(self) -> bool:
        """Whether the ranks record KV events: always for `kv` (or `kv_events`), else while someone listens."""
        return self.always or self.stream.listening

    def keys(self, prompt: list[int], salt: Any) -> list[int] | None:
        """The prompt's block keys, computed once (the rank publishes with them), or None while events are off."""
        return prompt_keys(prompt, self.B, salt) if self.recording or self.events_on else None

    def plan(self, plans: list) -> None:
        """Tell each group's ranks whether to record events, and whether to send a snapshot (a resync)."""
        on = self.events_on
        if self.recording and not on:
            for dp in range(len(self.index.blocks)):
                self.drop_group(dp)
        self.recording = on
        for dp, p in enumerate(plans):
            if p is not None:
                p.kv_events = on
                p.kv_resync = on and self.index.resync[dp]

    def observe(self, dp: int, res: Any) -> None:
        """A group's step result (tp rank 0's): its free blocks, its events into the index and both streams."""
        if res.free_blocks >= 0:
            self.free[dp] = res.free_blocks
        if res.kv_events:
            self.index.apply(dp, res.kv_events)
            self.stream.publish(dp, res.kv_events)
            self.publisher.publish(dp, res.kv_events)

    def drop_group(self, dp: int) -> None:
        """What the engine knows of a group's cache is gone: the group went down, restarts with an empty cache,
        or a step of it raised and its events were lost (the engine calls this). Its rank's next snapshot
        rebuilds it, on the index and on the streams."""
        self.index.drop_group(dp)
        self.stream.cleared(dp)
        self.publisher.cleared(dp)
