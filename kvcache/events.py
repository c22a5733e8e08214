"""KV events: what the reuse tree gained and lost, for a router outside the rank (off unless asked for).

A block is one node of the reuse tree. Its key chains from its parent's key and its tokens, starting from a
per-salt root key, so the same tokens under two salts never share a key, and the engine can compute the keys
of a prompt before any rank sees it (`prompt_keys`): exactly what the rank computes when it publishes.
Keys are 64-bit blake2b digests: stable across processes (Python's `hash` of a str is not), and a collision
can only mislead a prediction, never a reuse (the tree itself matches token tuples).

The events follow one life cycle's pages, the "anchor" (the first that never goes stale; with only sliding
windows, life cycle 0): a block is stored when its anchor page is published, moved when that page changes
tier, removed when it is dropped. Every event costs O(1) (a stored one O(block tokens)); nothing is recorded
while events are off.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, NamedTuple

STORED, REMOVED, MOVED, CLEARED = 0, 1, 2, 3
KIND_NAMES = ("stored", "removed", "moved", "cleared")


class KVEvent(NamedTuple):
    """One event. `tier`: 0 primary, 1 host (for MOVED: the tier the block went to)."""

    kind: int
    key: int = 0
    parent: int | None = None  # STORED: the parent block's key (None under the root)
    tokens: tuple = ()  # STORED: the block's tokens (fewer than a block for a trailing partial block)
    tier: int = 0
    salt: Any = None  # STORED: the cache salt


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def root_key(salt: Any) -> int:
    """The key every chain of one salt starts from (keyed by type and value, as the manager's roots are)."""
    if salt is None:
        return 0
    return _digest(repr((type(salt).__name__, salt)).encode())


def block_key(parent: int, tokens: tuple | list) -> int:
    return _digest(parent.to_bytes(8, "little") + array("q", tokens).tobytes())


def prompt_keys(tokens: list[int], tokens_per_block: int, salt: Any = None) -> list[int]:
    """The keys of every full block of `tokens` under `salt`, in order."""
    keys = []
    key = root_key(salt)
    B = tokens_per_block
    for o in range(len(tokens) // B):
        key = block_key(key, tokens[o * B:(o + 1) * B])
        keys.append(key)
    return keys


class EventRecorder:
    """The manager's event list while events are on: the cache and the manager call it where the anchor
    life cycle's page of a published block is stored, moved or dropped."""

    def __init__(self, anchor: int) -> None:
        self.anchor = anchor
        self.events: list[KVEvent] = []

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    def stored(self, node: Any, tier: int, salt: Any, key: int | None = None) -> None:
        """`node`'s anchor page was published; `key` is the caller's precomputed key of a full block."""
        if node.key is None:
            node.key = key if key is not None else block_key(key_of(node.parent), node.tokens)
        parent = node.parent
        self.events.append(KVEvent(STORED, node.key, None if parent.parent is None else key_of(parent),
                                   node.tokens, tier, salt))

    def moved(self, node: Any, tier: int) -> None:
        self.events.append(KVEvent(MOVED, key_of(node), tier=tier))

    def removed(self, node: Any, tier: int) -> None:
        self.events.append(KVEvent(REMOVED, key_of(node), tier=tier))

    def snapshot(self, roots: dict) -> None:
        """Replace what is recorded by the whole tree: cleared, then every held block, parents first."""
        self.events = [KVEvent(CLEARED)]
        for (_, salt), root in roots.items():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                page = node.pages[self.anchor]
                if page is not None:
                    self.stored(node, page.tier, salt)
                stack.extend(node.children.values())


def key_of(node: Any) -> int:
    """A node's key, computing (and keeping) the keys of the ancestors published while events were off."""
    if node.key is not None:
        return node.key
    chain = []
    while node.key is None:
        chain.append(node)
        node = node.parent
    key = node.key
    for n in reversed(chain):
        key = n.key = block_key(key, n.tokens)
    return key


def partial_reuse_worth(mgr: Any) -> int:
    """The reused blocks a stats commit counts for a block matched in part: one per life cycle (`KVCache._adopt`),
    none while partial reuse is off."""
    cfg = mgr.config
    return len(mgr.life_cycles) if cfg.enable_block_reuse and cfg.enable_partial_reuse else 0


def reuse_table(mgr: Any) -> list[int]:
    """`t[m]`: the reused blocks a stats commit counts (over every life cycle, stale ones left out) for a
    request that matched m full blocks: what the engine's prediction of m held blocks is worth in the
    statistics' units. Mirrors `KVCache._adopt`."""
    B = mgr.tokens_per_block
    table = []
    for m in range(mgr.config.max_seq_len // B + 1):
        n = m * B
        total = 0
        for cycle in mgr.life_cycles:
            start, end = cycle.attention.stale_range(n)
            total += m - (min(end, m) - min(start, m))
        table.append(total)
    return table
