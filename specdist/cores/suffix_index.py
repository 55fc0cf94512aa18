"""Suffix drafting (model-free): a count trie over the token sequences a drafter has seen.

What: in the spirit of SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; Snowflake's
Arctic Inference), a draft is read off the statistics of earlier text: find the longest
suffix of the request's sequence that occurred before *with a continuation*, and follow the
most frequent continuation. Unlike prompt lookup (:mod:`specdist.cores.proposers.ngram`, one sequence, the
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
  (docs/performance.md), by which the length rule prices draft positions
  (:mod:`specdist.engine.draft_length`). The draft's **score** is the sum of the
  path probabilities of its tokens, the expected number of accepted tokens if the counts
  were the target's law (SuffixDecoding's score): the hybrid drafter uses it to choose.
  Cost O(D) per drafted token (+ the branching of a node whose cached argmax went stale).
- **Memory bound**: a released sequence stays in the trie as a *cached* one; beyond
  ``cache_requests`` of them, or ``cache_tokens`` of their tokens, the oldest is evicted by
  decrementing exactly the counts its insertion added (O(len * D)), pruning nodes whose count
  reaches 0 (a bound in requests alone let long requests hold gigabytes). The live sequences of
  the core are held in addition. A new sequence that begins with a cached one (a conversation's next
  turn: the last prompt, its answer, a new question) **supersedes** it: that text is all in the new one,
  and counted twice, after k turns the session's first answer would weigh k times against its latest.
  With one index a tenant (:class:`SuffixIndexes`) the bounds are one budget for all the indexes
  together: the least recently used tenant's oldest sequence goes first. Node count <= sum over held
  sequences of len * D (repeated text shares nodes, and a pruned node's id is reused). A node is an id
  into lists of ints (one ``{token: child}`` dict more where it branches), so the garbage collector has
  no object per node to walk. Its memory and times per token: docs/performance.md, "Figures moved from
  docstrings".

Exactness: the draft is a function of committed tokens only (this request's and others'),
fixed before the target verifies it; ``q`` is one-hot on it, accepted with probability
``p(x)`` (docs/exactness.md section 1). Because the index is shared, a seeded request's tokens at
temperature > 0 may depend on what other requests wrote before (its law does not).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass

from specdist.config import SCOPES

__all__ = ["SuffixDraft", "SuffixIndex", "SuffixIndexes", "SuffixSettings", "SuffixState"]


@dataclass(frozen=True)
class SuffixSettings:
    """The suffix draft's parameters (``draft.suffix_*`` in the config)."""

    max_depth: int = 24  # D: longest substring counted (and longest match + 1)
    min_prob: float = 0.1  # stop the draft before its path probability drops below this
    max_spec_factor: float = 1.0  # at most floor(factor * match length) tokens
    cache_requests: int = 256  # finished sequences kept (oldest evicted first)
    cache_tokens: int = 262_144  # their tokens kept at most (oldest evicted first): about 0.45 GB of trie
    min_score: float = 2.0  # hybrid: take the suffix draft when its score is >= this, else the model's
    scope: str = "tenant"  # one index a tenant, or "shared" by every request (SuffixIndexes)


ROOT = 0  # the root's node id: the empty string
HEAD = 16  # a cached sequence is found again by its first HEAD tokens (SuffixIndex.supersede)
_NONE = -1  # no node


