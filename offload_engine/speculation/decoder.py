"""The decoding loop: a resident draft grows a tree, the (streamed) target verifies it in one pass.

Both caches hold every committed token except the last one, the *root*. One step:
  1. the draft runs on the tokens it has not seen yet (the root included), then grows the tree
     level by level with its own KV cache and the tree's ancestor mask, drawing each node's
     children from its distribution Q (without replacement; top-k at temperature 0);
  2. the target runs once over [root + every tree node] with the ancestor mask and depth-based
     positions;
  3. the tree is verified exactly (sequoia_trees.verify): accepted nodes, then one bonus token;
  4. both caches keep the root and the accepted path with one gather (`KVCache.commit`), and
     the bonus token becomes the next root.
Plain decoding is the same loop with a one-node tree (kind "none"): no draft, and the step is a
target pass over the root and a draw from its distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import optimal_tree
from sequoia_trees.dynamic import BestFirstFrontier
from sequoia_trees.sampling import (SamplingParams, greedy_top_k, logits_to_probs, sample,
                                    sample_with_replacement, sample_without_replacement)
from sequoia_trees.verify import VerifyResult, verify_greedy, verify_stochastic

from ..runtime.kv_cache import KVCache
from ..runtime.model import Transformer

TREE_KINDS = ("sequoia", "specexec", "specinfer", "chain", "none")
# Used by --tree sequoia until a measured vector is given (issue 5 stores measured ones).
GENERIC_ACCEPTANCE = AcceptanceVector((0.55, 0.15, 0.07, 0.04, 0.025, 0.015, 0.01, 0.008))


@dataclass(frozen=True)
class TreeSpec:
    kind: str = "none"
    budget: int = 1  # nodes, the root included
    depth: int = 1  # levels, the root included
    specinfer_width: int = 4  # SpecInfer: independent sequences sharing the root
    acceptance: AcceptanceVector = GENERIC_ACCEPTANCE
    parents: tuple[int, ...] | None = None  # sequoia: the optimal tree, when already built (--tree auto)

    def shape(self) -> tuple[int, ...] | None:
        """Parents of a static tree (BFS order); None for the dynamic (specexec) tree."""
        if self.parents is not None:
            return self.parents
        if self.kind == "none":
            return (-1,)
        if self.kind == "chain":
            return tuple(range(-1, self.depth - 1))
        if self.kind == "specinfer":  # k chains of depth-1 tokens below the root
            parents, k, n = [-1], self.specinfer_width, self.depth - 1
            for level in range(n):
                parents += [0] * k if level == 0 else list(range(1 + (level - 1) * k, 1 + level * k))
            return tuple(parents)
        if self.kind == "sequoia":
            return optimal_tree(self.acceptance, self.budget, self.depth).parents
        return None

    @property
    def max_nodes(self) -> int:
        if self.kind == "specinfer":
            return 1 + self.specinfer_width * (self.depth - 1)
        return self.depth if self.kind == "chain" else self.budget


class Tree:
    """A tree under construction: nodes in BFS order (node 0 is the root), with its ancestor
    mask kept up to date as nodes are added."""

    def __init__(self, root: int, max_nodes: int):
        self.parents, self.tokens, self.depths, self.ranks = [-1], [root], [0], [0]
        self.mask = torch.zeros(max_nodes, max_nodes, dtype=torch.bool)
        self.mask[0, 0] = True

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, parent: int, token: int, rank: int) -> int:
        i = len(self.parents)
        self.parents.append(parent)
        self.tokens.append(token)
        self.depths.append(self.depths[parent] + 1)
        self.ranks.append(rank)
        self.mask[i] = self.mask[parent]
        self.mask[i, i] = True
        return i

    def ancestor_mask(self, device, rows: slice | None = None) -> torch.Tensor:
        n = len(self.parents)
        return self.mask[rows or slice(0, n), :n].to(device)


@dataclass
class StepResult:
    tokens: list[int]  # accepted tokens, then the bonus
    verify: VerifyResult


@dataclass
class CachedSequence:
    """A model's KV cache and the tokens whose K/V fill its first slots. `tokens` is extended
    only after the cache holds them, so after an interruption anywhere (Ctrl-C, a cancelled
    request) `cache[:len(tokens)]` is still exactly the K/V of `tokens`."""
    cache: KVCache
    tokens: list[int]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """KV caches kept from one generation to the next (prefix reuse): a prompt that extends the
    tokens a cache holds (the next turn of the same conversation) prefills only what is new.

    `slots` conversations are kept (each slot one cache per model, allocated on first use at the
    size the placement plan reserves: the context plus the widest pass, so none ever grows). A
    generation takes the slot whose tokens it shares most with, among the slots it would keep at
    least half of (an empty slot counts); when every slot would lose more than half, it takes the
    least recently used one. So a short side request (a desktop assistant asking for a title)
    lands in another slot rather than wiping the conversation, given two slots."""

    def __init__(self, max_capacity: int, slots: int = 1):
        if slots < 1:
            raise ValueError(f"a prefix cache needs at least one slot, got {slots}")
        self.max_capacity = max_capacity  # the context plus the widest forward pass
        self._slots: list[dict[Transformer, CachedSequence]] = [{} for _ in range(slots)]
        self._used = [0] * slots  # when each slot was last chosen (a counter)
        self._clock = 0
        self.current = 0  # the slot of the generation in hand

    def select(self, target: Transformer, ids: list[int]) -> int:
        """Choose the slot for a generation whose prompt is `ids` (see the class docstring)."""
        candidates = []
        for k, seqs in enumerate(self._slots):
            cached = seqs[target].tokens if target in seqs else []
            shared = common_prefix(cached, ids)
            if 2 * shared >= len(cached):  # keeps at least half of what the slot holds (an empty slot too)
                candidates.append((shared, self._used[k], k))  # most shared, then most recently used
        best = max(candidates)[2] if candidates else min(range(len(self._slots)), key=self._used.__getitem__)
        self._clock += 1
        self._used[best] = self._clock
        self.current = best
        return best

    def sequence(self, model: Transformer, capacity: int) -> CachedSequence:
        """The model's cache in the current slot."""
        if capacity > self.max_capacity:
            raise ValueError(f"a generation needs {capacity} cache slots; the prefix cache holds {self.max_capacity}")
        seqs = self._slots[self.current]
        if model not in seqs:
            seqs[model] = CachedSequence(model.new_cache(self.max_capacity), [])
        return seqs[model]

    def tokens(self, model: Transformer) -> list[int]:
        """The tokens the model's cache holds in the current slot."""
        seq = self._slots[self.current].get(model)
        return list(seq.tokens) if seq is not None else []

    def clear(self) -> None:
        for seqs in self._slots:
            seqs.clear()
        self._used = [0] * len(self._slots)


