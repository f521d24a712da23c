"""Drafts that cost nothing: speculation trees read off text already seen (SuffixDecoding).

SuffixDecoding (Oliaro et al., 2024; its authors' implementation is ArcticInference's
`suffix_decoding`) drafts with no model: it finds the longest suffix of the tokens so far that
occurred before, in the current prompt and output or in earlier requests' prompts and outputs,
and proposes the continuations that followed it, as a tree scored by how often each one came.
This module does the same with the authors' default parameters:

  * the pattern matched is at most MAX_PATTERN = 64 tokens (their `max_tree_depth`);
  * the tree holds at most SPEC_FACTOR * m nodes below the root for a match of m tokens
    (`max_spec_factor` = 1.0, `max_spec_offset` = 0): a longer match has earned a larger tree;
  * a node's probability is the product of count(child) / count(parent) down its path, nodes are
    added most probable first, and none below MIN_TOKEN_PROB = 0.1 (`min_token_prob`);
  * the current request's text and the store of past requests are searched separately and the
    proposal with the larger score (the sum of its nodes' probabilities: the tokens it expects
    to have accepted) is used.

The structure is a flat token array per source (int32, -1 between sequences), searched by a
vectorized scan that narrows the occurrences of the last token one token further back at a time
(`longest_match`). A pointer-based suffix tree in Python costs a hundred bytes or more per node
and up to MAX_PATTERN nodes per token; the array costs 4 bytes a token, so `--suffix-memory`
(in tokens) is the memory it takes, and a lookup over a million stored tokens takes a few
milliseconds (benchmarks/suffix_lookup.py), next to a target pass of hundreds of milliseconds to
seconds.

Exactness: every node of a suffix tree is a fixed proposal (all its probability on its own
token), decided before the target is read; `sequoia_trees.verify` accepts it with the residual
target probability of its token and removes the token from the residual on rejection.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

MAX_PATTERN = 64  # longest suffix matched (ArcticInference: max_tree_depth = 64)
SPEC_FACTOR = 1.0  # nodes below the root <= SPEC_FACTOR * match length (max_spec_factor = 1.0)
MIN_TOKEN_PROB = 0.1  # nodes less likely than this are not proposed (min_token_prob = 0.1)
MAX_OCCURRENCES = 256  # the most recent occurrences of the match whose continuations are counted
DEFAULT_MEMORY = 1_000_000  # tokens kept in the store of past requests (--suffix-memory)
SUFFIX = "suffix"  # the --draft name, alone or after a model draft's: "default+suffix"


def split_draft(draft) -> tuple[str | None, bool]:
    """(model draft, suffix?) of a --draft value: "suffix" -> (None, True); "X+suffix" -> (X, True)."""
    from ..errors import UserError
    if draft is None:
        return None, False
    text = str(draft)
    if text == SUFFIX:
        return None, True
    if text.endswith("+" + SUFFIX):
        model = text[: -len(SUFFIX) - 1]
        if not model.strip() or model == SUFFIX or model.endswith("+" + SUFFIX):
            raise UserError(f"--draft {text}: name a draft model before '+suffix' (a folder, 'default', "
                            "'self-int8' or 'self-int4'), or give 'suffix' alone")
        return model, True
    return draft, False


@dataclass(frozen=True)
class SuffixProposal:
    """A speculation tree from earlier text: node 0 is the root (the last token), parents come
    before their children, and siblings are in the order they are to be tested (most frequent
    first). probs: each node's estimated probability of being reached (the root's is 1)."""
    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    probs: tuple[float, ...]
    match_length: int
    source: str  # "context" (this request's text), "store" (earlier requests') or "" (no match)

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def score(self) -> float:
        """Expected accepted tokens by the proposal's own estimate."""
        return float(sum(self.probs[1:]))


def empty_proposal(root: int) -> SuffixProposal:
    return SuffixProposal((-1,), (root,), (1.0,), 0, "")


def longest_match(text: np.ndarray, pattern: np.ndarray, max_len: int = MAX_PATTERN) -> tuple[int, np.ndarray]:
    """The longest m <= max_len such that pattern[-m:] occurs in `text` with a token after it,
    and the positions of each such occurrence's last token (ascending). (0, []) when even the
    last token never occurs with a successor. -1 in text separates sequences: never matched,
    never a successor."""
    n = len(text)
    if n < 2 or len(pattern) == 0:
        return 0, np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(text[: n - 1] == pattern[-1])
    ends = ends[text[ends + 1] >= 0]
    m, limit = 1, min(max_len, len(pattern))
    while len(ends) and m < limit:
        back = ends - m
        ok = back >= 0
        nxt = ends[ok][text[back[ok]] == pattern[-1 - m]]
        if not len(nxt):
            break
        ends, m = nxt, m + 1
    return (m, ends) if len(ends) else (0, ends)


