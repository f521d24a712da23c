"""Exact verification of a speculation tree (REFERENCES.md 1.3).

Walking down from the root: at each accepted node, its children are tried in sampling order;
child c is accepted with probability min(1, R[c] / Q[c]) where R starts as the target's
distribution P at the node and Q as the distribution the children were drawn from. After each
rejection R becomes the normalised positive part of R - Q, and (children drawn without
replacement) Q loses the rejected token and is renormalised. When every child is rejected, the
bonus token is drawn from R; at a leaf, from P. The emitted tokens then have exactly the target's
distribution. SpecInfer's rule (children drawn with replacement) keeps Q unchanged.

A *fixed* candidate (a suffix draft's continuation, `offload_engine.speculation.suffix`) is a
proposal with all its probability on its own token: it is accepted with probability R[t], and on
rejection R loses t (R <- norm(R with R[t] = 0)) while Q stays as it was (the model's draws did
not depend on it). Under a node the drawn candidates (its drawn children, then the draws left
out of a best-first tree) are tested first, in draw order, then its fixed children: each test is
then the same recursive rejection step with that candidate's own proposal (a draw's, given the
draws before it; a fixed one's, given all the draws), so the emitted token still has exactly the
distribution R it started from. (Fixed candidates before some draws would not do: which draws a
best-first tree keeps depends on their tokens, so a draw tested after a fixed candidate would no
longer be distributed as Q given what was tested before it.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample, sample_rows


@dataclass(frozen=True)
class VerifyResult:
    accepted: tuple[int, ...]  # accepted node indices along the path (root excluded), in order
    bonus_token: int  # one more token, drawn from the residual (or the target) at the last node
    accepted_ranks: tuple[int, ...]  # the 0-based sibling rank of each accepted node

    @property
    def new_tokens(self) -> int:
        return len(self.accepted) + 1


def _children(parents: list[int] | tuple[int, ...]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    return kids


def _normalise(x: torch.Tensor) -> torch.Tensor | None:
    total = x.sum()
    return x / total if total > 0 else None


def verify_stochastic(parents, tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                      generator: torch.Generator | None = None, without_replacement: bool = True,
                      extra_draws: dict[int, list[int]] | None = None,
                      fixed: frozenset[int] | set[int] = frozenset()) -> VerifyResult:
    """parents[i]: node i's parent (root = node 0, -1); tokens[i]: node i's token; target_probs and
    draft_probs [n, V]: P and Q at each node (Q is what the node's children were drawn from; rows
    are read only for nodes with candidates, so Q may stop before the last level).
    extra_draws[i]: tokens drawn at node i after its children in the tree, in draw order (a
    best-first tree keeps a prefix of each node's draws whose length depends on the tokens drawn;
    testing the rest the same way keeps the rule exact, and an accepted one is the bonus token).
    fixed: the nodes whose token is a fixed proposal (see the module docstring); draft_probs may
    be None when every candidate is one.
    Fresh uniforms are drawn from `generator` for every test."""
    kids = _children(parents)
    node, accepted, ranks = 0, [], []
    while True:
        residual = target_probs[node].double()
        step = None
        children = [c for c in kids.get(node, []) if int(tokens[c]) >= 0]  # -1: never drawn
        candidates = [(int(tokens[c]), c) for c in children if c not in fixed]
        candidates += [(t, None) for t in (extra_draws or {}).get(node, [])]
        candidates += [(int(tokens[c]), c) for c in children if c in fixed]  # after every draw
        drawn = any(child is None or child not in fixed for _, child in candidates)
        q = draft_probs[node].double().clone() if drawn else None  # (a leaf, or fixed children only: no row)
        exhausted = False  # the draft's support ran out: its later draws never happened
        for rank, (t, child) in enumerate(candidates):
            det = child is not None and child in fixed
            if exhausted and not det:
                continue
            u = torch.rand((), generator=generator, dtype=torch.float64, device=residual.device)
            # accept with probability min(1, R[t] / Q[t]); a fixed proposal has Q[t] = 1
            if (u < residual[t]) if det else (u * q[t] < residual[t]):
                if child is None:  # a drawn token outside the tree: it is the bonus
                    return VerifyResult(tuple(accepted), t, tuple(ranks))
                step = (child, rank)
                break
            if det:  # R <- norm(R without t); Q is not the fixed proposal's, so it stands
                residual = residual.clone()
                residual[t] = 0.0
                residual = _normalise(residual)  # never None: u < 1 = R[t] would have accepted
                continue
            new = _normalise((residual - q).clamp_min(0))  # R <- norm(max(R - Q, 0))
            if new is not None:  # no mass left (R == Q): R stands
                residual = new
            if without_replacement:  # the next child was drawn from Q without this token
                q[t] = 0.0
                q = _normalise(q)
                exhausted = q is None
        if step is None:
            return VerifyResult(tuple(accepted), sample(residual.float(), generator), tuple(ranks))
        node = step[0]
        accepted.append(step[0])
        ranks.append(step[1])


def verify_stochastic_table(parents, tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                            generator: torch.Generator | None = None, without_replacement: bool = True,
                            extra_draws: dict[int, list[int]] | None = None,
                            bonus_generator: torch.Generator | None = None, want_tokens: bool = False,
                            fixed: frozenset[int] | set[int] = frozenset()):
    """`verify_stochastic`'s rule, with its arithmetic done for every node at once on the device
    that holds the probabilities, so that only small tables cross to the host.

    The candidates of a node (its children in rank order, then its extra draws) and the residual
    updates between them do not depend on the random tests, only on which candidates were
    rejected before; so for every node with candidates, and every rank r, the probability
    min(1, R_r[t_r] / Q_r[t_r]) of accepting candidate r after the first r were rejected, and the
    residual after all of them are, are computed ahead, vectorized over nodes (one loop over ranks).
    The walk from the root then tests candidates with uniforms from `generator` on the host, as
    `verify_stochastic` does, and draws the bonus from the one residual (or target) row it ends at.
    Host traffic: the acceptance table [nodes, ranks] and the candidate tokens once, one row at
    the end. tokens may hold -1 for a child that was never drawn (its parent's draft ran out of
    support): it is never accepted and changes nothing, as if absent.

    bonus_generator (a generator on the probabilities' device): the bonus token each node would
    give (from its residual, or from the target at a leaf) is drawn ahead for every node, on the
    device, and comes with the table, so that a step needs one transfer in all; only the one at
    the node the walk ends at is used (each drawn from its own distribution, independently of the
    tests: the emitted tokens keep their distribution). Without it, the walk draws the bonus from
    `generator` after fetching that one row, as `verify_stochastic` does (seed for seed equal).
    want_tokens: also return the tree's tokens as a host list, from the same transfer.
    fixed: nodes whose token is a fixed proposal, as in `verify_stochastic`."""
    kids = _children(parents)
    extra = extra_draws or {}
    nodes = sorted(set(kids) | {n for n, t in extra.items() if t})
    if not nodes:
        result = VerifyResult((), sample(target_probs[0].float().cpu(), generator), ())
        return (result, torch.as_tensor(tokens).cpu().tolist()) if want_tokens else result
    dev = target_probs.device
    width = max(len(kids.get(n, [])) + len(extra.get(n, [])) for n in nodes)
    child_ix = torch.full((len(nodes), width), -1, dtype=torch.long)  # tree node of each candidate
    extra_tok = torch.full((len(nodes), width), -1, dtype=torch.long)  # token of an extra draw
    det = torch.zeros((len(nodes), width), dtype=torch.long)  # 1: a fixed proposal
    for row, n in enumerate(nodes):  # columns: drawn children, extra draws, fixed children
        ch, ex = kids.get(n, []), extra.get(n, [])
        drawn, fx = [c for c in ch if c not in fixed], [c for c in ch if c in fixed]
        child_ix[row, :len(drawn)] = torch.tensor(drawn, dtype=torch.long)
        extra_tok[row, len(drawn):len(drawn) + len(ex)] = torch.tensor(ex, dtype=torch.long)
        at = len(drawn) + len(ex)
        child_ix[row, at:at + len(fx)] = torch.tensor(fx, dtype=torch.long)
        det[row, at:at + len(fx)] = 1
    index = torch.cat([child_ix.flatten(), extra_tok.flatten(), torch.tensor(nodes, dtype=torch.long), det.flatten()])
    if dev.type == "cuda":  # one pinned, asynchronous copy (a pageable one would wait for the stream)
        index = index.pin_memory().to(dev, non_blocking=True)
    else:
        index = index.to(dev)
    size = len(nodes) * width
    child_ix, extra_tok = index[:size].view(len(nodes), width), index[size:2 * size].view(len(nodes), width)
    node_ix = index[2 * size:2 * size + len(nodes)]
    det = index[2 * size + len(nodes):].view(len(nodes), width).bool()
    tokens = torch.as_tensor(tokens).to(dev)
    cand = torch.where(child_ix >= 0, tokens[child_ix.clamp_min(0)], extra_tok)  # [N, K] token ids, -1 = none
    residual = target_probs[node_ix].double()
    if draft_probs is None:  # fixed proposals only
        q = torch.zeros_like(residual)
    else:  # nodes past Q's rows (a leaf of the draft's tree with fixed children) read no row
        rows = draft_probs.shape[0]
        q = draft_probs[node_ix.clamp(max=rows - 1)].double() * (node_ix < rows)[:, None]
    alive = torch.ones(len(nodes), dtype=torch.bool, device=dev)  # False: the draft's support ran out
    accept = torch.zeros(len(nodes), width, dtype=torch.float64, device=dev)
    tested = torch.zeros(len(nodes), width, dtype=torch.bool, device=dev)  # drawn and reached
    for r in range(width):
        t, d = cand[:, r], det[:, r]
        valid = (alive | d) & (t >= 0)
        drawn = valid & ~d
        tested[:, r] = valid
        col = t.clamp_min(0)[:, None]
        qt, rt = q.gather(1, col)[:, 0], residual.gather(1, col)[:, 0]
        # P(u * q[t] < R[t]) for u ~ U[0, 1): min(1, R/Q); when q[t] is 0, 1 if R[t] > 0 else 0;
        # a fixed proposal (Q[t] = 1): R[t]
        ratio = torch.where(qt > 0, (rt / qt.clamp_min(1e-300)).clamp(max=1.0), (rt > 0).double())
        accept[:, r] = torch.where(valid, torch.where(d, rt, ratio), torch.zeros_like(ratio))
        new = torch.where(d[:, None], residual.scatter(1, col, 0.0), (residual - q).clamp_min(0))
        total = new.sum(1, keepdim=True)
        residual = torch.where((valid[:, None] & (total > 0)), new / total.clamp_min(1e-300), residual)
        if without_replacement:
            q = q.scatter(1, col, torch.where(drawn, torch.zeros_like(qt), qt)[:, None])
            qsum = q.sum(1, keepdim=True)
            alive = alive & ~(drawn & (qsum[:, 0] <= 0))  # no draft mass left: later draws never happened
            q = torch.where(drawn[:, None] & (qsum > 0), q / qsum.clamp_min(1e-300), q)
    cand = torch.where(tested, cand, torch.full_like(cand, -1))  # candidates the walk may test
    parts = [accept.flatten(), cand.double().flatten(), child_ix.double().flatten()]
    if want_tokens:
        parts.append(tokens.double())
    if bonus_generator is not None:  # every node's bonus, drawn ahead: residual rows, then the target's
        parts.append(sample_rows(residual, bonus_generator).double())
        parts.append(sample_rows(target_probs, bonus_generator).double())
    host = torch.cat(parts).cpu()  # the one transfer
    accept_h = host[:size].view(len(nodes), width).tolist()
    cand_h = host[size:2 * size].long().view(len(nodes), width).tolist()
    child_h = host[2 * size:3 * size].long().view(len(nodes), width).tolist()
    at = 3 * size
    host_tokens = None
    if want_tokens:
        host_tokens = host[at:at + tokens.shape[0]].long().tolist()
        at += tokens.shape[0]
    if bonus_generator is not None:
        bonus_residual = host[at:at + len(nodes)].long().tolist()
        bonus_target = host[at + len(nodes):].long().tolist()

    def done(result: VerifyResult):
        return (result, host_tokens) if want_tokens else result

    row_of = {n: i for i, n in enumerate(nodes)}
    node, accepted, ranks = 0, [], []
    while True:
        row = row_of.get(node)
        if row is None:  # a leaf: the bonus comes from the target
            bonus = bonus_target[node] if bonus_generator is not None else sample(target_probs[node].float().cpu(), generator)
            return done(VerifyResult(tuple(accepted), bonus, tuple(ranks)))
        step = None
        for rank in range(width):
            if cand_h[row][rank] < 0:
                continue
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < accept_h[row][rank]:
                if child_h[row][rank] < 0:  # an extra draw outside the tree: it is the bonus
                    return done(VerifyResult(tuple(accepted), cand_h[row][rank], tuple(ranks)))
                step = (child_h[row][rank], rank)
                break
        if step is None:
            bonus = bonus_residual[row] if bonus_generator is not None else sample(residual[row].float().cpu(), generator)
            return done(VerifyResult(tuple(accepted), bonus, tuple(ranks)))
        node = step[0]
        accepted.append(step[0])
        ranks.append(step[1])


def verify_greedy(parents, tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept a child iff its token is the target's argmax at the parent; the bonus is the argmax
    at the last accepted node."""
    return verify_greedy_argmax(parents, tokens, target_logits.argmax(-1))


def verify_greedy_argmax(parents, tokens, best) -> VerifyResult:
    """verify_greedy given each node's argmax token (`best` [n]: host tensor or list)."""
    kids = _children(parents)
    tokens, best = [int(t) for t in tokens], [int(b) for b in best]
    node, accepted, ranks = 0, [], []
    while True:
        best_here = best[node]
        match = [(r, c) for r, c in enumerate(kids.get(node, [])) if tokens[c] == best_here]
        if not match:
            return VerifyResult(tuple(accepted), best_here, tuple(ranks))
        rank, node = match[0]
        accepted.append(node)
        ranks.append(rank)