class SpeculativeDecoder:
    """Runs speculation steps for one generation, on fresh caches or on a `PrefixCache`'s."""

    def __init__(self, target: Transformer, draft: Transformer | None, spec: TreeSpec, params: SamplingParams,
                 generator: torch.Generator, capacity: int, prefix_cache: PrefixCache | None = None):
        if spec.kind == "none":
            draft = None  # a one-node tree: the draft has nothing to do (and its cache stays as it was)
        self.target, self.draft, self.spec, self.params, self.g = target, draft, spec, params, generator
        self.static_parents = spec.shape()
        need = capacity + spec.max_nodes
        self.seqs = [prefix_cache.sequence(m, need) if prefix_cache is not None
                     else CachedSequence(m.new_cache(need), []) for m in (target, draft) if m is not None]
        self.target_cache = self.seqs[0].cache
        self.draft_cache = self.seqs[1].cache if draft is not None else None
        self.reused_tokens = 0  # prompt tokens whose target K/V came from the previous generation

    def prefill(self, ids: list[int], chunk: int) -> torch.Tensor:
        """The prompt into both caches (in chunks), after the longest prefix they already hold;
        the target's logits at its last token (so at least that token always runs)."""
        logits = None
        for model, seq in zip((self.target, self.draft), self.seqs):
            cache, dev = seq.cache, model.device
            is_target = model is self.target
            start = min(common_prefix(seq.tokens, ids), len(ids) - 1 if is_target else len(ids), cache.length)
            del seq.tokens[start:]  # the token list first: it may run short of the cache, never past it
            cache.truncate(start)
            if is_target:
                self.reused_tokens = start
            for lo in range(start, len(ids), chunk):
                hi = min(lo + chunk, len(ids))
                rows = slice(hi - lo - 1, hi - lo) if is_target and hi == len(ids) else slice(0, 0)
                out = model.forward(torch.tensor(ids[lo:hi], device=dev), torch.arange(lo, hi, device=dev), cache,
                                    logits_rows=rows)
                cache.advance(hi - lo)
                seq.tokens.extend(ids[lo:hi])
                if is_target and hi == len(ids):
                    logits = out[-1]
        return logits

    def first_token(self, logits: torch.Tensor) -> int:
        """The token after the prompt, from the prefill pass (a one-node tree at the prompt's end)."""
        if self.params.greedy:
            return int(logits.argmax())
        return sample(logits_to_probs(logits, self.params).cpu(), self.g)

    def step(self, root: int) -> StepResult:
        tree = Tree(root, self.spec.max_nodes)
        self._extra: dict[int, list[int]] = {}  # best-first trees: draws left out of the tree, per node
        draft_probs = self._grow(tree) if self.draft is not None else None
        result = self._verify(tree, draft_probs)
        path = [0] + list(result.accepted)
        kept = [tree.tokens[i] for i in path]
        base = self.target_cache.length
        self.target_cache.commit([base + i for i in path])
        self.seqs[0].tokens.extend(kept)
        if self.draft_cache is not None:
            dbase = self.draft_cache.length - len(tree.parents)  # the tree's slots follow the committed ones
            self.draft_cache.truncate(dbase)
            self.draft_cache.commit([dbase + i for i in path])
            self.seqs[1].tokens.extend(kept)
        return StepResult(kept[1:] + [result.bonus_token], result)

    # ---- target side ------------------------------------------------------------------------

    def _verify(self, tree: Tree, draft_probs: torch.Tensor | None) -> VerifyResult:
        model, cache, dev = self.target, self.target_cache, self.target.device
        n, past = len(tree.parents), self.target_cache.length
        mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=dev), tree.ancestor_mask(dev)], dim=1)
        positions = torch.tensor(tree.depths, device=dev) + past
        logits = model.forward(torch.tensor(tree.tokens, device=dev), positions, cache, mask=mask)
        tokens = torch.tensor(tree.tokens)
        if self.params.greedy:
            return verify_greedy(tree.parents, tokens, logits.cpu())
        target_probs = logits_to_probs(logits, self.params).cpu()
        if draft_probs is None:  # a one-node tree: plain sampling
            return VerifyResult((), sample(target_probs[0], self.g), ())
        return verify_stochastic(tree.parents, tokens, target_probs, draft_probs, self.g,
                                 without_replacement=self.spec.kind != "specinfer", extra_draws=self._extra)

    # ---- draft side -------------------------------------------------------------------------

    def _draft_forward(self, tree: Tree, lo: int, hi: int) -> torch.Tensor:
        """Draft logits for tree nodes lo..hi-1 (one level), their K/V kept in the scratch slots."""
        model, cache, dev = self.draft, self.draft_cache, self.draft.device
        tree_base = cache.length - lo  # slot of tree node 0
        mask = torch.cat([torch.ones(hi - lo, tree_base, dtype=torch.bool, device=dev),
                          tree.ancestor_mask(dev, slice(lo, hi))], dim=1)
        positions = torch.tensor(tree.depths[lo:hi], device=dev) + tree_base
        logits = model.forward(torch.tensor(tree.tokens[lo:hi], device=dev), positions, cache, mask=mask)
        cache.advance(hi - lo)
        return logits.cpu()

    def _children_of(self, logits: torch.Tensor, count: int, with_replacement: bool) -> tuple[list[int], torch.Tensor]:
        if self.params.greedy:
            return greedy_top_k(logits, count).tolist(), torch.softmax(logits.float(), -1)
        q = logits_to_probs(logits, self.params)
        draw = sample_with_replacement if with_replacement else sample_without_replacement
        return draw(q, count, self.g).tolist(), q

    def _grow(self, tree: Tree) -> torch.Tensor:
        """Grow the static tree level by level from the root (every level, the leaves included,
        runs through the draft so that any accepted node has its K/V); returns Q [n, V]."""
        parents = self.static_parents
        if parents is None:
            return self._grow_best_first(tree)
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            if p >= 0:
                kids.setdefault(p, []).append(i)
        shape_id = [0]  # tree node -> node of the static shape (a draft out of support leaves gaps)
        q_rows: list[torch.Tensor] = []
        lo = 0
        while lo < len(tree):
            hi = len(tree)
            logits = self._draft_forward(tree, lo, hi)
            for j, node in enumerate(range(lo, hi)):
                want = kids.get(shape_id[node], [])
                if not want:
                    q_rows.append(torch.zeros(logits.shape[-1]))
                    continue
                toks, q = self._children_of(logits[j], len(want), self.spec.kind == "specinfer" and node == 0)
                q_rows.append(q)
                for rank, tok in enumerate(toks):
                    tree.add(node, tok, rank)
                    shape_id.append(want[rank])
            lo = hi
        return torch.stack(q_rows)

    def _grow_best_first(self, tree: Tree) -> torch.Tensor:
        """SpecExec: add the globally most probable candidates in batches, each batch one draft
        forward, until the budget is spent; about depth-1 draft forwards in all. Each node's
        draws that stay out of the tree are kept for verification (see verify_stochastic)."""
        spec = self.spec
        frontier = BestFirstFrontier(spec.depth)
        batch = max(1, (spec.budget - 1) // max(1, spec.depth - 1))
        width = spec.acceptance.width
        scores, q_rows, draws = [0.0], [], {}
        lo, hi = 0, 1
        while True:
            logits = self._draft_forward(tree, lo, hi)
            for j, node in enumerate(range(lo, hi)):
                toks, q = self._children_of(logits[j], width, False)
                q_rows.append(q)
                draws[node] = toks
                logq = torch.log(q[toks].double().clamp_min(1e-300)).tolist()
                frontier.offer(node, scores[node], tree.depths[node], toks, logq)
            room = spec.budget - len(tree)
            if room <= 0 or not len(frontier):
                break
            lo = len(tree)
            for cand in frontier.pop(min(batch, room)):
                tree.add(cand.parent, cand.token, cand.rank)
                scores.append(cand.score)
            hi = len(tree)
        in_tree: dict[int, int] = {}
        for parent in tree.parents[1:]:
            in_tree[parent] = in_tree.get(parent, 0) + 1
        self._extra = {node: toks[in_tree.get(node, 0):] for node, toks in draws.items()}
        return torch.stack(q_rows)
