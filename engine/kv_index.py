"""The engine's index of which dp group holds which block, built from the ranks' KV events.

Per dp group one dict, block key -> tier (0 primary, 1 host), fed with tp rank 0's events in step order, so it
is exactly the set of blocks that rank reported holding; a trailing partial block (fewer tokens than a block)
is also in `partial` with its token count, so the ZMQ publisher can leave it off vLLM's wire. It is bounded:
a group never holds more entries than its rank has slots (primary + host), so more entries mean the events
went wrong. Bad input (an unknown block removed or moved, a block stored twice, too many blocks) never
raises: the group is emptied, the error counted, and the group marked for a resync: its next step asks the
rank for a snapshot (a cleared event and every block it holds), and events until that snapshot arrives are
ignored. A group that goes down, restarts with an empty cache, or whose step raised (that step's events are
lost) is dropped (`drop_group`); its rank's next events are again a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent

log = logging.getLogger("kvfleet.engine")


class KVIndex:
    def __init__(self, num_groups: int, max_blocks: int | list[int], tokens_per_block: int = 0) -> None:
        self.blocks: list[dict[int, int]] = [{} for _ in range(num_groups)]
        self.partial: list[dict[int, int]] = [{} for _ in range(num_groups)]  # key -> tokens, partial blocks only
        self.tokens_per_block = tokens_per_block  # 0: events carry no tokens (a follower's), nothing is partial
        self.max_blocks = [max_blocks] * num_groups if isinstance(max_blocks, int) else list(max_blocks)
        self.resync = [True] * num_groups  # nothing known until the group's first snapshot
        self.errors = 0  # events that did not fit what the index holds (each led to a resync)
        self.events = 0

    def apply(self, dp: int, events: Iterable[KVEvent]) -> bool:
        """One group's events, in order; False when they did not fit (the group now waits for a resync)."""
        held, partial = self.blocks[dp], self.partial[dp]
        for ev in events:
            self.events += 1
            kind = ev.kind
            if kind == CLEARED:
                held.clear()
                partial.clear()
                self.resync[dp] = False
                continue
            if self.resync[dp]:
                continue
            if kind == STORED:
                ok = ev.key not in held and len(held) < self.max_blocks[dp]
                held[ev.key] = ev.tier
                if len(ev.tokens) < self.tokens_per_block:
                    partial[ev.key] = len(ev.tokens)
            elif kind == REMOVED:
                ok = held.pop(ev.key, None) is not None
                partial.pop(ev.key, None)
            elif kind == MOVED:
                ok = ev.key in held
                held[ev.key] = ev.tier
            else:
                ok = False
            if not ok:
                self._lost(dp, ev)
                return False
        return True

    def _lost(self, dp: int, ev: KVEvent) -> None:
        self.errors += 1
        log.warning("kv index: dp group %d sent an event that does not fit (%r); resyncing", dp, ev[:2])
        self.blocks[dp] = {}
        self.partial[dp] = {}
        self.resync[dp] = True

    def drop_group(self, dp: int) -> None:
        """The group went down or restarts with an empty cache: forget it until its rank's next snapshot."""
        self.blocks[dp] = {}
        self.partial[dp] = {}
        self.resync[dp] = True

    def prefix(self, dp: int, keys: list[int]) -> tuple[int, int]:
        """(primary, host) blocks of the longest prefix of `keys` the group holds: the rank's reuse match
        stops at the first block it lacks, so a block past a gap predicts nothing."""
        held = self.blocks[dp]
        primary = host = 0
        for key in keys:
            tier = held.get(key)
            if tier is None:
                break
            if tier == 0:
                primary += 1
            else:
                host += 1
        return primary, host
