"""The counting structure of suffix decoding (``proposers.suffix`` drafts with it): a trie of every
substring up to a depth, with single occurrences left implicit in their sequence."""

from __future__ import annotations

import heapq


class SuffixTrie:
    """Occurrence counts of every substring of at most ``depth`` tokens of the sequences added.

    Node 0 is the root (the empty string). ``count[n]`` is how many times node n's string
    occurred; for an *explicit* node, ``total[n]`` is how many of those occurrences were
    followed by a token (the sum of its children's counts), so ``count[child] / total[n]``
    is the empirical probability of the child's token after n's string.

    A string seen once needs no subtree: its only continuation is in the sequence it came
    from. So a node is created *implicit* (one occurrence, ``ref`` = (sequence, position of
    its last token), children read from the sequence) and made explicit (its old
    occurrence's next token becomes a child) only when a second occurrence arrives, as a
    suffix tree's leaves point into the text. Nodes grow with the repeated material, not
    with length x depth. A match or a tree position is a *state* (node, extra): the node's
    string followed by ``extra`` more tokens of its sequence (extra > 0 only below an
    implicit node).
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.seqs: dict[int, list[int]] = {}
        self.children: list[dict[int, int] | None] = [{}]
        self.explicit = [True]
        self.token = [-1]
        self.parent = [-1]
        self.level = [0]
        self.count = [0]
        self.total = [0]
        self.ref = [(-1, -1)]
        self.free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.token) - len(self.free)

    def _new(self, parent: int, token: int, ref: tuple[int, int]) -> int:
        """A new implicit child of ``parent`` with no occurrence yet."""
        fields = (None, False, token, parent, self.level[parent] + 1, 0, 0, ref)
        if self.free:
            node = self.free.pop()
            (self.children[node], self.explicit[node], self.token[node], self.parent[node], self.level[node], self.count[node],
             self.total[node], self.ref[node]) = fields  # fmt: skip
        else:
            node = len(self.token)
            for column, value in zip(
                (self.children, self.explicit, self.token, self.parent, self.level, self.count, self.total, self.ref), fields, strict=True
            ):
                column.append(value)
        self.children[parent][token] = node
        return node

    def _make_explicit(self, node: int, old: tuple[int, int]) -> None:
        """Give ``node`` its children: the token after its earlier occrrence ``old`` (if any, and within depth)."""
        self.explicit[node], self.children[node], self.total[node] = True, {}, 0
        seq, pos = old
        tokens = self.seqs[seq]
        if pos + 1 < len(tokens) and self.level[node] < self.depth:
            child = self._new(node, tokens[pos + 1], (seq, pos + 1))
            self.count[child] = self.total[node] = 1

    def append(self, active: list[int], seq: int, pos: int) -> list[int]:
        """Count the occurrences ending at ``seqs[seq][pos]``, given ``active``: the nodes of the
        occurrences ending at ``pos - 1`` (shortest first). Return the new ones. O(repeated length)."""
        token = self.seqs[seq][pos]
        out = []
        for node in reversed([0] + active):  # deepest first: a node counted here is never read again this step
            if not self.explicit[node] or self.level[node] >= self.depth:
                continue  # an implicit node's continuation is in its sequence already
            child = self.children[node].get(token)
            if child is None:
                child = self._new(node, token, (seq, pos))
            old = self.ref[child]
            self.count[child] += 1
            self.ref[child] = (seq, pos)
            self.total[node] += 1
            if self.count[child] == 2 and not self.explicit[child]:
                self._make_explicit(child, old)
            out.append(child)
        out.reverse()
        return out

    def add(self, seq: int, tokens: list[int]) -> None:
        """Add a whole sequence under id ``seq`` (kept: implicit nodes read it)."""
        self.seqs[seq] = tokens
        active: list[int] = []
        for pos in range(len(tokens)):
            active = self.append(active, seq, pos)

    def remove(self, seq: int) -> None:
        """Subtract sequence ``seq``'s occurrences; free the nodes left with none."""
        active: list[int] = []
        emptied: list[int] = []
        for token in self.seqs[seq]:
            out = []
            for node in [0] + active:
                if self.explicit[node] and self.level[node] < self.depth:
                    child = self.children[node][token]
                    self.total[node] -= 1
                    self.count[child] -= 1
                    if self.count[child] == 0:
                        emptied.append(child)
                    out.append(child)
            active = out
        for node in emptied:  # a child's occurrences are its parent's: an emptied parent goes with its subtree
            parent = self.parent[node]
            if parent == 0 or self.count[parent] > 0:
                del self.children[parent][self.token[node]]
            self.children[node] = None
            self.free.append(node)
        del self.seqs[seq]

    # -- reading: states (node, extra) -------------------------------------------------

    def _next_token(self, node: int, extra: int) -> int | None:
        """The token after an implicit state (node, extra), from its sequence; None at its end or at depth."""
        seq, pos = self.ref[node]
        tokens = self.seqs[seq]
        at = pos + 1 + extra
        return tokens[at] if at < len(tokens) and self.level[node] + extra < self.depth else None

    def follow(self, states: list[tuple[int, int]], token: int, max_level: int) -> list[tuple[int, int]]:
        """Matching without counting: the states of ``states`` (shortest first) extended by ``token`` that
        occurred, and the one-token string; none longer than ``max_level``."""
        out = []
        first = self.children[0].get(token)
        if first is not None:
            out.append((first, 0))
        for node, extra in states:
            if self.level[node] + extra >= max_level:
                continue
            if extra == 0 and self.explicit[node]:
                child = self.children[node].get(token)
                if child is not None:
                    out.append((child, 0))
            elif self._next_token(node, extra) == token:
                out.append((node, extra + 1))
        return out

    def continued(self, node: int, extra: int) -> bool:
        """Whether the state was ever followed by a token."""
        if extra == 0 and self.explicit[node]:
            return self.total[node] > 0
        return self._next_token(node, extra) is not None

    def speculate(self, node: int, extra: int, budget: int, max_depth: int, min_prob: float) -> tuple[list[int], list[int], float]:
        """The best-first tree of continuations of state (node, extra): (tokens, parents, score).

        A node's probability is the product of ``count[child] / total[parent]`` along its
        path (1 below an implicit node: one occurrence); the most probable frontier node is
        added next, while it reaches ``min_prob`` and the tree has fewer than ``budget``
        nodes. Score: the sum of the probabilities, the expected accepted length under the counts.
        """
        tokens: list[int] = []
        parents: list[int] = []
        score = 0.0
        heap: list[tuple[float, int, int, int, int, int, int]] = []
        order = 0

        def push(at: int, at_extra: int, prob: float, parent_index: int, depth: int) -> None:
            nonlocal order
            if depth > max_depth:
                return
            if at_extra == 0 and self.explicit[at]:
                if self.total[at] == 0:
                    return
                for token, child in self.children[at].items():
                    p = prob * self.count[child] / self.total[at]
                    if p >= min_prob:
                        heapq.heappush(heap, (-p, order, token, child, 0, parent_index, depth))
                        order += 1
            else:
                token = self._next_token(at, at_extra)
                if token is not None and prob >= min_prob:
                    heapq.heappush(heap, (-prob, order, token, at, at_extra + 1, parent_index, depth))
                    order += 1

        push(node, extra, 1.0, -1, 1)
        while heap and len(tokens) < budget:
            neg_prob, _, token, at, at_extra, parent_index, depth = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent_index)
            score -= neg_prob
            push(at, at_extra, -neg_prob, len(tokens) - 1, depth + 1)
        return tokens, parents, score