def propose(text: np.ndarray, pattern: np.ndarray, root: int, max_nodes: int, source: str,
            max_pattern: int = MAX_PATTERN) -> SuffixProposal:
    """The tree of continuations after the longest match of `pattern` (whose last token is the
    root) in `text`, at most max_nodes nodes in all, the root included."""
    m, ends = longest_match(text, pattern, max_pattern)
    budget = min(max_nodes - 1, int(math.floor(SPEC_FACTOR * m)))
    if m == 0 or budget < 1:
        return empty_proposal(root)
    ends = ends[-MAX_OCCURRENCES:]  # the most recent ones
    idx = ends[:, None] + 1 + np.arange(budget)[None, :]
    rows = np.where(idx < len(text), text[np.minimum(idx, len(text) - 1)], -1)
    rows = np.where(np.cumsum(rows < 0, axis=1) > 0, -1, rows)  # cut at a separator or the end
    uniq, counts = np.unique(rows, axis=0, return_counts=True)
    # a trie of the continuations with their counts
    children: list[dict[int, int]] = [{}]
    count = [int(counts.sum())]
    toks = [root]
    for row, c in zip(uniq.tolist(), counts.tolist()):
        node = 0
        for t in row:
            if t < 0:
                break
            nxt = children[node].get(t)
            if nxt is None:
                nxt = len(toks)
                children[node][t] = nxt
                children.append({})
                count.append(0)
                toks.append(t)
            count[nxt] += c
            node = nxt
    # most probable first, a sibling never before a more frequent one (ties: the smaller token)
    parents, tokens, probs = [-1], [root], [1.0]
    order = itertools.count()
    heap: list[tuple[float, int, int, int]] = []

    def offer(trie_node: int, tree_node: int, prob: float) -> None:
        for t, child in sorted(children[trie_node].items(), key=lambda kv: (-count[kv[1]], kv[0])):
            p = prob * count[child] / count[trie_node]
            if p >= MIN_TOKEN_PROB:
                heapq.heappush(heap, (-p, next(order), child, tree_node))

    offer(0, 0, 1.0)
    while heap and len(parents) <= budget:
        neg, _, child, parent = heapq.heappop(heap)
        parents.append(parent)
        tokens.append(toks[child])
        probs.append(-neg)
        offer(child, len(parents) - 1, -neg)
    return SuffixProposal(tuple(parents), tuple(tokens), tuple(probs), m, source)


class SuffixStore:
    """Earlier requests' prompts and outputs, per key (an API key, a conversation, or one shared
    key), at most `capacity` tokens across all keys (4 bytes each): the oldest sequences are
    forgotten first. A request's prompt usually repeats its conversation's earlier turns, which
    the key already holds: only the rest is added, and it continues the stored text (no separator
    between them). Thread-safe; `snapshot(key)` is a copy a request searches (taken once per
    request, freed with it)."""

    def __init__(self, capacity: int = DEFAULT_MEMORY):
        if capacity < 0:
            raise ValueError(f"the suffix store's capacity must be >= 0 tokens, got {capacity}")
        self.capacity = capacity
        # per key: (serial, tokens, continues the sequence before it)
        self._seqs: dict[object, deque[tuple[int, np.ndarray, bool]]] = {}
        self._order: deque[tuple[int, object]] = deque()  # (serial, key), oldest first
        self._serial = itertools.count()
        self.tokens = 0
        self._lock = threading.Lock()

    def add(self, key, prompt: list[int], output: list[int] = ()) -> None:
        """One request's text for `key`: the prompt's tokens past what the key's stored text
        already begins with (earlier turns of the same conversation), then the output; the
        oldest sequences go while over capacity."""
        if self.capacity == 0:
            return
        with self._lock:
            seqs = self._seqs.get(key)
            shared = 0
            if seqs:
                held = np.concatenate([a for _, a, _ in seqs])
                n = min(len(held), len(prompt))
                diff = np.flatnonzero(held[:n] != np.asarray(prompt[:n], dtype=np.int32))
                shared = int(diff[0]) if len(diff) else n
            ids = list(prompt[shared:]) + list(output)
            if not ids:
                return
            continues = bool(seqs) and shared == sum(len(a) for _, a, _ in seqs)
            arr = np.asarray(ids[-self.capacity:], dtype=np.int32)
            serial = next(self._serial)
            self._seqs.setdefault(key, deque()).append((serial, arr, continues and len(arr) == len(ids)))
            self._order.append((serial, key))
            self.tokens += len(arr)
            while self.tokens > self.capacity:
                _, old_key = self._order.popleft()
                _, old, _ = self._seqs[old_key].popleft()
                self.tokens -= len(old)
                if not self._seqs[old_key]:
                    del self._seqs[old_key]
                else:  # the new first sequence continues nothing
                    s, a, _ = self._seqs[old_key][0]
                    self._seqs[old_key][0] = (s, a, False)

    def snapshot(self, key) -> np.ndarray:
        """A copy of the key's text, -1 after each sequence that the next does not continue
        (empty when it has none)."""
        with self._lock:
            parts = []
            for _, arr, continues in self._seqs.get(key, ()):
                if parts and not continues:
                    parts.append(np.full(1, -1, dtype=np.int32))
                parts.append(arr)
            if parts:
                parts.append(np.full(1, -1, dtype=np.int32))
            return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    def keys(self) -> int:
        with self._lock:
            return len(self._seqs)

    def clear(self) -> None:
        with self._lock:
            self._seqs.clear()
            self._order.clear()
            self.tokens = 0


