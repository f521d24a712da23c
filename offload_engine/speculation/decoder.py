"""The decoding loop: a resident draft grows a tree, the (streamed) target verifies it in one pass.

Both caches hold every committed token except the last one, the *root*. One step:
  1. the draft runs on the tokens it has not seen yet (the root included), then grows the tree
     level by level with its own KV cache and the tree's ancestor mask, drawing each node's
     children from its distribution Q (without replacement, Gumbel top-k; top-k at temperature 0);
  2. the target runs once over [root + every tree node] with the ancestor mask and depth-based
     positions;
  3. the tree is verified exactly (sequoia_trees.verify): accepted nodes, then one bonus token;
  4. both caches keep the root and the accepted path with one gather (`KVCache.commit`), and
     the bonus token becomes the next root.
Plain decoding is the same loop with a one-node tree (kind "none"): no draft, and the step is a
target pass over the root and a draw from its distribution.

Where the work happens (the same code on the CPU and on a GPU): logits never leave the device
they are computed on. A static tree's shape (mask, positions, which row each child's token comes
from) is built once per decoder on the device; each draft level picks every node's children at
once on the device and writes their tokens into a device tensor, so a static tree's growth has no
host round trip at all. Greedy verification compares on the device and moves the tokens and the
argmax of each node (2n integers); stochastic verification either walks on the host
(`verify_stochastic`, the default where the device is the CPU) or computes its acceptance table on
the device (`verify_stochastic_table`, the default on a GPU) and moves that table, the tokens and
every node's bonus drawn ahead, in one transfer.
Best-first (specexec) trees move each level's few candidates and their log-probabilities to the
host, where the frontier lives. A child the draft could not draw (its support ran out) keeps the
token -1: it runs through the passes as token 0, is never accepted, and changes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import optimal_tree
from sequoia_trees.dynamic import BestFirstFrontier
from sequoia_trees.tree import end_probabilities
from sequoia_trees.sampling import SamplingParams, gumbel_top_k, logits_to_probs, sample
from sequoia_trees.verify import VerifyResult, verify_greedy_argmax, verify_stochastic, verify_stochastic_table

from ..runtime.draft_graphs import StaticLevels
from ..runtime.kv_cache import KVCache
from ..runtime.model import Transformer
from .suffix import SuffixDrafter, SuffixProposal, graft

TREE_KINDS = ("sequoia", "specexec", "specinfer", "chain", "none")
# How stochastic verification runs: "walk" on the host (cheapest where logits already are there),
# "table" on the logits' device (a GPU: nothing but small tables crosses), "auto" by device.
VERIFY_MODES = ("auto", "walk", "table")
# How draft levels run: "on" as captured CUDA graphs (runtime/draft_graphs.py), "eager" as the same
# padded static passes without capture (how the CPU tests check them), "off" as plain passes;
# "auto": "on" where the draft is on a GPU, else "off".
DRAFT_GRAPH_MODES = ("auto", "on", "eager", "off")
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


class StaticShape:
    """A static tree's shape on the device, built once per decoder: the ancestor mask, each node's
    depth, and per level the rows and ranks that place the draft's choices as the next level's
    tokens (nodes in BFS order, so a level is a contiguous range)."""

    def __init__(self, parents: tuple[int, ...], device: torch.device):
        n = len(parents)
        depths = [0] * n
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, n):
            p = parents[i]
            if not 0 <= p < i or depths[p] + 1 < depths[i - 1]:
                raise ValueError(f"tree shape not in BFS order at node {i}: {parents}")
            depths[i] = depths[p] + 1
            mask[i] = mask[p]
            mask[i, i] = True
        self.parents, self.n, self.host_depths = parents, n, depths
        self.mask = mask.to(device)
        self.depths = torch.tensor(depths, device=device)
        bounds = [0] + [i for i in range(1, n) if depths[i] != depths[i - 1]] + [n]
        self.levels = []  # (lo, hi, children: (lo, hi, parent row in level, rank) or None)
        rank_of = [0] * n
        seen: dict[int, int] = {}
        for i in range(1, n):
            rank_of[i] = seen.get(parents[i], 0)
            seen[parents[i]] = rank_of[i] + 1
        self.rank_of, self._end_scores = rank_of, {}
        for lo, hi, nxt in zip(bounds, bounds[1:], bounds[2:] + [None]):
            if nxt is None:
                self.levels.append((lo, hi, None))
                continue
            rows = torch.tensor([parents[j] - lo for j in range(hi, nxt)], device=device)
            ranks = torch.tensor([rank_of[j] for j in range(hi, nxt)], device=device)
            self.levels.append((lo, hi, (hi, nxt, rows, ranks, max(rank_of[hi:nxt]) + 1)))

    def end_scores(self, acceptance: AcceptanceVector) -> torch.Tensor:
        """[n, AHEAD_GUESSES]: per node and guess g, the probability, by the acceptance vector,
        that a step ends at the node with the draft's g-th choice outside its children as the
        bonus token: the path's acceptance (probs[rank] per edge) times probs[children + g] (past
        the vector's ranks, half the probability it leaves)."""
        key = (acceptance, AHEAD_GUESSES)
        if key not in self._end_scores:
            end = end_probabilities(self.parents, tuple(self.rank_of), acceptance, AHEAD_GUESSES)
            self._end_scores[key] = torch.tensor(end, dtype=torch.float32, device=self.mask.device)
        return self._end_scores[key]


