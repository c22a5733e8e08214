"""The reuse tree: published token blocks, chained from a per-salt root.

A node is one token block (`tokens_per_block` tokens, or fewer for a trailing partial block published on
close) under its parent; its key is the tuple of its tokens, looked up in the parent's children, so keys are
verified against the stored tokens and cannot collide. Each node holds one page per life cycle (None where
that life cycle's page was dropped or never stored, e.g. stale sliding-window blocks).
"""


class Node:
    __slots__ = ("tokens", "parent", "children", "by_first", "pages", "depth", "tails", "key")

    def __init__(self, tokens: tuple, parent: "Node | None", num_life_cycles: int) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.by_first: dict[int, list[Node]] = {}  # first token -> children, for partial matching
        self.pages: list = [None] * num_life_cycles
        self.depth = 0 if parent is None else parent.depth + 1  # block ordinal + 1; root is 0
        # live caches whose last published (or matched) block this is: they publish their next block under
        # it, so it must stay attached to the tree even when its pages are dropped (its ancestors stay
        # because it is their descendant)
        self.tails = 0
        self.key: int | None = None  # the block key of kvcache/events.py, set while KV events are on

    def child(self, tokens: tuple, num_life_cycles: int) -> "Node":
        node = self.children.get(tokens)
        if node is None:
            node = Node(tokens, self, num_life_cycles)
            self.children[tokens] = node
            self.by_first.setdefault(tokens[0], []).append(node)
        return node

    def best_partial(self, tokens: list, limit: int) -> tuple["Node | None", int]:
        """The child sharing the longest common prefix (< its length or partial) with `tokens[:limit]`."""
        best, best_len = None, 0
        if limit <= 0:
            return best, best_len
        for node in self.by_first.get(tokens[0], ()):
            n = 0
            for a, b in zip(node.tokens, tokens[:limit], strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len and any(p is not None for p in node.pages):
                best, best_len = node, n
        return best, best_len

    def prune(self) -> "Node":
        """Remove this node and its empty ancestors once they hold no page, no child and no live cache's tail;
        returns the first node kept (the root when the chain went up to it), for the caller to drop an
        unused root (`Root.unused`) in O(1)."""
        node = self
        while (node.parent is not None and not node.children and not node.tails
               and all(p is None for p in node.pages)):
            parent = node.parent
            del parent.children[node.tokens]
            siblings = parent.by_first[node.tokens[0]]
            siblings.remove(node)
            if not siblings:
                del parent.by_first[node.tokens[0]]
            node.parent = None
            node = parent
        return node


class Root(Node):
    """One salt's tree. Its `tails` counts the live caches of the salt (they may publish under it any time), so
    it is unused, and can go, once it has no child and no live cache: memory stays bounded by the blocks held,
    not by the salts ever seen."""

    __slots__ = ("salt_key",)

    def __init__(self, salt_key: tuple, num_life_cycles: int) -> None:
        super().__init__((), None, num_life_cycles)
        self.salt_key = salt_key  # its key in the manager's roots

    @property
    def unused(self) -> bool:
        return not self.children and not self.tails


def last_missing(holders: list, lc: int, nb: int, start: int, end: int) -> int:
    """The highest ordinal below nb and outside the stale range [start, end) whose holder has no page of
    life cycle lc, or -1."""
    for o in range(nb - 1, end - 1, -1):
        if holders[o].pages[lc] is None:
            return o
    for o in range(start - 1, -1, -1):
        if holders[o].pages[lc] is None:
            return o
    return -1