class SuffixDrafter:
    """One generation's suffix drafts: its own text so far (prompt and output) and a snapshot of
    the store's sequences for its key. Counts what it proposed (`stats`)."""

    def __init__(self, prompt: list[int], store_text: np.ndarray, max_nodes: int):
        self.max_nodes = max_nodes
        self._text = np.empty(max(16, 2 * len(prompt)), dtype=np.int32)
        self._len = 0
        self.extend(prompt)
        self.store_text = store_text
        self.lookups = self.matched = self.from_store = 0
        self.proposed_nodes = 0
        self.lookup_seconds = 0.0

    def extend(self, ids: list[int]) -> None:
        if self._len + len(ids) > len(self._text):
            grown = np.empty(2 * (self._len + len(ids)), dtype=np.int32)
            grown[: self._len] = self._text[: self._len]
            self._text = grown
        self._text[self._len: self._len + len(ids)] = ids
        self._len += len(ids)

    def truncate(self, n: int) -> None:
        """Forget the text after its first n tokens."""
        self._len = min(self._len, n)

    @property
    def text(self) -> np.ndarray:
        return self._text[: self._len]

    def propose(self, root: int, max_nodes: int | None = None) -> SuffixProposal:
        """The better of the two sources' trees after the text so far and `root` (the last token,
        not yet in the text)."""
        import time
        t0 = time.perf_counter()
        budget = min(self.max_nodes, max_nodes or self.max_nodes)
        context = np.append(self.text, np.int32(root))
        best = propose(context, context, root, budget, "context")
        if len(self.store_text):
            other = propose(self.store_text, context, root, budget, "store")
            if other.score > best.score:
                best = other
        self.lookups += 1
        if best.size > 1:
            self.matched += 1
            self.from_store += best.source == "store"
            self.proposed_nodes += best.size - 1
        self.lookup_seconds += time.perf_counter() - t0
        return best

    def stats(self) -> dict:
        return {"lookups": self.lookups, "matched_steps": self.matched, "store_matched_steps": self.from_store,
                "proposed_nodes": self.proposed_nodes, "lookup_ms": 1e3 * self.lookup_seconds / max(1, self.lookups),
                "store_tokens": int((self.store_text >= 0).sum())}


def graft(parents: list[int], tokens: list[int], proposal: SuffixProposal,
          room: int) -> tuple[list[int], list[int], list[int]]:
    """A model draft's tree (parents, tokens: node 0 the root) with the proposal's paths added
    where the model did not propose them: a proposal node whose token a model child of the same
    parent already has follows that child; any other becomes a new node (at most `room` of them,
    appended after the model's nodes, so that under each parent the model's children come first).
    Returns the grown parents and tokens and the indices of the new (fixed) nodes."""
    parents, tokens = list(parents), list(tokens)
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        kids.setdefault(parents[i], {}).setdefault(tokens[i], i)
    where = {0: 0}  # proposal node -> tree node
    added: list[int] = []
    for i in range(1, proposal.size):
        parent = where.get(proposal.parents[i])
        if parent is None:  # its parent did not fit
            continue
        tok = proposal.tokens[i]
        existing = kids.get(parent, {}).get(tok)
        if existing is not None:
            where[i] = existing
            continue
        if len(added) >= room:
            continue
        where[i] = len(parents)
        kids.setdefault(parent, {})[tok] = len(parents)
        added.append(len(parents))
        parents.append(parent)
        tokens.append(tok)
    return parents, tokens, added