def _host_mask(parents: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ancestor mask and depths of a small tree given by its parents (each before its children)."""
    n = len(parents)
    mask, depths = torch.zeros(n, n, dtype=torch.bool), [0] * n
    for i in range(n):
        if parents[i] >= 0:
            mask[i] = mask[parents[i]]
            depths[i] = depths[parents[i]] + 1
        mask[i, i] = True
    return mask.to(device), torch.tensor(depths, device=device)


class Tree:
    """A best-first tree under construction: nodes in the order they were added (node 0 is the
    root), on the host, with its ancestor mask kept up to date on the device."""

    def __init__(self, root: int, max_nodes: int, device: torch.device):
        self.parents, self.tokens, self.depths = [-1], [root], [0]
        self.mask = torch.zeros(max_nodes, max_nodes, dtype=torch.bool, device=device)
        self.mask[0, 0] = True

    def __len__(self) -> int:
        return len(self.parents)

    def add_level(self, parents: list[int], tokens: list[int]) -> None:
        """Nodes added together (one draft forward); their mask rows built with one gather."""
        lo = len(self.parents)
        for p, t in zip(parents, tokens):
            self.parents.append(p)
            self.tokens.append(t)
            self.depths.append(self.depths[p] + 1)
        hi = len(self.parents)
        new = torch.arange(lo, hi, device=self.mask.device)
        self.mask[lo:hi] = self.mask[torch.tensor(parents, device=self.mask.device)]
        self.mask[new, new] = True


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
    levels: StaticLevels | None = None  # the draft's padded (graphed) level passes over this cache
    view: KVCache | None = None  # a substitute draft's view of this (the target's) cache


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

    def drop(self, model: Transformer | None) -> None:
        """Forget one model's caches in every slot (a draft replaced by another: `Engine.switch_draft`)."""
        for seqs in self._slots:
            seqs.pop(model, None)
            for seq in seqs.values():  # (a substitute draft's levels live on the target's sequence)
                if seq.levels is not None and seq.levels.model is model:
                    seq.levels = None


AHEAD_JOBS = 4  # next trees grown ahead at once, for the most probable ends of this step
AHEAD_GUESSES = 2  # bonus tokens considered per end node: the draft's best ones outside its children
AHEAD_WIDTH = 8  # nodes per batched level grown ahead: the top jobs whose level fits (at least one)


@dataclass
class AheadJob:
    """The next tree for one case of this step's outcome: the accepted path ends at `anchor`
    (a node of this step's tree) and the bonus token is `guess`."""
    anchor: int
    guess: int
    tokens: torch.Tensor  # [n] the next tree's tokens (-1: not drawn yet)
    q_rows: list  # Q rows of its levels run, in order
    guesses: torch.Tensor  # [n, AHEAD_GUESSES] per node run: the draft's best tokens outside its children
    done: int = 0  # levels run (forward and children)


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], bool]]:
    """(a host copy of t, ready()): on CUDA the copy is queued on the current stream into pinned
    memory, and ready() says when it has landed (no wait for the work queued before it); on the
    CPU it is t itself, ready at once."""
    if t.device.type != "cuda":
        return t, lambda: True
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    return host, done.query


@dataclass
class GrownAhead:
    """Next trees grown ahead during this step's target pass (ShadowSpec): for the few most
    probable ends of this step (`AheadJob`, by the acceptance vector), the tree the next step
    would grow if that case came, level by level, in batched draft passes (their K/V in the
    draft cache's slots after this step's tree, job k's node j at slot0 + k*n + j). A job is
    used only when its case comes; it is a proposal, never a decision: verification is as always."""
    shape: "StaticShape"
    kind: str  # the tree kind it was grown for (specinfer draws its first level with replacement)
    base: int  # the draft cache's committed length during the pass (this tree's node 0 is there)
    slot0: int  # the first slot after this step's tree
    jobs: list
    seconds: float = 0.0  # draft time spent on it inside the pass
    levels: int = 0  # batched levels run
    # the jobs' choice on its way to the host, (tensor, ready()), until the first unit makes the jobs
    # from it: on CUDA a copy queued behind the draft's last level, so that the step queues its
    # target pass at once instead of waiting for that level to run (38 ms held on the H200's
    # (128, 12) step, 2026-12-04); on the CPU it is there already
    pending: tuple | None = None


@dataclass
class StepTimes:
    """Wall seconds of one step's parts: the draft (catching up on tokens it missed, then the
    tree's levels), the target's pass with verification, and the whole step (commits included)."""
    draft: float
    target: float
    total: float
    catch_up: float = 0.0  # of the draft's part: tokens it missed while steps decoded plainly
    ahead: float = 0.0  # draft work done inside the target's pass (the next tree grown ahead)
    ahead_levels: int = 0  # levels of this step's tree that were grown ahead in the last pass

    @property
    def rest(self) -> float:
        return self.total - self.draft - self.target


