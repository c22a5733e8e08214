"""The engine's index of which dp group holds which block, built from the ranks' KV events.

Per dp group one dict, block key -> tier (0 primary, 1 host), fed with tp rank 0's events in step order, so it
is exactly the set of blocks that rank reported holding; a trailing partial block (fewer tokens than a block)
is also in `partial` with its token count, so the ZMQ publisher can leave it off vLLM's wire. Where events
carry tokens (the engine's own index) each block's tokens are kept under its parent too, so a prediction can
count the block a rank reuses in part (`partial_match`, the rank's `Node.best_partial`). It is bounded:
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
from typing import Any

from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent, root_key

log = logging.getLogger("kvfleet.engine")


class KVIndex:
    def __init__(self, num_groups: int, max_blocks: int | list[int], tokens_per_block: int = 0) -> None:
        self.blocks: list[dict[int, int]] = [{} for _ in range(num_groups)]
        self.partial: list[dict[int, int]] = [{} for _ in range(num_groups)]  # key -> tokens, partial blocks only
        self.tokens_per_block = tokens_per_block  # 0: events carry no tokens (a follower's), nothing is partial
        # with tokens: key -> (parent key, tokens), and parent key -> first token -> child keys (a salt's root key
        # stands for the parent of its chains' first blocks, as in kvcache/events.py)
        self.nodes: list[dict[int, tuple[int, tuple]]] = [{} for _ in range(num_groups)]
        self.children: list[dict[int, dict[int, list[int]]]] = [{} for _ in range(num_groups)]
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
                self.nodes[dp].clear()
                self.children[dp].clear()
                self.resync[dp] = False
                continue
            if self.resync[dp]:
                continue
            if kind == STORED:
                ok = ev.key not in held and len(held) < self.max_blocks[dp]
                held[ev.key] = ev.tier
                if ok and ev.tokens and self.tokens_per_block:
                    self._add_node(dp, ev)
            elif kind == REMOVED:
                ok = held.pop(ev.key, None) is not None
                self._remove_node(dp, ev.key)
            elif kind == MOVED:
                ok = ev.key in held
                held[ev.key] = ev.tier
            else:
                ok = False
            if not ok:
                self._lost(dp, ev)
                return False
        return True

    def _add_node(self, dp: int, ev: KVEvent) -> None:
        parent = ev.parent if ev.parent is not None else root_key(ev.salt)
        self.nodes[dp][ev.key] = (parent, ev.tokens)
        self.children[dp].setdefault(parent, {}).setdefault(ev.tokens[0], []).append(ev.key)
        if len(ev.tokens) < self.tokens_per_block:
            self.partial[dp][ev.key] = len(ev.tokens)

    def _remove_node(self, dp: int, key: int) -> None:
        node = self.nodes[dp].pop(key, None)
        if node is None:
            return
        self.partial[dp].pop(key, None)
        parent, tokens = node
        by_first = self.children[dp][parent]
        siblings = by_first[tokens[0]]
        siblings.remove(key)
        if not siblings:
            del by_first[tokens[0]]
            if not by_first:
                del self.children[dp][parent]

    def partial_tokens(self, dp: int, prompt: list[int], keys: list[int], held: int, salt: Any) -> int:
        """Prompt tokens past its first `held` full blocks (`keys`: the prompt's) that group `dp`'s rank will
        reuse in part, as the rank matches (`KVCacheManager.match`: at most a block less one, never the prompt's
        last token); 0 where the index holds no tokens. The engine's and the fleet's predictions both use it."""
        B = self.tokens_per_block
        n = held * B
        cap = min(len(prompt) - 1 - n, B - 1)
        if not B or cap <= 0:
            return 0
        parent = keys[held - 1] if held else root_key(salt)
        return self.partial_match(dp, parent, prompt[n:n + cap])

    def partial_match(self, dp: int, parent: int, tokens: list[int]) -> int:
        """The most of `tokens` (at most a block less one) that a block group `dp` holds under `parent` starts
        with: what the rank's partial reuse takes after its full blocks (`Node.best_partial`)."""
        held = self.nodes[dp]
        best = 0
        for key in self.children[dp].get(parent, {}).get(tokens[0], ()) if tokens else ():
            n = 0
            for a, b in zip(held[key][1], tokens, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def _lost(self, dp: int, ev: KVEvent) -> None:
        self.errors += 1
        log.warning("kv index: dp group %d sent an event that does not fit (%r); resyncing", dp, ev[:2])
        self._forget(dp)

    def drop_group(self, dp: int) -> None:
        """The group went down or restarts with an empty cache: forget it until its rank's next snapshot."""
        self._forget(dp)

    def _forget(self, dp: int) -> None:
        self.blocks[dp], self.partial[dp], self.nodes[dp], self.children[dp] = {}, {}, {}, {}
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
