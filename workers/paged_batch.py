"""One forward pass's sequences and the plans their paged attention reads the KV cache by.

`Batch` holds every sequence's place in the flat `[T, hidden]` batch and its positions, and builds (once per
life cycle and window, on first use) the block-table plans that attention gathers K/V through: per sequence
for prefill chunks (`AttnPlan`), and one padded plan for a batch of decodes (`DecodePlan`). Stale
sliding-window blocks (id -1) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# key reads a step's shared prefixes must save before they are attended once per group (SharedPrefixes): an
# estimate, not a measured break-even: the cascade's dozen extra operators a layer (~20 us each at decode sizes)
# cost about what the kernel takes to read ~5,000 keys (~20 GB/s of 1.5 KB keys on this 2-core machine)
CASCADE_MIN_KEYS = 4096


@dataclass
class SeqView:
    """Per-forward bookkeeping of one sequence: where its rows sit in the flat batch, and its positions."""

    offset: int
    n: int
    start: int
    kv: Any
    positions: torch.Tensor  # [n] on the model's device
    plans: dict[tuple[int, int | None], AttnPlan]  # by (life cycle id, window), built on first use


@dataclass
class AttnPlan:
    """Where one sequence writes and reads for one (life cycle, window), shared by the layers with both."""

    write_slots: torch.Tensor  # [n] slot id per new token
    write_offsets: torch.Tensor  # [n] position inside the block
    read_slots: torch.Tensor  # [nb] slots covering key positions [read_lo_block * B, ...)
    key_lo: int  # first key position read, relative to read_lo_block * B
    key_len: int
    mask: torch.Tensor | None  # [n, key_len] bool, True = attend; None = every key (one query) or `causal`
    causal: bool = False  # a whole prompt from position 0 (key_len == n): SDPA's is_causal, no mask


@dataclass
class DecodePlan:
    """All one-token sequences of a forward, attended in one padded batch for one (life cycle, window)."""

    rows: torch.Tensor  # [S] rows of the flat batch
    write_slots: torch.Tensor  # [S]
    write_offsets: torch.Tensor  # [S]
    table: torch.Tensor  # [S, max_blocks] slots, padded with slot 0 (masked out)
    key_lo: torch.Tensor  # [S] int64: the first key position read, relative to the table's first block
    key_len: torch.Tensor  # [S] int64
    valid: torch.Tensor  # [S, max_blocks * B] bool: key inside [key_lo, key_lo + key_len)
    invalid: tuple[torch.Tensor, torch.Tensor]  # (sequence, key) indices of the other positions
    shared: SharedPrefixes | None = None  # prefixes several of the sequences read from the same blocks


@dataclass
class SharedPrefixes:
    """Groups of decoding sequences whose first blocks are the same blocks (a prefix reused from the cache): each
    group's prefix is attended once for all its members, their own keys past it one by one, and the two parts
    merged by their log-sum-exps (cascade attention, as FlashInfer's for a shared prefix on GPUs). A decode step
    then reads a prefix shared by n sequences once, not n times."""

    slots: torch.Tensor  # [G, P] the blocks of each group's prefix, padded with slot 0
    prefix_lo: torch.Tensor  # [G] int64 zeros: a prefix's keys start at its first block's first token
    prefix_len: torch.Tensor  # [G] int64: the tokens of each group's prefix
    members: torch.Tensor  # [G, M] each group's sequences (indices into the plan's rows), padded with the first
    member_valid: torch.Tensor  # [G, M] bool: a real member, not padding
    rows: torch.Tensor  # [n] every member's index, in group order (the flattened valid `members`)
    suffix_lo: torch.Tensor  # [S] key_lo with each member's prefix left out (the kernel's part)
    suffix_len: torch.Tensor  # [S]


class Batch:
    """Everything attention needs about one forward pass; plans are cached per sequence.

    Plans are keyed by (life cycle, window) rather than life cycle alone: kvcache folds a window
    `>= max_seq_len` into the full-attention life cycle, and the layer's own window still shapes its mask.
    Sequences with one new token (decode) are attended together, padded to the longest; longer ones
    (prefill chunks) one by one.
    """

    def __init__(self, seqs: list[SeqView], kv_manager: Any, device: torch.device):
        self.seqs = seqs
        self.decodes = [s for s in seqs if s.n == 1]
        self.prefills = [s for s in seqs if s.n > 1]
        self.mgr = kv_manager
        self.block = int(kv_manager.tokens_per_block)
        self.device = device
        self._decode_plans: dict[tuple[int, int | None], DecodePlan] = {}

    def decode_plan(self, lc: int, window: int | None) -> DecodePlan:
        d = self._decode_plans.get((lc, window))
        if d is None:
            d = self._decode_plans[lc, window] = self._build_decode_plan(lc, window)
        return d

    def _build_decode_plan(self, lc: int, window: int | None) -> DecodePlan:
        """Every decoding sequence's table from plain ints, then one tensor per field. A per-sequence `AttnPlan`
        (several small tensors each, each a host-to-device copy on a GPU) was ~14% of a rank's samples in
        engine_bench's decode (py-spy, built-in model, 16 sequences): its forward 3.76 -> 2.91 ms a step; on
        SmolLM2 the matmuls dominate (decode_bench: 85% aten::mm) and this is noise."""
        B, dev = self.block, self.device
        rows, tables, write_slots, write_offsets, key_lo, key_len = [], [], [], [], [], []
        for s in self.decodes:
            ids = s.kv.block_ids(lc)
            pos = s.start  # its one new token's position
            last_block = pos // B
            if last_block >= len(ids):
                raise RuntimeError(
                    f"kv cache holds {len(ids)} blocks ({len(ids) * B} tokens) for life cycle {lc}, "
                    f"but positions up to {pos} are being written: resize the cache first"
                )
            lo = 0 if window is None else max(0, pos - window + 1)
            first_block = lo // B
            read = ids[first_block : last_block + 1]
            if min(read) < 0:
                stale = [first_block + k for k, i in enumerate(read) if i < 0]
                raise RuntimeError(
                    f"life cycle {lc}: block ordinal(s) {stale} are stale (-1) but inside the attention "
                    f"window of positions [{pos}, {pos + 1}) (window {window})"
                )
            rows.append(s.offset)
            tables.append(read)
            write_slots.append(read[-1])
            write_offsets.append(pos % B)
            key_lo.append(lo - first_block * B)
            key_len.append(pos + 1 - lo)
        shared = self._shared_prefixes(tables, key_lo, key_len) if window is None else None
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        idx = torch.arange(width * B, device=dev)[None, :]
        lo_t = torch.tensor(key_lo, dtype=torch.long, device=dev)
        len_t = torch.tensor(key_len, dtype=torch.long, device=dev)
        valid = (idx >= lo_t[:, None]) & (idx < (lo_t + len_t)[:, None])
        return DecodePlan(
            rows=torch.tensor(rows, device=dev),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=dev),
            write_offsets=torch.tensor(write_offsets, dtype=torch.long, device=dev),
            table=table,
            key_lo=lo_t,
            key_len=len_t,
            valid=valid,
            invalid=torch.nonzero(~valid, as_tuple=True),
            shared=shared,
        )

    def _shared_prefixes(self, tables: list[list[int]], key_lo: list[int],
                         key_len: list[int]) -> SharedPrefixes | None:
        """The groups of sequences whose tables start with the same blocks, each group's prefix the blocks all
        its members share before the one a member writes this step; None unless attending them once saves at
        least CASCADE_MIN_KEYS key reads (below that, its extra operators cost more than they save)."""
        B, dev = self.block, self.device
        by_first: dict[int, list[int]] = {}
        for i, t in enumerate(tables):
            by_first.setdefault(t[0], []).append(i)
        groups: list[tuple[list[int], list[int]]] = []
        saved = 0
        for members in by_first.values():
            if len(members) < 2:
                continue
            ref = tables[members[0]]
            n = min(len(tables[m]) - 1 for m in members)  # never a block a member writes this step
            for m in members[1:]:
                t = tables[m]
                k = 0
                while k < n and t[k] == ref[k]:
                    k += 1
                n = k
            if n and all(key_lo[m] == 0 for m in members):
                groups.append((members, ref[:n]))
                saved += (len(members) - 1) * n * B
        if not groups or saved < CASCADE_MIN_KEYS:
            return None
        width = max(len(p) for _, p in groups)
        most = max(len(m) for m, _ in groups)
        lo, length = list(key_lo), list(key_len)
        for members, prefix in groups:
            for m in members:
                lo[m] = len(prefix) * B
                length[m] = key_len[m] - len(prefix) * B
        return SharedPrefixes(
            slots=torch.tensor([p + [0] * (width - len(p)) for _, p in groups], dtype=torch.long, device=dev),
            prefix_lo=torch.zeros(len(groups), dtype=torch.long, device=dev),
            prefix_len=torch.tensor([len(p) * B for _, p in groups], dtype=torch.long, device=dev),
            members=torch.tensor([m + [m[0]] * (most - len(m)) for m, _ in groups], dtype=torch.long, device=dev),
            member_valid=torch.tensor([[True] * len(m) + [False] * (most - len(m)) for m, _ in groups], device=dev),
            rows=torch.tensor([i for m, _ in groups for i in m], dtype=torch.long, device=dev),
            suffix_lo=torch.tensor(lo, dtype=torch.long, device=dev),
            suffix_len=torch.tensor(length, dtype=torch.long, device=dev),
        )

    def plan(self, s: SeqView, lc: int, window: int | None) -> AttnPlan:
        p = s.plans.get((lc, window))
        if p is None:
            p = s.plans[lc, window] = self._build_plan(s, lc, window)
        return p

    def _build_plan(self, s: SeqView, lc: int, window: int | None) -> AttnPlan:
        B = self.block
        ids = list(s.kv.block_ids(lc))
        end = s.start + s.n  # exclusive
        last_block = (end - 1) // B
        if last_block >= len(ids):
            raise RuntimeError(
                f"kv cache holds {len(ids)} blocks ({len(ids) * B} tokens) for life cycle {lc}, "
                f"but positions up to {end - 1} are being written: resize the cache first"
            )
        lo = 0 if window is None else max(0, s.start - window + 1)
        first_block = lo // B
        needed = ids[first_block : last_block + 1]
        if any(i < 0 for i in needed):
            stale = [first_block + k for k, i in enumerate(needed) if i < 0]
            raise RuntimeError(
                f"life cycle {lc}: block ordinal(s) {stale} are stale (-1) but inside the attention "
                f"window of positions [{s.start}, {end}) (window {window})"
            )
        dev = self.device
        write_blocks = s.positions // B
        table = torch.tensor(ids[: last_block + 1], dtype=torch.long, device=dev)
        q_pos = s.positions[:, None]
        k_pos = torch.arange(lo, end, device=dev)[None, :]
        mask: torch.Tensor | None = None
        # a prompt from position 0 that fits its window: the plain causal mask, which SDPA's flash kernel on CPU
        # applies by skipping the blocks above the diagonal (the same result; 0.6x the time at 1,024 tokens)
        causal = s.n > 1 and s.start == 0 and (window is None or s.n <= window)
        if s.n > 1 and not causal:  # (one query sees exactly keys [lo, start]: no mask needed)
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        return AttnPlan(
            write_slots=table[write_blocks],
            write_offsets=s.positions % B,
            read_slots=table[first_block:],
            key_lo=lo - first_block * B,
            key_len=end - lo,
            mask=mask,
            causal=causal,
        )
