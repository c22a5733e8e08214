"""Attention kinds as small policies: which block ordinals a life cycle no longer needs, and how many it holds.

As vLLM's `FullAttentionManager` / `SlidingWindowManager` and TensorRT-LLM's `get_stale_range`: the cache and
the manager ask the policy, and never branch on the window themselves. Ranges are half-open `(start, end)`
block ordinals; an empty range has `start == end`.
"""

NEVER = 1 << 62  # a history no request reaches


def cdiv(n: int, d: int) -> int:
    """ceil(n / d) for ints: blocks needed for n tokens at d tokens a block."""
    return -(-n // d)


class FullAttention:
    """Every block stays needed; sink tokens mean nothing here (they are normalised to 0)."""

    can_go_stale = False  # lets the per-commit loop skip life cycles that never release a block
    sink_blocks = 0

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block

    def stale_range(self, history: int) -> tuple[int, int]:
        return 0, 0

    def stale_at(self, o: int) -> int:
        return NEVER

    def blocks_needed(self, num_tokens: int, chunk_tokens: int) -> int:
        """Most blocks one request of `num_tokens` holds at once."""
        return cdiv(num_tokens, self.tokens_per_block)


class SlidingWindow:
    """A window of `window_size` tokens after `num_sink_tokens` sink tokens that are always kept (SPEC 1)."""

    can_go_stale = True

    def __init__(self, tokens_per_block: int, window_size: int, num_sink_tokens: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.window_size = window_size
        self.sink_blocks = cdiv(num_sink_tokens, tokens_per_block)

    def stale_range(self, history: int) -> tuple[int, int]:
        """`[min(nb, sink_blocks), max(start, (h + 1 - w) // B))`: the blocks the next token cannot see."""
        B = self.tokens_per_block
        start = min(cdiv(history, B), self.sink_blocks)
        return start, max(start, (history + 1 - self.window_size) // B)

    def stale_at(self, o: int) -> int:
        """The shortest history at which block o (at or past the sinks) is stale: lets commit() skip the
        stale range until it moves."""
        return (o + 1) * self.tokens_per_block + self.window_size - 1

    def blocks_needed(self, num_tokens: int, chunk_tokens: int) -> int:
        """Sinks, the window and one prefill chunk, plus the two blocks the window may straddle."""
        B = self.tokens_per_block
        return min(cdiv(num_tokens, B), self.sink_blocks + (self.window_size + chunk_tokens) // B + 2)


def attention_policy(tokens_per_block: int, window_size: int | None, num_sink_tokens: int):
    """The policy of one (normalised) attention shape: `window_size=None` is full attention."""
    if window_size is None:
        return FullAttention(tokens_per_block)
    return SlidingWindow(tokens_per_block, window_size, num_sink_tokens)
