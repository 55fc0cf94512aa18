"""Suffix drafting (model-free): a count trie over the token sequences a drafter has seen.

What: in the spirit of SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; Snowflake's
Arctic Inference), a draft is read off the statistics of earlier text: find the longest
suffix of the request's sequence that occurred before *with a continuation*, and follow the
most frequent continuation. Unlike prompt lookup (:mod:`specdist.cores.ngram`, one sequence, the
latest occurrence) the index holds **every request** of a drafter core, prompts and outputs:
the live ones as they grow and up to ``cache_requests`` finished ones, so agentic loops,
code edits ("rewrite this text"), and repeated prompts draft long runs at no model cost.
Why our own: the ``arctic-inference`` package needs CUDA builds; this is pure Python.

The index is a **count trie of bounded depth** ``D = max_depth``: every substring of length
<= D of every sequence it holds is a path from the root, and a node's ``count`` is the
number of its occurrences (over all held sequences). ``csum`` is the sum of its children's
counts, i.e. the occurrences *followed by another token*; a node with ``csum == 0`` has no
continuation. ``count(child) <= count(node)`` always holds.

- **Insertion** is incremental: a live sequence keeps its *active nodes*, the nodes of its
  suffixes of length 0..D (``active[d]`` has depth d; they always exist, since the sequence
  itself is in the trie). Appending token t creates/increments ``child(active[d], t)`` for
  d < D: O(D) per token.
- **Lookup** (a draft after the live sequence): the deepest active node (depth m >= 1) with
  ``csum > 0``: the longest suffix that occurred with a continuation. The live sequence's own
  occurrence at its end has no continuation (it is counted in ``count``, never in ``csum``),
  so it never matches itself there. From that node follow the most frequent child (ties: the
  smaller token id), multiplying ``child.count / node.csum`` into the path probability, and
  stop before a token that would take it below ``min_prob``; the draft is at most
  ``min(k, floor(max_spec_factor * m))`` tokens (SuffixDecoding's cap: short matches give
  short drafts). After each drafted token the active nodes are extended *virtually* (nothing
  is written) and the walk continues from the deepest of them with a continuation, which is
  the plain greedy descent while it lasts and falls back to a shorter suffix where the depth
  bound (or the end of the matched text) stops it. Each token records the depth of the node it
  was read from (``depths``: its match length), the best predictor of its acceptance measured
  (BENCHMARKS.md), by which the length rule prices draft positions
  (:mod:`specdist.engine.draft_length`). The draft's **score** is the sum of the
  path probabilities of its tokens, the expected number of accepted tokens if the counts
  were the target's law (SuffixDecoding's score): the hybrid drafter uses it to choose.
  Cost O(D) per drafted token (+ the branching of a node whose cached argmax went stale).
- **Memory bound**: a released sequence stays in the trie as a *cached* one; beyond
  ``cache_requests`` of them the oldest is evicted by decrementing exactly the counts its
  insertion added (O(len * D)), pruning nodes whose count reaches 0. The live sequences of
  the core are held in addition. Node count <= sum over held sequences of len * D (repeated
  text shares nodes); a node is a 72-byte object (one dict more where it branches). Measured
  (CPython 3.11, D = 24, Zipf-distributed tokens over a 49k vocabulary, i.e. text without
  long repeats): 22.7 nodes and about 1.8 kB per token held, 33 us per token inserted, 5 us
  per token evicted, a lookup of 4 tokens a few us. 256 finished requests of 1,000 tokens:
  up to about 0.5 GB.

Exactness: the draft is a function of committed tokens only (this request's and others'),
fixed before the target verifies it; ``q`` is one-hot on it, accepted with probability
``p(x)`` (spec-math.md section 1). Because the index is shared, a seeded request's tokens at
temperature > 0 may depend on what other requests wrote before (its law does not).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

__all__ = ["SuffixDraft", "SuffixIndex", "SuffixSettings", "SuffixState"]


@dataclass(frozen=True)
class SuffixSettings:
    """The suffix draft's parameters (``draft.suffix_*`` in the config)."""

    max_depth: int = 24  # D: longest substring counted (and longest match + 1)
    min_prob: float = 0.1  # stop the draft before its path probability drops below this
    max_spec_factor: float = 1.0  # at most floor(factor * match length) tokens
    cache_requests: int = 256  # finished sequences kept (oldest evicted first)
    min_score: float = 2.0  # hybrid: take the suffix draft when its score is >= this, else the model's


class _Node:
    """One trie node: the string on the path from the root, ending in ``token``."""

    __slots__ = ("token", "count", "csum", "kids", "best")

    def __init__(self, token: int):
        self.token = token  # the edge label into this node (-1 at the root)
        self.count = 0  # occurrences of this node's string
        self.csum = 0  # sum of the children's counts (occurrences followed by another token)
        self.kids: "_Node | dict[int, _Node] | None" = None  # one child inline, or a dict token -> child
        self.best: "_Node | None" = None  # cached most frequent child (dict case); None: recompute


def _child(node: _Node, t: int) -> "_Node | None":
    kids = node.kids
    if kids is None:
        return None
    if type(kids) is _Node:
        return kids if kids.token == t else None
    return kids.get(t)


def _best(node: _Node) -> _Node:
    """The most frequent child (ties: the smaller token). Only called with csum > 0."""
    kids = node.kids
    if type(kids) is _Node:
        return kids
    b = node.best
    if b is None:  # O(children), after the cached one lost a count
        b = node.best = min(kids.values(), key=lambda c: (-c.count, c.token))
    return b