class SuffixState:
    """A live sequence in the index: its tokens and the nodes of its suffixes of length 0..D."""

    __slots__ = ("tokens", "active", "done")

    def __init__(self):
        self.tokens = array("q")  # [n] the sequence (kept to evict it later)
        self.active: list[int] = [ROOT]  # [min(n, D) + 1]: active[d] = id of the node of tokens[n-d:]
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
    finished ones. Not thread-safe (a drafter core calls it one call at a time).

    A node is an integer id into parallel lists (``token``, ``count``, ``csum``, ``best``, ``kids``)
    rather than an object. The lists hold ints and ``{token: child}`` dicts of ints, none of which
    the garbage collector tracks: the hundreds of thousands of nodes of a busy index are five lists
    to a full collection, not hundreds of thousands of objects to walk (which took about half a
    second in a 16-request engine). Pruned ids are reused."""

    def __init__(self, max_depth: int = 24, cache_requests: int = 256, cache_tokens: int = 262_144):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match and its continuation), got {max_depth}")
        if cache_requests < 0 or cache_tokens < 0:
            raise ValueError(f"cache_requests and cache_tokens must be >= 0, got {cache_requests}, {cache_tokens}")
        self.max_depth = int(max_depth)
        self.cache_requests = int(cache_requests)
        self.cache_tokens = int(cache_tokens)
        self.cached_tokens = 0  # tokens of the cached sequences
        # per node id (the root included):
        self.token: list[int] = [-1]  # the edge label into the node
        self.count: list[int] = [0]  # occurrences of the node's string
        self.csum: list[int] = [0]  # sum of the children's counts (occurrences followed by another token)
        self.best: list[int] = [_NONE]  # cached most frequent child of a branching node (ties: smaller token)
        self.kids: list = [_NONE]  # _NONE, the one child's id, or a dict token -> child id (two or more)
        self.free: list[int] = []  # ids of pruned nodes, reused first
        self.num_nodes = 0  # nodes below the root
        self.live = 0  # live sequences held
        self.cached: deque[array] = deque()  # finished sequences, oldest first
        self.by_head: dict[bytes, list[array]] = {}  # cached sequences of >= HEAD tokens by their first HEAD tokens

    @property
    def root(self) -> int:
        return ROOT

    def child(self, node: int, t: int) -> int | None:
        """The child of ``node`` labelled ``t``, if any."""
        k = self.kids[node]
        if type(k) is int:
            return k if k != _NONE and self.token[k] == t else None
        return k.get(t)

    def children(self, node: int) -> list[int]:
        k = self.kids[node]
        return ([] if k == _NONE else [k]) if type(k) is int else list(k.values())

    # ------------------------------------------------------------ insertion
    def start(self, tokens=()) -> SuffixState:
        """A new live sequence holding ``tokens``, which supersedes every cached sequence it begins with
        (:meth:`supersede`). O(len * D)."""
        st = self._begin(tokens)  # first: the superseded sequences' nodes are then still counted, not pruned
        self.supersede(st.tokens)  # (the array: ``tokens`` may have been an iterator)
        return st

    def _begin(self, tokens) -> SuffixState:
        st = SuffixState()
        self.live += 1
        self.extend(st, tokens)
        return st

    def supersede(self, tokens) -> int:
        """Evict each cached sequence (of at least ``HEAD`` tokens) that ``tokens`` begins with; how many.

        Such a prompt was built on that request (a conversation's next turn: the last prompt, its answer, the new
        question), so all of its text is in the new sequence: kept as well, every turn of a session would count
        its earlier turns again, and the index would weigh a conversation's first answer k times after k turns,
        drafting the old answers' continuations with a confidence no recurrence earned. Only an exact continuation:
        where the client sent the answer back as text, encoded again (sampled ids often differ from their text's
        encoding), the old sequence stays, its answer in the model's own tokens, which drafts the next answer
        better than the prompt's copy (superseding on the old prompt alone was measured worse: docs/performance.md,
        "Does holding a session draft it better?"). O(the lengths of the cached sequences that begin with the same
        HEAD tokens) to find them, O(len x D) each to evict."""
        if not self.cached or len(tokens) < HEAD:
            return 0
        seq = tokens if isinstance(tokens, array) else array("q", tokens)
        found = [c for c in self.by_head.get(seq[:HEAD].tobytes(), ()) if len(c) <= len(seq) and seq[: len(c)] == c]
        for c in found:
            self.cached.remove(c)
            self._unlist(c)
            self.cached_tokens -= len(c)
            self._remove(c)
        return len(found)

    def _unlist(self, tokens: array) -> None:
        """Take a cached sequence out of ``by_head``."""
        if len(tokens) >= HEAD:
            key = tokens[:HEAD].tobytes()
            same = self.by_head[key]
            same.remove(tokens)
            if not same:
                del self.by_head[key]

    def _new(self, t: int) -> int:
        """A node labelled ``t`` with count 0 and no children (not yet linked to a parent)."""
        if self.free:
            c = self.free.pop()
            self.token[c], self.count[c], self.csum[c], self.best[c], self.kids[c] = t, 0, 0, _NONE, _NONE
            return c
        self.token.append(t)
        self.count.append(0)
        self.csum.append(0)
        self.best.append(_NONE)
        self.kids.append(_NONE)
        return len(self.token) - 1

    def extend(self, st: SuffixState, tokens) -> None:
        """Append committed tokens to a live sequence. O(D) per token."""
        if st.done:
            raise ValueError("the sequence was finished")
        depth, created = self.max_depth, 0
        token, count, csum, best, kids = self.token, self.count, self.csum, self.best, self.kids
        for t in tokens:
            t = int(t)
            new = [ROOT]
            for node in st.active[:depth]:  # nodes of depth < D get child t (inlined: the hot loop)
                csum[node] += 1
                k = kids[node]
                if type(k) is int:
                    if k == _NONE:
                        c = kids[node] = self._new(t)
                        created += 1
                    elif token[k] == t:
                        c = k
                    else:
                        c = self._new(t)
                        kids[node] = {token[k]: k, t: c}
                        best[node] = _NONE
                        created += 1
                else:
                    c = k.get(t)
                    if c is None:
                        c = k[t] = self._new(t)
                        created += 1
                    b = best[node]
                    if (
                        b != _NONE
                        and b != c
                        and (count[c] + 1 > count[b] or (count[c] + 1 == count[b] and t < token[b]))
                    ):
                        best[node] = c
                count[c] += 1
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
        if len(st.tokens) >= HEAD:
            self.by_head.setdefault(st.tokens[:HEAD].tobytes(), []).append(st.tokens)
        self.cached_tokens += len(st.tokens)
        while self.cached and (len(self.cached) > self.cache_requests or self.cached_tokens > self.cache_tokens):
            self._evict_oldest()

    def add(self, tokens) -> None:
        """Insert a finished sequence (begun and finished: it supersedes nothing, an equal one counts twice)."""
        self.finish(self._begin(tokens))

    def forget_finished(self) -> None:
        """Remove every cached finished sequence; live sequences keep their counts and states."""
        while self.cached:
            self._evict_oldest()

    def _evict_oldest(self) -> int:
        """Evict the oldest cached sequence; its length."""
        tokens = self.cached.popleft()
        self._unlist(tokens)
        self.cached_tokens -= len(tokens)
        self._remove(tokens)
        return len(tokens)

    def evict_oldest(self) -> int:
        """Evict the oldest cached sequence (there must be one); its length in tokens."""
        return self._evict_oldest()

    def _remove(self, tokens) -> None:
        """Subtract exactly the counts inserting ``tokens`` added; prune nodes left at 0. O(len * D).

        A node reaching 0 had this walk's occurrence as its last one, so below it only this
        walk's path remains (each node at count 1): it is cut off whole and its ids freed."""
        n, depth = len(tokens), self.max_depth
        count, csum, best, kids = self.count, self.csum, self.best, self.kids
        for i in range(n):
            end = min(n, i + depth)
            node = ROOT
            for j in range(i, end):
                t = tokens[j]
                k = kids[node]
                c = k if type(k) is int else k[t]
                count[c] -= 1
                csum[node] -= 1
                if count[c] == 0:
                    if type(k) is int:
                        kids[node] = _NONE
                    else:
                        del k[t]
                        if len(k) == 1:
                            (kids[node],) = k.values()
                        best[node] = _NONE
                    while c != _NONE:  # c and the path below it, each node (count 1) with one child at most
                        self.free.append(c)
                        c = kids[c]
                    self.num_nodes -= end - j
                    break
                if best[node] == c:
                    best[node] = _NONE  # lost a count: maybe no longer the most frequent
                node = c

    def _best(self, node: int) -> int:
        """The most frequent child (ties: the smaller token). Only called with csum > 0."""
        k = self.kids[node]
        if type(k) is int:
            return k
        b = self.best[node]
        if b == _NONE:  # O(children), after the cached one lost a count
            count, token = self.count, self.token
            b = self.best[node] = min(k.values(), key=lambda c: (-count[c], token[c]))
        return b

    # ------------------------------------------------------------ lookup
    def lookup(self, st: SuffixState, k: int, min_prob: float = 0.1, max_spec_factor: float = 1.0) -> SuffixDraft:
        """Up to k tokens after the live sequence (see the module docstring). O(D) per token."""
        csum, count, token = self.csum, self.count, self.token
        active = st.active
        m = len(active) - 1
        while m >= 1 and csum[active[m]] == 0:
            m -= 1
        if m < 1 or k <= 0:
            return SuffixDraft([], 0.0, max(m, 0), [])
        cap = min(k, int(max_spec_factor * m + 1e-9))
        toks: list[int] = []
        depths: list[int] = []
        score, prob = 0.0, 1.0
        ctx, node, d, depth = active, active[m], m, self.max_depth
        while len(toks) < cap:
            c = self._best(node)
            prob *= count[c] / csum[node]
            if prob < min_prob:
                break
            t = token[c]
            toks.append(t)
            depths.append(d)
            score += prob
            if len(toks) == cap:
                break
            nxt = [ROOT]  # the suffixes of sequence + drafts that occur: a contiguous run of depths
            for x in ctx[:depth]:
                x = self.child(x, t)
                if x is None:
                    break
                nxt.append(x)
            ctx = nxt
            d = len(ctx) - 1
            while d >= 1 and csum[ctx[d]] == 0:
                d -= 1
            if d < 1:
                break
            node = ctx[d]
        return SuffixDraft(toks, score, m, depths)

    # ------------------------------------------------------------ introspection
    def stats(self) -> dict:
        return {
            "nodes": self.num_nodes,
            "live": self.live,
            "cached": len(self.cached),
            "cached_tokens": self.cached_tokens,
        }