class SpeculativeDecoder:
    """Runs speculation steps for one generation, on fresh caches or on a `PrefixCache`'s.

    verify: one of VERIFY_MODES (where stochastic verification runs; "auto" walks on the host
    when the target computes on the CPU and uses the device table on a GPU).
    draft_graphs: one of DRAFT_GRAPH_MODES (how the draft's levels run).
    max_nodes: the largest tree a later `set_spec` may ask for (online re-planning); with it the
    draft's cache is kept even while the spec is plain decoding, and a draft that sat out some
    steps catches up on their tokens before it grows the next tree. Each step's parts are timed
    (`last_times`; on a GPU the draft's part is synchronized only when `timed`).
    suffix: a `SuffixDrafter` (drafts from text already seen, `speculation/suffix.py`). Without a
    draft model each step's tree is its proposal (a one-node tree when nothing matched); with one,
    its paths are grafted onto the model's tree, after the model's children of each node. Its nodes
    are fixed proposals in verification; a grafted node has no draft K/V, so the draft catches up
    on an accepted one at its next step. choose(proposal): for a step with a proposal, "model" (the
    spec's tree alone), "suffix" (the proposal alone: the draft sits the step out) or "hybrid"
    (`OnlinePlanner.choose_arm`), or ("suffix" or "model", the part of the proposal to run)
    (`SuffixGate.choose`); without it, hybrid when there is a draft model, else the proposal.
    A draft with `shares_cache` (a substitute self-draft) runs on the target's cache: no cache,
    prefill or catching up of its own. overlap: while the target's pass waits for streamed layers
    (`LayerExecutor.idle`), the draft grows the next step's static tree ahead for the likeliest
    ends of this one (`GrownAhead`); "eager" runs all of that before the pass instead. ahead_gate:
    with overlap, an `OverlapGate` (`--overlap auto`) that says before each step whether it grows
    ahead, and is told after it what growing cost and gained."""

    def __init__(self, target: Transformer, draft: Transformer | None, spec: TreeSpec, params: SamplingParams,
                 generator: torch.Generator, capacity: int, prefix_cache: PrefixCache | None = None,
                 verify: str = "auto", draft_graphs: str = "auto", max_nodes: int | None = None,
                 timed: bool = False, suffix: SuffixDrafter | None = None,
                 choose: Callable[[SuffixProposal], str | tuple[str, SuffixProposal]] | None = None,
                 overlap: bool | str = False, ahead_gate=None):
        if spec.kind == "none" and max_nodes is None:
            draft = None  # a one-node tree: the draft has nothing to do (and its cache stays as it was)
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        if draft_graphs not in DRAFT_GRAPH_MODES:
            raise ValueError(f"draft_graphs must be one of {DRAFT_GRAPH_MODES}, got {draft_graphs!r}")
        self.target, self.draft, self.spec, self.params, self.g = target, draft, spec, params, generator
        self.verify_mode = verify if verify != "auto" else ("walk" if target.device.type == "cpu" else "table")
        self.max_nodes = max(spec.max_nodes, max_nodes or 1)
        self.suffix = suffix
        self.graft_room = suffix.max_nodes - 1 if suffix is not None else 0  # nodes a proposal may add
        self.suffix_accepted = 0  # accepted tokens that were suffix nodes
        self.last_model_verify: VerifyResult | None = None  # the last step's verification, model nodes only
        self.choose = choose
        self.last_arm, self.last_proposal = "model", None  # what the last step ran, and its suffix proposal
        self.timed = timed
        self.last_times = StepTimes(0.0, 0.0, 0.0)
        self._used_ahead = 0  # levels of the step's tree that came grown ahead
        self.chunk = 256  # set by prefill
        need = base_need = capacity + self.max_nodes + self.graft_room
        # overlap: while the target's pass waits for streamed layers, the draft grows the next
        # tree ahead (`GrownAhead`), in the draft cache's slots after this step's tree
        # ("eager": every level grown ahead runs before the pass, on any target: tests, and
        # what the grown-ahead trees give when there is time for all of them)
        self.ahead_eager = overlap == "eager"
        self.overlap = bool(overlap) and draft is not None and (self.ahead_eager or hasattr(target.layers, "idle"))
        if self.overlap:
            need += AHEAD_JOBS * self.max_nodes
            if prefix_cache is not None:  # (near the context's end it then grows nothing ahead)
                need = max(base_need, min(need, prefix_cache.max_capacity))
        self._ahead: GrownAhead | None = None  # being grown during this step's pass
        self._ready: tuple[GrownAhead, int] | None = None  # (grown, job) for the step that starts now
        self._tree_guesses = None  # per node of the step's tree, the bonus guess (where ahead jobs start)
        self._ahead_work = None  # the generator growing them (`_grow_ahead`)
        self.ahead_hits = self.ahead_misses = 0
        self.ahead_gate = ahead_gate if self.overlap and not self.ahead_eager else None
        self._overrun_seen = target.layers.overrun_seconds() if self.ahead_gate is not None else 0.0
        # a substitute self-draft shares the target's cache: one sequence, the draft writing its
        # tree's K/V after the committed length through a view (the target's pass then writes
        # its own K/V over the same slots, and only accepted ones are committed)
        self.shared = draft is not None and draft.shares_cache
        self.seqs = [prefix_cache.sequence(m, need) if prefix_cache is not None
                     else CachedSequence(m.new_cache(need), []) for m in (target, draft)
                     if m is not None and not (self.shared and m is draft)]
        self.target_cache = self.seqs[0].cache
        if self.shared and self.seqs[0].view is None:
            self.seqs[0].view = self.target_cache.view()
        self.draft_seq = None if draft is None else self.seqs[0] if self.shared else self.seqs[1]
        self.draft_cache = None if draft is None else self.seqs[0].view if self.shared else self.seqs[1].cache
        # the draft cache as the levels grown ahead write it (slots given explicitly)
        self._ahead_view = self.draft_cache.view() if self.overlap else None
        self.reused_tokens = 0  # prompt tokens whose target K/V came from the previous generation
        self.device = draft.device if draft is not None else target.device
        if draft_graphs == "auto":
            draft_graphs = "on" if self.device.type == "cuda" else "off"
        self.draft_levels = None
        if draft is not None and draft_graphs != "off":
            seq = self.draft_seq
            if (seq.levels is None or seq.levels.capture != (draft_graphs == "on")
                    or seq.levels.attention != draft.attention
                    # (another draft's levels: a substitute draft's live on the target's sequence)
                    or seq.levels.model is not draft or seq.levels.cache is not self.draft_cache):
                seq.levels = StaticLevels(draft, self.draft_cache, capture=draft_graphs == "on")
            self.draft_levels = seq.levels
        self._draft_model = draft
        self._shapes: dict[tuple[int, ...], StaticShape] = {}
        self.set_spec(spec)
        # draws on the draft's device come from a generator there, seeded from the generation's
        self.device_g = generator
        if draft is not None and self.device.type != "cpu":
            self.device_g = torch.Generator(self.device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        # draws of trees grown ahead: a generator of their own, so that how far the growing got
        # (a matter of timing) does not shift the draws in the pass it runs in (a step that then
        # starts from a tree grown ahead skips the draws a fresh tree takes: seeded sampling with
        # overlap is exact in distribution, not reproducible token for token)
        self.ahead_g = torch.Generator(self.device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator))) \
            if self.overlap else None

    def set_spec(self, spec: TreeSpec) -> None:
        """The tree of the next steps (between steps only: a step's tree is fixed before the
        target is read, which is what keeps every step exact)."""
        if spec.max_nodes > self.max_nodes:
            raise ValueError(f"a tree of {spec.max_nodes} nodes; this decoder holds at most {self.max_nodes}")
        if spec.kind != "none" and self._draft_model is None:
            raise ValueError(f"a {spec.kind} tree needs a draft")
        self.spec = spec
        self.draft = self._draft_model if spec.kind != "none" else None
        parents = self.parents = spec.shape()  # (None: the dynamic tree)
        if parents is None:
            self.shape = None
        else:
            if parents not in self._shapes:
                self._shapes[parents] = StaticShape(parents, self.device)
            self.shape = self._shapes[parents]

    def prefill(self, ids: list[int], chunk: int) -> torch.Tensor:
        """The prompt into both caches (in chunks), after the longest prefix they already hold;
        the target's logits at its last token (so at least that token always runs)."""
        logits = None
        self.chunk = chunk  # the widest forward: the draft's catching up runs in chunks of it too
        for model, seq in zip((self.target, self._draft_model), self.seqs):
            is_target = model is self.target
            start = min(common_prefix(seq.tokens, ids), len(ids) - 1 if is_target else len(ids), seq.cache.length)
            if is_target:
                self.reused_tokens = start
                logits = self._feed(model, seq, ids, start, want_logits=True)
            else:
                self._feed(model, seq, ids, start)
        return logits

    def _feed(self, model: Transformer, seq: CachedSequence, ids: list[int], start: int,
              want_logits: bool = False) -> torch.Tensor | None:
        """ids[start:] into the model's cache after its first `start` slots, in chunks of the
        widest forward; the logits at the last token when asked."""
        del seq.tokens[start:]  # the token list first: it may run short of the cache, never past it
        seq.cache.truncate(start)
        dev, logits = model.device, None
        for lo in range(start, len(ids), self.chunk):
            hi = min(lo + self.chunk, len(ids))
            last = want_logits and hi == len(ids)
            out = model.forward(torch.tensor(ids[lo:hi], device=dev), torch.arange(lo, hi, device=dev), seq.cache,
                                logits_rows=slice(hi - lo - 1, hi - lo) if last else slice(0, 0))
            seq.cache.advance(hi - lo)
            seq.tokens.extend(ids[lo:hi])
            if last:
                logits = out[-1]
        return logits

    def first_token(self, logits: torch.Tensor) -> int:
        """The token after the prompt, from the prefill pass (a one-node tree at the prompt's end)."""
        if self.params.greedy:
            return int(logits.argmax())
        return sample(logits_to_probs(logits, self.params).cpu(), self.g)

    def _catch_up_draft(self) -> None:
        """Run the draft over committed tokens it has not seen (steps decoded plainly while it
        sat out), so that its cache again holds every committed token but the root."""
        seq = self.draft_seq
        self._feed(self.draft, seq, self.seqs[0].tokens, len(seq.tokens))

    def step(self, root: int) -> StepResult:
        self._extra: dict[int, list[int]] = {}  # best-first trees: draws left out of the tree, per node
        ready, self._ready = self._ready, None  # a tree grown ahead serves this step or none
        t_start = time.perf_counter()
        proposal = self.suffix.propose(root) if self.suffix is not None else None
        arm, full = "model", proposal
        if proposal is not None and proposal.size > 1:
            arm = (self.choose(proposal) if self.choose is not None
                   else "suffix" if self.draft is None else "hybrid")
            if isinstance(arm, tuple):  # (arm, the part of the proposal to run: `SuffixGate`)
                arm, proposal = arm
        self.last_arm, self.last_proposal = arm, full  # (the whole proposal, whatever part of it runs)
        drafting = self.draft is not None and arm != "suffix"
        t_caught = t0 = time.perf_counter()  # (the draft's part starts after the lookup)
        if drafting and self.shared:  # the committed K/V are the target's: nothing to catch up
            self.draft_cache.length = self.target_cache.length
        elif drafting and len(self.draft_seq.tokens) < len(self.seqs[0].tokens):
            self._catch_up_draft()
            if self.timed and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t_caught = time.perf_counter()
        fixed: frozenset[int] = frozenset()
        if arm == "suffix":  # a suffix tree alone
            parents, draft_probs = proposal.parents, None
            tokens = torch.tensor(proposal.tokens, device=self.device)
            mask, depths = _host_mask(parents, self.device)
            fixed = frozenset(range(1, len(parents)))
        elif not drafting:
            parents, tokens, draft_probs = (-1,), torch.tensor([root], device=self.device), None
            mask = torch.ones(1, 1, dtype=torch.bool, device=self.device)
            depths = torch.zeros(1, dtype=torch.long, device=self.device)
        elif self.shape is not None:
            parents, mask, depths = self.shape.parents, self.shape.mask, self.shape.depths
            tokens, draft_probs = self._grow_static(root, ready)
        else:
            tree, draft_probs = self._grow_best_first(root)
            n = len(tree)
            parents, tokens = tuple(tree.parents), torch.tensor(tree.tokens, device=self.device)
            mask, depths = tree.mask[:n, :n], torch.tensor(tree.depths, device=self.device)
        n_model = len(parents) if drafting else 0  # the nodes the draft model ran on (the rest are grafted)
        if drafting and arm == "hybrid" and self.graft_room:
            parents, tokens, mask, depths, fixed = self._graft(parents, tokens, mask, depths, proposal)
        if self.timed and drafting and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        self.last_nodes = len(parents)  # the width of this step's target pass
        used_ahead, self._used_ahead = self._used_ahead, 0
        gate = self.ahead_gate
        ahead = self._start_ahead(tokens) if (self.overlap and drafting and arm == "model" and not fixed
                                              and self.shape is not None and (gate is None or gate.grow)) else None
        layers = self.target.layers
        if ahead is not None and self.ahead_eager:
            while self._ahead_unit():
                pass
        elif ahead is not None:
            layers.idle = self._ahead_unit
        try:
            result, host_tokens = self._verify(parents, tokens, mask, depths, draft_probs, fixed)
        finally:
            if ahead is not None and not self.ahead_eager:
                layers.idle = None
            self._ahead = self._ahead_work = None
        t2 = time.perf_counter()
        if ahead is not None and ahead.levels:
            last = result.accepted[-1] if result.accepted else 0
            match = next((k for k, job in enumerate(ahead.jobs) if job.done and self._case_came(job, last, result)),
                         None)
            self.ahead_hits += match is not None
            self.ahead_misses += match is None
            self._ready = (ahead, match) if match is not None else None
        if gate is not None:  # (the draft's levels before the pass: a static tree's, less those grown ahead)
            fresh = len(self.shape.levels) - used_ahead if drafting and arm == "model" and self.shape is not None else 0
            # (the overrun since the last reading: on CUDA a reading still on its way joins the next)
            seen, self._overrun_seen = self._overrun_seen, layers.overrun_seconds()
            grew = ahead is not None and ahead.pending is None and ahead.seconds > 0  # (its choice in, work done)
            gate.observe(grew, self._overrun_seen - seen, used_ahead, t1 - t_caught, fresh, len(parents), t2 - t1)
        path = [0] + list(result.accepted)
        kept = [host_tokens[i] for i in path]
        base = self.target_cache.length
        self.target_cache.commit([base + i for i in path])
        self.seqs[0].tokens.extend(kept)
        self.suffix_accepted += sum(1 for i in result.accepted if i in fixed)
        # the model's nodes on the path come first: a grafted node's descendants are all grafted
        on_model = next((k for k, i in enumerate(path) if i >= n_model), len(path))
        if on_model == len(path) or not drafting:
            self.last_model_verify = result
        else:  # the model's view: its children at the first grafted node's parent were all rejected
            self.last_model_verify = VerifyResult(result.accepted[:on_model - 1], host_tokens[path[on_model]],
                                                  result.accepted_ranks[:on_model - 1])
        if drafting and not self.shared:  # (a step without the draft: it catches up at its next one)
            dbase = self.draft_cache.length - n_model  # the tree's slots follow the committed ones
            self.draft_cache.truncate(dbase)
            self.draft_cache.commit([dbase + i for i in path[:on_model]])
            self.draft_seq.tokens.extend(kept[:on_model])  # (the rest: caught up at the next step)
        if self.suffix is not None:
            self.suffix.extend(kept)
        self.last_times = StepTimes(t1 - t0, t2 - t1, time.perf_counter() - t_start, t_caught - t0,
                                    ahead.seconds if ahead is not None else 0.0, used_ahead)
        return StepResult(kept[1:] + [result.bonus_token], result)

    def _graft(self, parents, tokens: torch.Tensor, mask: torch.Tensor, depths: torch.Tensor, proposal):
        """The model's tree with the suffix proposal's new paths added (`suffix.graft`): their
        mask rows and depths follow their parents'. Returns parents, tokens, mask, depths and the
        fixed (grafted) nodes."""
        host_tokens, host_depths = torch.stack([tokens, depths.to(tokens.device)]).tolist()
        new_parents, new_tokens, added = graft(list(parents), host_tokens, proposal, self.graft_room)
        if not added:
            return parents, tokens, mask, depths, frozenset()
        n, total = len(parents), len(new_parents)
        grown = torch.zeros(total, total, dtype=torch.bool, device=mask.device)
        grown[:n, :n] = mask
        for i in added:
            grown[i] = grown[new_parents[i]]
            grown[i, i] = True
            host_depths.append(host_depths[new_parents[i]] + 1)
        return (tuple(new_parents), torch.tensor(new_tokens, device=tokens.device), grown,
                torch.tensor(host_depths, device=depths.device), frozenset(added))

    # ---- target side ------------------------------------------------------------------------

    def _verify(self, parents: tuple[int, ...], tokens: torch.Tensor, tree_mask: torch.Tensor, depths: torch.Tensor,
                draft_probs: torch.Tensor | None, fixed: frozenset[int] = frozenset()) -> tuple[VerifyResult, list[int]]:
        """The target's pass over the tree and its verification; also the tree's tokens on the host.
        fixed: the nodes that are fixed proposals (suffix drafts)."""
        model, cache, dev = self.target, self.target_cache, self.target.device
        n, past = len(parents), self.target_cache.length
        tokens = tokens.to(dev)
        mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=dev), tree_mask.to(dev)], dim=1)
        logits = model.forward(tokens.clamp_min(0), depths.to(dev) + past, cache, mask=mask)
        if self.params.greedy:
            host = torch.stack([tokens, logits.argmax(-1)]).cpu()  # 2n integers: the one transfer
            host_tokens = host[0].tolist()
            return verify_greedy_argmax(parents, host_tokens, host[1].tolist()), host_tokens
        target_probs = logits_to_probs(logits, self.params)
        if draft_probs is None and not fixed:  # a one-node tree: plain sampling
            return VerifyResult((), sample(target_probs[0].cpu(), self.g), ()), tokens.cpu().tolist()
        wr = self.spec.kind != "specinfer"
        if self.verify_mode == "table":  # one transfer per step: the table, the tokens, every node's bonus
            return verify_stochastic_table(parents, tokens, target_probs,
                                           draft_probs.to(dev) if draft_probs is not None else None, self.g,
                                           without_replacement=wr, extra_draws=self._extra,
                                           bonus_generator=self.device_g if dev.type != "cpu" else None,
                                           want_tokens=True, fixed=fixed)
        host_tokens = tokens.cpu()
        result = verify_stochastic(parents, host_tokens, target_probs.cpu(),
                                   draft_probs.cpu() if draft_probs is not None else None, self.g,
                                   without_replacement=wr, extra_draws=self._extra, fixed=fixed)
        return result, host_tokens.tolist()

    # ---- draft side -------------------------------------------------------------------------

    def _draft_forward(self, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor,
                       lo: int, hi: int) -> torch.Tensor:
        """Draft logits (on the device) for tree nodes lo..hi-1 (one level), their K/V kept in the
        scratch slots. tree_mask: the level's rows of the ancestor mask, over nodes 0..hi-1."""
        model, cache, dev = self.draft, self.draft_cache, self.device
        tree_base = cache.length - lo  # slot of tree node 0
        if self.draft_levels is not None and self.draft_levels.fits(hi - lo):
            logits = self.draft_levels.run(tokens, depths + tree_base, tree_mask, tree_base)
        else:
            mask = torch.cat([torch.ones(hi - lo, tree_base, dtype=torch.bool, device=dev), tree_mask], dim=1)
            logits = model.forward(tokens.clamp_min(0), depths + tree_base, cache, mask=mask)
        cache.advance(hi - lo)
        return logits

    def _children(self, logits: torch.Tensor, k: int, with_replacement: bool = False,
                  generator: torch.Generator | None = None):
        """Every row's first k children, chosen on the device: tokens [w, k], valid [w, k] (False
        where the row's support ran out) and Q [w, V] (None at temperature 0)."""
        k_eff = min(k, logits.shape[-1])
        generator = generator or self.device_g
        if self.params.greedy:
            idx = torch.topk(logits, k_eff).indices
            valid, q, keys = torch.ones_like(idx, dtype=torch.bool), None, None
        else:
            q = logits_to_probs(logits, self.params)
            if with_replacement:  # SpecInfer's independent sequences
                idx = torch.multinomial(q, k, replacement=True, generator=generator)
                return idx, torch.ones_like(idx, dtype=torch.bool), q
            idx, keys = gumbel_top_k(q, k_eff, generator)
            valid = torch.isfinite(keys)
        if k_eff < k:  # more children wanted than the vocabulary has
            pad = k - k_eff
            idx = torch.cat([idx, idx.new_zeros(idx.shape[0], pad)], 1)
            valid = torch.cat([valid, valid.new_zeros(valid.shape[0], pad)], 1)
        return idx, valid, q

    def _grow_static(self, root: int, ready: tuple[GrownAhead, int] | None = None) -> tuple[torch.Tensor,
                                                                                           torch.Tensor | None]:
        """Grow the static tree level by level from the root (every level, the leaves included,
        runs through the draft so that any accepted node has its K/V). Returns the tokens [n] and
        Q [rows, V] for the nodes above the last level (None at temperature 0), all on the device.
        When the last pass grew this step's tree ahead (`ready`: its case came), growth goes on from
        there."""
        shape, n = self.shape, self.shape.n
        start, dev = 0, self.device
        job = None
        if ready is not None:
            ahead, k = ready
            job = ahead.jobs[k]
            if not (ahead.shape is shape and ahead.kind == self.spec.kind and job.guess == root
                    and self.draft_cache.length == ahead.base + shape.host_depths[job.anchor] + 1):
                job = None
        if job is not None:  # its first levels' K/V move to this tree's slots (the same positions)
            lo = shape.levels[job.done][0] if job.done < len(shape.levels) else n
            self.draft_cache.move(ahead.slot0 + k * n, self.draft_cache.length, lo)
            self.draft_cache.advance(lo)
            tokens, q_rows, start = job.tokens, list(job.q_rows), job.done
            guesses = job.guesses
            self._used_ahead = job.done
        else:
            tokens = torch.full((n,), -1, dtype=torch.long, device=dev)
            tokens[0] = root
            q_rows: list[torch.Tensor] = []
            guesses = torch.zeros(n, AHEAD_GUESSES, dtype=torch.long, device=dev)
        for lo, hi, children in shape.levels[start:]:
            logits = self._draft_forward(tokens[lo:hi], shape.depths[lo:hi], shape.mask[lo:hi, :hi], lo, hi)
            q = (self._choose_children(logits, children, tokens, q_rows, lo, hi, self.device_g)
                 if children is not None else None)
            if self.overlap:
                self._guess_level(logits, q, children, tokens, guesses, lo, hi)
            if children is None:
                break
        self._tree_guesses = guesses if self.overlap else None
        return tokens, (torch.cat(q_rows) if q_rows else None)

    @staticmethod
    def _case_came(job: AheadJob, last: int, result: VerifyResult) -> bool:
        """Whether the step ended as the job assumed: its path ends at the job's node and the
        bonus token is the job's guess (the next tree's root, whose token its tree was drawn below)."""
        return job.anchor == last and job.guess == result.bonus_token

    def forget_ahead(self) -> None:
        """Drop a tree grown ahead (the caller moved the caches back: its case cannot come)."""
        self._ready = None

    def _choose_children(self, logits: torch.Tensor, children, tokens: torch.Tensor, q_rows: list,
                         lo: int, hi: int, generator: torch.Generator) -> torch.Tensor | None:
        """A static level's children: drawn from its logits into tokens[clo:chi] (Q rows kept).
        Returns Q (None at temperature 0)."""
        clo, chi, rows, ranks, k = children
        idx, valid, q = self._children(logits, k, self.spec.kind == "specinfer" and lo == 0, generator)
        if q is not None:
            q_rows.append(q)
        ok = valid[rows, ranks] & (tokens[lo:hi][rows] >= 0)  # below a never-drawn node: never drawn
        tokens[clo:chi] = torch.where(ok, idx[rows, ranks], torch.full_like(rows, -1))
        return q

    def _guess_level(self, logits: torch.Tensor, q: torch.Tensor | None, children, tokens: torch.Tensor,
                     guesses: torch.Tensor, lo: int, hi: int) -> None:
        """Per node of one level, the draft's most probable tokens outside its children: the
        target's bonus token, by the draft's guesses, when the step ends at that node."""
        scores = (q if q is not None else logits).clone()
        if children is not None:
            clo, chi, rows, _ranks, _k = children
            scores[rows, tokens[clo:chi].clamp_min(0)] = -math.inf  # (a never-drawn child hides token 0)
        guesses[lo:hi] = scores.topk(min(AHEAD_GUESSES, scores.shape[-1]), dim=-1).indices

    # ---- the next trees, grown ahead during the target's pass --------------------------------

    def _start_ahead(self, tokens: torch.Tensor) -> GrownAhead | None:
        """This pass's jobs: the next trees for the AHEAD_JOBS most probable ends of this step
        (`StaticShape.end_scores`), each placed where the next step would grow it."""
        shape, cache = self.shape, self.draft_cache
        if self._tree_guesses is None or len(shape.levels) < 2:
            return None
        n, slot0 = shape.n, cache.length  # (this step's tree fills the draft cache up to its length)
        k = min(AHEAD_JOBS, n * AHEAD_GUESSES, (cache.capacity - slot0) // n)
        if k < 1:
            return None
        guesses = self._tree_guesses
        ends = shape.end_scores(self.spec.acceptance)
        values, cases = torch.where(tokens[:, None] >= 0, ends, torch.full_like(ends, -1.0)).flatten().topk(k)
        chosen = torch.stack([values.double(), (cases // AHEAD_GUESSES).double(), guesses.flatten()[cases].double()])
        self._ahead = GrownAhead(shape, self.spec.kind, slot0 - n, slot0, [], pending=_to_host(chosen))
        return self._ahead

    def _ahead_jobs(self, host: list, n: int) -> list:
        """The jobs of a (value, node, guess) choice on the host: the cases of positive value.
        (Made in the target's pass, under its inference mode: as normal tensors, which the next
        step's growth writes into.)"""
        jobs = []
        with torch.inference_mode(False):
            for value, node, guess in zip(*host):
                if value <= 0:
                    continue
                t = torch.full((n,), -1, dtype=torch.long, device=self.device)
                t[0] = int(guess)
                jobs.append(AheadJob(int(node), int(guess), t, [],
                                     torch.zeros(n, AHEAD_GUESSES, dtype=torch.long, device=self.device)))
        return jobs

    def _ahead_unit(self) -> bool:
        """One draft layer of the trees grown ahead (`LayerExecutor.idle`: a layer at a time, so
        that the work fits the pass's waits); False when nothing is left."""
        ahead = self._ahead
        if ahead is None:
            return False
        started = time.perf_counter()
        if ahead.pending is not None:
            host, ready = ahead.pending
            if not ready():  # (CUDA: the draft's last level still running; nothing queued, asked again)
                time.sleep(0)  # (the GIL to the loader thread: the executor asks again at once)
                return True
            ahead.pending, ahead.jobs = None, self._ahead_jobs(host.tolist(), ahead.shape.n)
        if self._ahead_work is None:
            self._ahead_work = self._grow_ahead(ahead)
        try:
            next(self._ahead_work)
            more = True
        except StopIteration:
            more = False
        ahead.seconds += time.perf_counter() - started
        return more

    def _grow_ahead(self, ahead: GrownAhead):
        """The trees grown ahead, level by level (each a batched draft pass over the jobs that ran
        every level before it, most probable first, as many as fit AHEAD_WIDTH nodes, at least
        one), yielding after each draft layer."""
        shape, n, dev = ahead.shape, ahead.shape.n, self.device
        while ahead.levels < len(shape.levels):
            lo, hi, children = shape.levels[ahead.levels]
            w = hi - lo
            active = [(k, job) for k, job in enumerate(ahead.jobs)
                      if job.done == ahead.levels][:max(1, AHEAD_WIDTH // w)]
            if not active:
                return
            width = ahead.slot0 + (active[-1][0] + 1) * n  # the slots the level may see
            mask = torch.zeros(len(active) * w, width, dtype=torch.bool, device=dev)
            mask[:, :ahead.base] = True
            ids, pos, slots = [], [], []
            for r, (k, job) in enumerate(active):
                rows, off = slice(r * w, (r + 1) * w), ahead.slot0 + k * n
                mask[rows, ahead.base:ahead.base + n] = shape.mask[job.anchor]  # the case's accepted path
                mask[rows, off:off + hi] = shape.mask[lo:hi, :hi]
                ids.append(job.tokens[lo:hi])
                pos.append(shape.depths[lo:hi] + ahead.base + shape.host_depths[job.anchor] + 1)
                slots.append(torch.arange(off + lo, off + hi, device=dev))
            logits = yield from self.draft.forward_steps(torch.cat(ids).clamp_min(0), torch.cat(pos),
                                                         self._ahead_view, mask=mask, slots=torch.cat(slots))
            for r, (k, job) in enumerate(active):
                part = logits[r * w:(r + 1) * w]
                q = (self._choose_children(part, children, job.tokens, job.q_rows, lo, hi, self.ahead_g)
                     if children is not None else None)
                self._guess_level(part, q, children, job.tokens, job.guesses, lo, hi)
                job.done += 1
            ahead.levels += 1

    def _grow_best_first(self, root: int) -> tuple[Tree, torch.Tensor | None]:
        """SpecExec: add the globally most probable candidates in batches, each batch one draft
        forward, until the budget is spent; about depth-1 draft forwards in all. Each node's
        draws that stay out of the tree are kept for verification (see verify_stochastic).
        Per forward, the level's candidates and their log-probabilities come to the host (the
        frontier lives there); Q [n, V] stays on the device (None at temperature 0)."""
        spec = self.spec
        tree = Tree(root, spec.max_nodes, self.device)
        frontier = BestFirstFrontier(spec.depth)
        batch = max(1, (spec.budget - 1) // max(1, spec.depth - 1))
        width = spec.acceptance.width
        scores, q_rows, draws = [0.0], [], {}
        lo, hi = 0, 1
        while True:
            toks = torch.tensor(tree.tokens[lo:hi], device=self.device)
            depths = torch.tensor(tree.depths[lo:hi], device=self.device)
            logits = self._draft_forward(toks, depths, tree.mask[lo:hi, :hi], lo, hi)
            idx, valid, q = self._children(logits, width)
            if q is None:  # temperature 0: the draft's own softmax scores the candidates
                logq = logits.float().log_softmax(-1).gather(1, idx).double()
            else:
                logq = q.gather(1, idx).double().clamp_min(1e-300).log()
                q_rows.append(q)
            ids_h, logq_h, valid_h = torch.stack([idx.double(), logq, valid.double()]).cpu().tolist()  # one transfer
            for j, node in enumerate(range(lo, hi)):
                keep = [c for c, ok in enumerate(valid_h[j]) if ok]
                cand = [int(ids_h[j][c]) for c in keep]
                draws[node] = cand
                frontier.offer(node, scores[node], tree.depths[node], cand, [logq_h[j][c] for c in keep])
            room = spec.budget - len(tree)
            if room <= 0 or not len(frontier):
                break
            lo = len(tree)
            picked = frontier.pop(min(batch, room))
            tree.add_level([c.parent for c in picked], [c.token for c in picked])
            scores += [c.score for c in picked]
            hi = len(tree)
        in_tree: dict[int, int] = {}
        for parent in tree.parents[1:]:
            in_tree[parent] = in_tree.get(parent, 0) + 1
        self._extra = {node: toks[in_tree.get(node, 0):] for node, toks in draws.items()}
        return tree, (torch.cat(q_rows) if q_rows else None)
