"""One request's KV cache: its pages per life cycle, its place in the reuse tree, its pending statistics.

The cache decides what it needs; the manager's public verbs (`can_take`, `take`, `hold`, `release`, `lock`,
`unlock`, `onboard`, `copy_partial`, `commit_stats`) and its reuse trees' (`reuse.root`, `match`, `prune`,
`leave`) do it, so pools, counters and the salts' roots stay the manager's. The attention policy of each life
cycle says which blocks are stale. Everything here costs O(blocks touched). Names: `lc` is a life cycle id,
`cycle` a `LifeCycle`; `pg` a pool group id, `group` a `PoolGroup`; `o` a block ordinal and `nb` a number of
blocks.
"""

from typing import TYPE_CHECKING

from kvcache.attention import cdiv
from kvcache.pending import SEG_GEN, SEG_MISS, SEG_PLAIN, PendingStats
from kvcache.pool import DEFAULT_PRIORITY, Page
from kvcache.stats import KVCacheStatsDelta

if TYPE_CHECKING:
    from kvcache.manager import KVCacheManager


class KVCacheError(RuntimeError):
    """Misuse of a KV cache (commit beyond capacity, use after close, ...). Nothing was changed."""


class KVCache:
    def __init__(self, mgr: "KVCacheManager", request_id, input_tokens, expected_prompt_length: int | None,
                 cache_salt, exclude_from_stats: bool, block_keys: list[int] | None = None) -> None:
        cfg = mgr.config
        tokens = list(input_tokens)
        if len(tokens) > cfg.max_seq_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(tokens)} tokens is longer than "
                             f"max_seq_len={cfg.max_seq_len}")
        if expected_prompt_length is None:
            expected_prompt_length = len(tokens)
        if not 0 <= expected_prompt_length <= cfg.max_seq_len:
            raise ValueError(f"request {request_id!r}: expected_prompt_length={expected_prompt_length} "
                             f"is outside [0, max_seq_len={cfg.max_seq_len}]")
        try:
            hash(cache_salt)
        except TypeError as e:
            raise TypeError(f"cache_salt must be hashable, got {type(cache_salt).__name__}") from e
        self._mgr = mgr
        self._salt = cache_salt
        self._keys = block_keys  # precomputed keys of the prompt's full blocks (KV events), or None
        self.request_id = request_id
        self.expected_prompt_length = expected_prompt_length
        self.priority = DEFAULT_PRIORITY
        n_lc = len(mgr.life_cycles)
        # None for a request that records no statistics (stats off, or excluded): nothing is ever pending
        self._pending = PendingStats(n_lc) if mgr.stats_enabled and not exclude_from_stats else None
        self._pages: list[list[Page | None]] = [[] for _ in range(n_lc)]
        self._active = False
        self._closed = False
        self._partial_src = False  # the block at ordinal history // B is still a shared source page
        self._root = mgr.reuse.root(cache_salt) if cfg.enable_block_reuse else None
        self._nodes = []
        n = 0
        if self._root is not None and len(tokens) > 1:
            n, self._nodes, partial = mgr.reuse.match(self._root, tokens, len(tokens) - 1)
            if n:
                self._adopt(n, partial)
            if self._nodes:
                self._nodes[-1].tails += 1  # we publish under it: it stays in the tree while we live
        self.num_reused_tokens = n
        # of the reused tokens, how many were on each tier (level 0 primary, 1 host) when the request came:
        # TensorRT-LLM's cached_tokens_by_level (a block with a page on the host tier counts as host)
        self.cached_tokens_by_level = [0] * (2 if cfg.host_cache_bytes else 1)
        if n:
            self._count_levels(n)
        self._history = n
        self._tokens = tokens[:n]
        self._capacity = n
        self._nb = cdiv(n, mgr.tokens_per_block)  # blocks held per life cycle
        # what a resize may grow to without a new block: min(nb * B, max_seq_len)
        self._room = min(self._nb * mgr.tokens_per_block, cfg.max_seq_len)
        # per life cycle, the ordinal below which stale blocks are released (sink blocks never are), and the
        # history at which the block at that ordinal goes stale
        self._released_to = [max(cycle.attention.stale_range(n)[1], cycle.attention.sink_blocks)
                             for cycle in mgr.life_cycles]
        self._stale_at = [cycle.attention.stale_at(o) for cycle, o in zip(mgr.life_cycles, self._released_to,
                                                                          strict=True)]

    def _adopt(self, n: int, partial) -> None:
        """Hold the matched pages (stale sliding-window blocks are matched but get no page)."""
        mgr = self._mgr
        B = mgr.tokens_per_block
        nb = cdiv(n, B)
        full = n // B
        for lc, cycle in enumerate(mgr.life_cycles):
            start, end = cycle.attention.stale_range(n)
            pages = self._pages[lc]
            counted = 0
            for o in range(nb):
                if start <= o < end:
                    pages.append(None)
                    continue
                page = (self._nodes[o] if o < full else partial).pages[lc]
                mgr.hold(page)
                pages.append(page)
                counted += o < full
            if self._pending is not None:
                self._pending.add_reuse(lc, counted, 1 if n % B else 0)
        self._partial_src = n % B != 0

    def _count_levels(self, n: int) -> None:
        levels = self.cached_tokens_by_level
        if len(levels) == 1:  # no host tier: every reused token is on the primary
            levels[0] = n
            return
        B, host = self._mgr.tokens_per_block, 0
        for o in range(cdiv(n, B)):
            for pages in self._pages:
                if pages[o] is not None and pages[o].tier:
                    host += min(B, n - o * B)
                    break
        levels[0], levels[1] = n - host, host

    # ---- state: num_reused_tokens <= history_length <= capacity <= max_seq_len ------------------------------
    @property
    def history_length(self) -> int:
        return self._history

    @property
    def capacity(self) -> int:
        return self._capacity

    def set_priority(self, priority: int) -> None:
        """Retention priority of this request's blocks once released (lower is evicted first)."""
        self.priority = priority
        for pages in self._pages:
            for page in pages:
                if page is not None and page.ref == 1:
                    page.priority = priority

    def block_ids(self, life_cycle_id: int) -> list[int]:
        """Primary slot id of each block ordinal; -1 where the block is stale (outside the window)."""
        if not self._active:
            raise KVCacheError(f"request {self.request_id!r}: block_ids() of an inactive cache; resume() first")
        return [-1 if p is None else p.slot for p in self._pages[life_cycle_id]]

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise KVCacheError(f"request {self.request_id!r}: {op}() after close()")

    # ---- verbs: resume, suspend, resize, commit, commit_pending_stats, close ----------------------------------
    @property
    def is_active(self) -> bool:
        """Resumed and not suspended: its pages are on the primary tier and may not be offloaded."""
        return self._active

    def resume(self) -> bool:
        """Lock every page on the primary tier (onboarding from the host tier) and make the partially reused
        block private. False = no room, and nothing changed."""
        self._check_open("resume")
        return self._active or self._activate(0)

    def _activate(self, grow: int) -> bool:
        """Resume, checking room for the resume and for `grow` more blocks per life cycle together, so that a
        resize of an inactive cache that fails changes nothing either."""
        mgr = self._mgr
        pg_of = mgr.pool_group_of
        need = [0] * len(mgr.pool_groups)
        po = self._history // mgr.tokens_per_block if self._partial_src else -1
        mine = []
        for lc, pages in enumerate(self._pages):
            pg = pg_of[lc]
            for o, page in enumerate(pages):
                if page is None:
                    continue
                if o == po:
                    need[pg] += 1  # the private copy
                    continue
                mine.append(page)
                if page.tier != 0:
                    need[pg] += 1
        mgr.lock(mine)  # ours are not offloadable while we look for room
        if not all(mgr.can_take(group.id, need[group.id] + grow * len(group.life_cycles))
                   for group in mgr.pool_groups):
            mgr.unlock(mine)
            return False
        record = self._pending is not None
        slots = [mgr.take(pg, k, record) if k else [] for pg, k in enumerate(need)]
        for page in mine:
            if page.tier != 0:
                mgr.onboard(page, slots[pg_of[page.lc]].pop(), record)
        if po >= 0:
            self._copy_partial(po, slots)
        self._active = True
        return True

    def _copy_partial(self, o: int, slots: list[list[int]]) -> None:
        """Give each life cycle a private copy of the partially reused block at ordinal o."""
        mgr = self._mgr
        pending = self._pending
        for lc, pages in enumerate(self._pages):
            src = pages[o]
            if src is None:
                continue
            on_primary = src.tier == 0
            pages[o] = mgr.copy_partial(src, slots[mgr.pool_group_of[lc]].pop(), self.priority, pending is not None)
            if pending is not None and on_primary:  # from the host tier, the onboard recorded the allocation
                pending.add(o, o + 1, SEG_PLAIN, only=lc)
        self._partial_src = False

    def suspend(self) -> None:
        """Let this request's pages be offloaded (preemption); resume() brings them back."""
        self._check_open("suspend")
        if not self._active:
            return
        for pages in self._pages:
            self._mgr.unlock(pages)
        self._active = False

    def resize(self, capacity: int) -> bool:
        """Grow or shrink to `capacity` tokens (resuming a fresh or suspended cache first).
        False = no room, and nothing changed."""
        if self._active and self._capacity <= capacity <= self._room:  # the common decode step: no new block
            self._capacity = capacity
            return True
        mgr = self._mgr
        old, new = self._nb, cdiv(capacity, mgr.tokens_per_block)
        if not self._active or not self._history <= capacity <= mgr.config.max_seq_len:
            self._check_resize(capacity)
            if not self._active and not self._activate(max(0, new - old)):  # a fresh or suspended cache is
                return False  # resumed first, with room for the growth checked together
        if new > old:
            if not self._grow(old, new):
                return False
        else:
            for pages in self._pages:
                for _ in range(old - new):
                    page = pages.pop()
                    if page is not None:
                        mgr.release(page, active=True)
            if self._pending is not None:
                self._pending.rollback(new)
        self._nb = new
        self._room = min(new * mgr.tokens_per_block, mgr.config.max_seq_len)
        self._capacity = capacity
        return True

    def _check_resize(self, capacity: int) -> None:
        self._check_open("resize")
        if capacity < self._history:
            raise KVCacheError(f"request {self.request_id!r}: resize({capacity}) below history_length "
                               f"{self._history}")
        if capacity > self._mgr.config.max_seq_len:
            raise KVCacheError(f"request {self.request_id!r}: resize({capacity}) beyond max_seq_len "
                               f"{self._mgr.config.max_seq_len}")

    def _grow(self, old: int, new: int) -> bool:
        """Blocks [old, new) of every life cycle, or False (nothing changed) when a pool group lacks room."""
        mgr = self._mgr
        n = new - old
        groups = mgr.pool_groups
        for group in groups:
            if not mgr.can_take(group.id, n * len(group.life_cycles)):
                return False
        pending = self._pending
        prio = self.priority
        for group in groups:
            slots = mgr.take(group.id, n * len(group.life_cycles), pending is not None)
            for lc in group.life_cycles:
                pages = self._pages[lc]
                for _ in range(n):
                    pages.append(Page(lc, 0, slots.pop(), prio, held=True))
        if pending is not None:  # classified by history at the start of the resize (SPEC 3)
            pending.add(old, new, SEG_MISS if self._history < self.expected_prompt_length else SEG_GEN)
        return True

    def commit(self, tokens) -> None:
        """These tokens' KV is written: history grows, full blocks are published, stale blocks released."""
        if not self._active:
            self._check_open("commit")
            raise KVCacheError(f"request {self.request_id!r}: commit() of an inactive cache; resume() first")
        n = len(tokens)
        h = self._history + n
        if h > self._capacity:
            raise KVCacheError(f"request {self.request_id!r}: commit of {n} tokens beyond capacity "
                               f"{self._capacity} (history {self._history})")
        self._tokens += tokens
        self._history = h
        mgr = self._mgr
        B = mgr.tokens_per_block
        if self._root is not None and h // B > len(self._nodes):
            for o in range(len(self._nodes), h // B):
                self._publish(o, B)
        for cycle in mgr.windowed:
            if h >= self._stale_at[cycle.id]:
                self._release_stale(cycle, h)

    def _release_stale(self, cycle, h: int) -> None:
        """Release the blocks of a sliding-window life cycle that went stale by history h."""
        lc = cycle.id
        end = cycle.attention.stale_range(h)[1]
        pages = self._pages[lc]
        for o in range(self._released_to[lc], end):
            page = pages[o]
            if page is not None:
                pages[o] = None
                self._mgr.release(page, active=True)
        self._released_to[lc] = end
        self._stale_at[lc] = cycle.attention.stale_at(end)

    def _publish(self, o: int, B: int) -> None:
        parent = self._nodes[o - 1] if o else self._root
        end = min((o + 1) * B, self._history)
        node = parent.child(tuple(self._tokens[o * B:end]), len(self._pages))
        node.tails += 1  # the new tail keeps our chain attached (see Node.tails)
        if self._nodes:
            self._nodes[-1].tails -= 1
        events = self._mgr.kv_events
        for lc, pages in enumerate(self._pages):
            page = pages[o] if o < len(pages) else None
            if o and parent.pages[lc] is None:  # the parent's first publisher's page was dropped: give it ours
                mine = pages[o - 1] if o - 1 < len(pages) else None
                if mine is not None and mine.node is None:
                    parent.pages[lc] = mine
                    mine.node = parent
                    if events is not None and lc == events.anchor:
                        events.stored(parent, mine.tier, self._salt, self._key_hint(o - 1, B))
            if page is not None and page.node is None and node.pages[lc] is None:
                node.pages[lc] = page
                page.node = node
                if events is not None and lc == events.anchor:
                    events.stored(node, page.tier, self._salt, self._key_hint(o, B) if end - o * B == B else None)
        self._nodes.append(node)

    def _key_hint(self, o: int, B: int) -> int | None:
        """The precomputed key of full block o, if the caller gave one."""
        keys = self._keys
        return keys[o] if keys is not None and o < len(keys) else None

    def commit_pending_stats(self) -> KVCacheStatsDelta:
        """Move this request's pending statistics into the manager's totals and iteration deltas."""
        return self._mgr.commit_stats(self._pending)

    @property
    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Discard pending stats, publish the trailing partial block, release every page."""
        if self._closed:
            return
        mgr = self._mgr
        B = mgr.tokens_per_block
        if self._pending is not None:
            self._pending.discard()
        if (self._root is not None and self._history % B and not self._partial_src
                and len(self._nodes) == self._history // B):
            self._publish(self._history // B, B)
        for pages in self._pages:
            while pages:
                page = pages.pop()
                if page is not None:
                    mgr.release(page, self._active)
        if self._nodes:
            tail = self._nodes[-1]
            tail.tails -= 1
            mgr.reuse.prune(tail)  # only if its pages were dropped while we held it as our tail
        if self._root is not None:
            mgr.reuse.leave(self._root)
        self._active = False
        self._closed = True

    def __repr__(self) -> str:
        return (f"KVCache({self.request_id!r}, history={self._history}, capacity={self._capacity}, "
                f"active={self._active})")