class SuffixIndexes:
    """A drafter's suffix indexes: one a tenant (``scope`` "tenant": a request drafts from the text of its own
    tenant's requests only, so no tenant learns another's text from its own acceptance), or one for everyone
    (``scope`` "shared"). ``settings``' bounds (``cache_requests``, ``cache_tokens``) are one budget for all the
    indexes together, not one each (20 tenants would hold 20 times the bound): past it, the least recently used
    tenant's oldest cached sequence is evicted first. An index left with nothing is dropped."""

    def __init__(self, settings: SuffixSettings):
        if settings.scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {SCOPES}, got {settings.scope!r}")
        self.settings, self.scope = settings, settings.scope
        self.indexes: dict[str, SuffixIndex] = {}  # least recently used tenant first

    def for_tenant(self, tenant: str) -> SuffixIndex:
        """The index a request of ``tenant`` reads and writes (now the most recently used)."""
        key = tenant if self.scope == "tenant" else ""
        index = self.indexes.pop(key, None)
        if index is None:
            st = self.settings
            index = SuffixIndex(st.max_depth, st.cache_requests, st.cache_tokens)
        self.indexes[key] = index
        return index

    def finish(self, index: SuffixIndex, st: SuffixState) -> None:
        """A request of ``index`` ends (:meth:`SuffixIndex.finish`), its index now the most recently used; the
        budget is enforced over every index; an index that then holds nothing is dropped."""
        index.finish(st)
        key = next((k for k, held in self.indexes.items() if held is index), None)
        if key is not None:
            self.indexes[key] = self.indexes.pop(key)
        self._within_budget()
        self.indexes = {k: i for k, i in self.indexes.items() if i.live or i.cached}

    def _within_budget(self) -> None:
        """Evict cached sequences, the least recently used tenant's oldest first, until the indexes together hold
        at most ``cache_requests`` of them and ``cache_tokens`` of their tokens."""
        st = self.settings
        requests = sum(len(i.cached) for i in self.indexes.values())
        tokens = sum(i.cached_tokens for i in self.indexes.values())
        for index in list(self.indexes.values()):
            while index.cached and (requests > st.cache_requests or tokens > st.cache_tokens):
                tokens -= index.evict_oldest()
                requests -= 1

    def forget_finished(self) -> None:
        for index in list(self.indexes.values()):
            index.forget_finished()
        self.indexes = {k: i for k, i in self.indexes.items() if i.live}

    def stats(self) -> dict:
        """The indexes' sizes summed, and how many there are."""
        out = {"nodes": 0, "live": 0, "cached": 0, "cached_tokens": 0}
        for index in self.indexes.values():
            for k, v in index.stats().items():
                out[k] += v
        out["indexes"] = len(self.indexes)
        return out
