"""The reuse tree's roots, one per salt, and the match of a new request's prompt against them: how long a
prefix it can reuse. Apart from the manager (kvcache/manager.py), which owns the pages and their tiers: here
is only what is published, and what a match may count of it.
"""

from kvcache.attention import cdiv
from kvcache.events import root_key
from kvcache.tree import Node, Root, last_missing


class ReuseTrees:
    """Every salt's tree of published blocks; a root lives only while a block or a live cache is under it
    (`prune`, `Root.unused`), so the salts ever seen cost the rank nothing."""

    def __init__(self, life_cycles: list, tokens_per_block: int, partial_reuse: bool) -> None:
        self.life_cycles = life_cycles
        self.tokens_per_block = tokens_per_block
        self.partial_reuse = partial_reuse
        self.roots: dict[tuple, Root] = {}  # (type, salt) -> root, only while it is used (`Root.unused`)

    def root(self, salt) -> Root:
        """The tree of one tenant's published blocks, held by the calling cache until its `leave`."""
        # keyed by type and value: salts 1, True and 1.0 compare equal but are different tenants
        key = (type(salt), salt)
        root = self.roots.get(key)
        if root is None:
            root = self.roots[key] = Root(key, len(self.life_cycles))
            root.key = root_key(salt)
        root.tails += 1
        return root

    def leave(self, root: Root) -> None:
        """A cache of the root's salt closed: the root goes if nothing else is under it."""
        root.tails -= 1
        if root.unused:
            self._drop_root(root)

    def prune(self, node: Node) -> None:
        """Remove node's chain of empty nodes (`Node.prune`), and its root once unused, so a salt whose blocks
        are all gone costs the rank nothing. O(nodes removed): no scan of the roots."""
        top = node.prune()
        if isinstance(top, Root) and top.unused:
            self._drop_root(top)

    def _drop_root(self, root: Root) -> None:
        if self.roots.get(root.salt_key) is root:
            del self.roots[root.salt_key]

    def match(self, root: Node, tokens: list, limit: int) -> tuple[int, list[Node], Node | None]:
        """Longest reusable prefix: (matched tokens, full-block nodes, node of the partial block or None)."""
        B = self.tokens_per_block
        nodes: list[Node] = []
        node = root
        for o in range(limit // B):
            child = node.children.get(tuple(tokens[o * B:(o + 1) * B]))
            if child is None:
                break
            nodes.append(child)
            node = child
        n = len(nodes) * B
        partial = None
        if self.partial_reuse and n < limit:
            partial, m = node.best_partial(tokens[n:], min(limit - n, B - 1))
            n += m
        n = self._valid_length(nodes + [partial], n)
        if n % B == 0:
            partial = None
        return n, nodes[: n // B], partial

    def _valid_length(self, holders: list, n: int) -> int:
        """Shrink n until every life cycle has a page for each block it needs (all but the stale ones) at
        history n; `holders[o]` is the node of ordinal o. Shrinking moves the stale ranges, so repeat until
        no life cycle shrinks it further."""
        B = self.tokens_per_block
        changed = True
        while changed and n > 0:
            changed = False
            for lc, cycle in enumerate(self.life_cycles):
                while n > 0:
                    start, end = cycle.attention.stale_range(n)
                    missing = last_missing(holders, lc, cdiv(n, B), start, end)
                    if missing < 0:
                        break
                    n = missing * B
                    changed = True
        return n