class SuffixState:
    """A live sequence in the index: its tokens and the nodes of its suffixes of length 0..D."""

    __slots__ = ("tokens", "active", "done")

    def __init__(self, root: _Node):
        self.tokens = array("q")  # [n] the sequence (kept to evict it later)
        self.active: list[_Node] = [root]  # [min(n, D) + 1]: active[d] = node of tokens[n-d:]
        self.done = False

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class SuffixDraft:
    tokens: list[int]  # [<= k]
    score: float  # sum of the path probabilities of the tokens (expected accepted tokens by the counts)
    match_len: int  # length m of the matched suffix (0: none)
    depths: list[int]  # [len(tokens)] per token, the length of the matched context it was read after


class SuffixIndex:
    """Count trie of depth <= ``max_depth`` over the live sequences and up to ``cache_requests``
    finished ones. Not thread-safe (a drafter core calls it one call at a time)."""

    def __init__(self, max_depth: int = 24, cache_requests: int = 256):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match and its continuation), got {max_depth}")
        if cache_requests < 0:
            raise ValueError(f"cache_requests must be >= 0, got {cache_requests}")
        self.max_depth = int(max_depth)
        self.cache_requests = int(cache_requests)
        self.root = _Node(-1)
        self.num_nodes = 0  # nodes below the root
        self.live = 0  # live sequences held
        self.cached: deque[array] = deque()  # finished sequences, oldest first

    # ------------------------------------------------------------ insertion
    def start(self, tokens=()) -> SuffixState:
        """A new live sequence holding ``tokens``. O(len * D)."""
        st = SuffixState(self.root)
        self.live += 1
        self.extend(st, tokens)
        return st

    def extend(self, st: SuffixState, tokens) -> None:
        """Append committed tokens to a live sequence. O(D) per token."""
        if st.done:
            raise ValueError("the sequence was finished")
        depth, created = self.max_depth, 0
        for t in tokens:
            t = int(t)
            new = [self.root]
            for node in st.active[:depth]:  # nodes of depth < D get child t (inlined: the hot loop)
                node.csum += 1
                kids = node.kids
                if kids is None:
                    c = node.kids = _Node(t)
                    created += 1
                elif type(kids) is _Node:
                    if kids.token == t:
                        c = kids
                    else:
                        c = _Node(t)
                        node.kids = {kids.token: kids, t: c}
                        node.best = None
                        created += 1
                else:
                    c = kids.get(t)
                    if c is None:
                        c = kids[t] = _Node(t)
                        created += 1
                    b = node.best
                    if b is not None and b is not c and (c.count + 1 > b.count or
                                                         (c.count + 1 == b.count and t < b.token)):
                        node.best = c
                c.count += 1
                new.append(c)
            st.active = new
            st.tokens.append(t)
        self.num_nodes += created

    def finish(self, st: SuffixState) -> None:
        """The live sequence ends (request released): it stays as a cached sequence, and the
        oldest cached ones beyond ``cache_requests`` are evicted. Idempotent."""
        if st.done:
            return
        st.done = True
        st.active = []
        self.live -= 1
        self.cached.append(st.tokens)
        while len(self.cached) > self.cache_requests:
            self._remove(self.cached.popleft())

    def add(self, tokens) -> None:
        """Insert a finished sequence (start + finish)."""
        self.finish(self.start(tokens))

    def forget_finished(self) -> None:
        """Remove every cached finished sequence; live sequences keep their counts and states."""
        while self.cached:
            self._remove(self.cached.popleft())

    def _remove(self, tokens) -> None:
        """Subtract exactly the counts inserting ``tokens`` added; prune nodes left at 0. O(len * D).

        A node reaching 0 had this walk's occurrence as its last one, so below it only this
        walk's path remains (each node at count 1): it is cut off whole."""
        n, depth = len(tokens), self.max_depth
        for i in range(n):
            end = min(n, i + depth)
            node = self.root
            for j in range(i, end):
                t = tokens[j]
                c = _child(node, t)
                c.count -= 1
                node.csum -= 1
                if c.count == 0:
                    kids = node.kids
                    if type(kids) is _Node:
                        node.kids = None
                    else:
                        del kids[t]
                        if len(kids) == 1:
                            (node.kids,) = kids.values()
                        node.best = None
                    self.num_nodes -= end - j  # c and the rest of this walk's path below it
                    break
                if node.best is c:
                    node.best = None  # lost a count: maybe no longer the most frequent
                node = c

    # ------------------------------------------------------------ lookup
    def lookup(self, st: SuffixState, k: int, min_prob: float = 0.1, max_spec_factor: float = 1.0) -> SuffixDraft:
        """Up to k tokens after the live sequence (see the module docstring). O(D) per token."""
        active = st.active
        m = len(active) - 1
        while m >= 1 and active[m].csum == 0:
            m -= 1
        if m < 1 or k <= 0:
            return SuffixDraft([], 0.0, max(m, 0), [])
        cap = min(k, int(max_spec_factor * m + 1e-9))
        toks: list[int] = []
        depths: list[int] = []
        score, prob = 0.0, 1.0
        ctx, node, d, depth = active, active[m], m, self.max_depth
        while len(toks) < cap:
            c = _best(node)
            prob *= c.count / node.csum
            if prob < min_prob:
                break
            t = c.token
            toks.append(t)
            depths.append(d)
            score += prob
            if len(toks) == cap:
                break
            nxt = [self.root]  # the suffixes of sequence + drafts that occur: a contiguous run of depths
            for x in ctx[:depth]:
                x = _child(x, t)
                if x is None:
                    break
                nxt.append(x)
            ctx = nxt
            d = len(ctx) - 1
            while d >= 1 and ctx[d].csum == 0:
                d -= 1
            if d < 1:
                break
            node = ctx[d]
        return SuffixDraft(toks, score, m, depths)

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        return {"nodes": self.num_nodes, "live": self.live, "cached": len(self.cached),
                "cached_tokens": sum(len(s) for s in self.cached)}
