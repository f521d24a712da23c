"""The hardware-aware optimizer: brute force over the grid, and the regimes it must tell apart."""

import random

import pytest

from sequoia_trees.acceptance import AcceptanceVector
from sequoia_trees.dp import optimal_tree, tree_value
from sequoia_trees.optimizer import Timings, choose, interpolate

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def _vector(rng: random.Random, width: int) -> AcceptanceVector:
    raw = sorted((rng.random() ** 2 for _ in range(width)), reverse=True)
    total = rng.uniform(0.5, 0.98)
    return AcceptanceVector(tuple(p * total / sum(raw) for p in raw))


def _brute_force(v: AcceptanceVector, tm: Timings, budgets, max_depth):
    """Every (n, d) on the grid: its optimal tree from a fresh DP, costed by hand."""
    best = (tm.target_seconds[0], 1, 1)  # plain decoding: (s/token, n, d)
    for n in budgets:
        for d in range(2, max_depth + 1):
            try:
                tree = optimal_tree(v, n, d)
            except ValueError:
                continue
            levels = {}
            for depth in tree.depths:
                levels[depth] = levels.get(depth, 0) + 1
            step = max(tm.target(n), tm.target(n) + sum(tm.draft(w) for w in levels.values()) + tm.step_seconds)
            value = tree_value(tree, v)
            assert value == pytest.approx(tree.expected_tokens)
            if step / value < best[0] * (1 - 1e-12):
                best = (step / value, n, d)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_choice_is_the_brute_force_best_over_the_grid(seed):
    rng = random.Random(seed)
    v = _vector(rng, rng.choice([4, 8, 16]))
    ns = (1, 8, 16, 32, 64)
    base = rng.uniform(0.05, 1.0)
    slope = base * rng.choice([0.0005, 0.005, 0.05])
    draft1 = base * rng.uniform(0.005, 0.2)
    tm = Timings(ns, tuple(base + slope * n for n in ns), WIDTHS,
                 tuple(draft1 * (1 + 0.02 * w) for w in WIDTHS), step_seconds=base * rng.uniform(-0.05, 0.05))
    budgets = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    c = choose(v, tm, budgets=budgets, max_depth=8)
    s_per_token, n, d = _brute_force(v, tm, [b for b in budgets if b <= 64], 8)
    assert c.seconds_per_token == pytest.approx(s_per_token, rel=1e-9)
    assert (c.budget, c.depth) == (n, d)


def test_flat_pass_time_gives_large_trees_and_steep_gives_small():
    v = AcceptanceVector((0.6, 0.15, 0.08, 0.04, 0.02, 0.01, 0.005, 0.005))
    ns = (1, 16, 32, 64, 128, 256, 512, 1024)
    draft = tuple(0.0005 for _ in WIDTHS)  # a cheap resident draft
    # offloaded: a pass costs the weight transfer whatever its width
    flat = choose(v, Timings(ns, tuple(5.0 + 1e-4 * n for n in ns), WIDTHS, draft))
    # on-chip: the pass time grows with the width from the start
    steep = choose(v, Timings(ns, tuple(0.02 * (1 + n / 8) for n in ns), WIDTHS, draft))
    assert flat.budget >= 512, flat.describe()
    assert steep.budget <= 32, steep.describe()
    assert flat.tokens_per_step > steep.tokens_per_step > 1


def test_a_useless_draft_or_a_slow_one_is_not_used():
    ns = (1, 16, 64)
    tm = Timings(ns, (1.0, 1.0, 1.0), WIDTHS, tuple(0.01 for _ in WIDTHS))
    assert choose(AcceptanceVector((0.0, 0.0)), tm).budget == 1
    slow = Timings(ns, (1.0, 1.0, 1.0), WIDTHS, tuple(10.0 for _ in WIDTHS))
    assert choose(AcceptanceVector((0.5, 0.2)), slow).budget == 1


def test_interpolation_and_timings_validation():
    xs, ys = (1, 16, 64), (1.0, 2.5, 4.0)
    assert interpolate(xs, ys, 1) == 1.0 and interpolate(xs, ys, 64) == 4.0
    assert interpolate(xs, ys, 40) == pytest.approx(3.25)
    assert interpolate(xs, ys, 0.5) == 1.0
    with pytest.raises(ValueError, match="beyond"):
        interpolate(xs, ys, 65)
    with pytest.raises(ValueError, match="strictly increasing"):
        Timings((16, 1), (1.0, 1.0), (1,), (0.1,))
    with pytest.raises(ValueError, match=">= 0"):
        Timings((1,), (-1.0,), (1,), (0.1,))
    with pytest.raises(ValueError, match="finite"):
        Timings((1,), (1.0,), (1,), (0.1,), step_seconds=float("nan"))
    tm = Timings((1, 64), (1.0, 2.0), (1, 8), (0.1, 0.2))
    assert tm.draft(16) == pytest.approx(0.4)  # wider than measured: two slices of the widest


def test_the_step_model_fitted_to_real_steps_recovers_known_parts():
    """profiler.fit_step_model on steps made from a known model (a = 0.03 s, b = 0.4 ms/node,
    f = 0.6, plain +0.01 s) with 2% noise: the parts come back, and the leave-one-shape-out error
    is about the noise."""
    import random as rnd

    from offload_engine.planning import profiler
    from sequoia_trees.dp import TreeTable
    from sequoia_trees.optimizer import level_widths
    ns = (1, 16, 32, 64, 128, 256)
    base = Timings(ns, tuple(0.2 + 0.002 * n for n in ns), (1, 16, 64, 256), (0.02, 0.03, 0.06, 0.2))
    rng = rnd.Random(0)
    shapes = [(64, 8), (4, 3), (16, 4), (128, 10), (32, 6), (256, 12), (1, 1)]
    times = []
    for n, d in shapes:
        if n == 1:
            whole = base.target(1) + 0.01
            times.append((whole, 0.0, whole))
            continue
        widths = level_widths(TreeTable(profiler.PROFILE_VECTOR, n, d).tree(n, d))
        draft = 0.6 * sum(base.draft(w) for w in widths) * (1 + rng.uniform(-0.02, 0.02))
        target = (base.target(n) + 0.025 + 0.0004 * n) * (1 + rng.uniform(-0.02, 0.02))
        times.append((draft + target + 0.005, draft, target))
    a, b, f, plain, cv = profiler.fit_step_model(shapes, times, base)
    assert a == pytest.approx(0.03, abs=0.01) and b == pytest.approx(4e-4, abs=1e-4)
    assert f == pytest.approx(0.6, abs=0.03) and plain == pytest.approx(0.01, abs=1e-9)
    assert cv < 0.02


def test_the_step_model_is_fitted_to_the_trees_that_were_timed():
    """Steps timed on trees shaped by another vector (the pair's) are fitted with that vector's
    level widths: the known draft factor comes back; read with the generic vector's widths, the
    same steps give a wrong factor."""
    from offload_engine.planning import profiler
    ns = (1, 16, 32, 64, 128, 256)
    # a level's cost far from proportional to its width (as on the 2-vCPU machine)
    base = Timings(ns, tuple(0.2 + 0.002 * n for n in ns), (1, 2, 16, 64, 256), (0.03, 0.06, 0.08, 0.2, 0.5))
    pair = AcceptanceVector((0.8, 0.1, 0.04))
    shapes = [(64, 8), (4, 3), (16, 4), (128, 10), (1, 1)]
    times = []
    for n, d in shapes:
        if n == 1:
            times.append((base.target(1), 0.0, base.target(1)))
            continue
        draft = 0.8 * sum(base.draft(w) for w in profiler.step_widths(pair, n, d))
        target = base.target(n) + 0.02
        times.append((draft + target, draft, target))
    a, b, f, _, cv = profiler.fit_step_model(shapes, times, base, pair)
    assert f == pytest.approx(0.8, abs=1e-6) and a == pytest.approx(0.02, abs=1e-6) and cv < 1e-6
    _, _, wrong, _, wrong_cv = profiler.fit_step_model(shapes, times, base)  # the generic vector's widths
    assert abs(wrong - 0.8) > 0.05 and wrong_cv > 0.01


def test_overlapped_draft_work_fills_the_pass_waits_and_no_more():
    """Timings.step with overlap: step = max(pass, pass - idle + overlapped) + (draft work -
    overlapped) + a + b*n, overlapped = overlap_use * min(draft work, idle); the figures below
    are worked by hand. A tree that did not pay pays once its draft hides in the waits."""
    ns = (1, 16, 64)
    base = dict(target_tokens=ns, target_seconds=(1.0, 1.0, 1.2), draft_widths=(1, 16), draft_seconds=(0.1, 0.1),
                step_seconds=0.01, node_seconds=0.001)
    widths = (1, 4, 8, 3)  # 4 levels of 0.1 s: 0.4 s of draft work, 16 nodes
    plain = Timings(**base)
    assert plain.step(16, widths)[0] == pytest.approx(1.0 + 0.4 + 0.01 + 0.016)
    half = Timings(**base, idle_seconds=(0.6, 0.6, 0.3), overlap_use=0.5)
    assert half.overlapped(16, 0.4) == pytest.approx(0.2)  # half of the 0.4 s that fits in 0.6 s
    assert half.step(16, widths)[0] == pytest.approx(1.0 + 0.2 + 0.01 + 0.016)
    full = Timings(**base, idle_seconds=(0.6, 0.6, 0.3), overlap_use=1.0)
    assert full.step(16, widths)[0] == pytest.approx(1.0 + 0.01 + 0.016)  # hidden whole: the pass alone
    # at 64 tokens only 0.3 s waits: 0.3 s overlapped, the rest paid, the pass not lengthened
    assert full.step(64, widths)[0] == pytest.approx(1.2 + 0.1 + 0.01 + 0.064)
    assert full.idle(40) == pytest.approx(0.45)  # interpolated like the pass
    # a tree that loses to plain decoding without overlap wins with it
    vec = AcceptanceVector((0.3, 0.1))
    slow_draft = dict(base, draft_seconds=(0.3, 0.3))
    assert choose(vec, Timings(**slow_draft)).budget == 1
    hidden = choose(vec, Timings(**slow_draft, idle_seconds=(0.9, 0.9, 1.1), overlap_use=1.0))
    assert hidden.budget > 1 and hidden.overlap_seconds > 0
    assert "of it during the pass" in hidden.describe()
    for bad in (dict(idle_seconds=(0.1,)), dict(idle_seconds=(0.1, 2.0, 0.1)), dict(overlap_use=1.5),
                dict(idle_seconds=(0.1, -0.1, 0.1))):
        with pytest.raises(ValueError):
            Timings(**base, **bad)


def test_scaled_timings_move_each_part_and_keep_the_plain_step_when_told():
    """Timings.scaled(target, draft, plain): the step's target side (passes, waits, per-step and
    per-node terms) times `target`, the levels times `draft` (worked by hand below); the plain
    step moves with the target side, or costs `plain` when given (the step check keeps plain
    decoding's prediction; the online planner gives it the plain steps' own ratio)."""
    t = Timings(target_tokens=(1, 16), target_seconds=(0.1, 0.3), draft_widths=(1, 16), draft_seconds=(0.02, 0.05),
                step_seconds=0.01, node_seconds=0.001, draft_factor=1.2, plain_seconds=0.02,
                idle_seconds=(0.05, 0.1), overlap_use=0.5)
    s = t.scaled(2.0, 3.0)
    assert s.target(16) == pytest.approx(0.6) and s.idle(16) == pytest.approx(0.2) and s.draft(16) == pytest.approx(0.15)
    assert (s.step_seconds, s.node_seconds, s.draft_factor) == (pytest.approx(0.02), pytest.approx(0.002), 1.2)
    assert s.plain() == pytest.approx(2 * (0.1 + 0.02))
    # a 16-node step of levels 1 and 16 wide: pass 0.6, draft work 1.2 * 3 * (0.02 + 0.05) = 0.252,
    # of it 0.5 * 0.2 overlapped
    assert s.step(16, (1, 16))[0] == pytest.approx(0.6 + (0.252 - 0.1) + 0.02 + 16 * 0.002)
    kept = t.scaled(2.0, 3.0, plain=t.plain())
    assert kept.plain() == pytest.approx(t.plain()) and kept.target(16) == pytest.approx(0.6)
    assert t.scaled(1.0, 1.0) == t


def test_the_overlap_use_fitted_to_paired_steps():
    """profiler.fit_overlap_use: over the second step of each pair, the draft time its levels
    grown ahead saved over min(the tree's draft work, the pass's waits): here two of three pairs'
    second steps came with their first two levels grown ahead."""
    from offload_engine.planning import profiler
    from sequoia_trees.dp import TreeTable
    from sequoia_trees.optimizer import level_widths
    ns = (1, 16, 64)
    base = Timings(ns, (1.0, 1.0, 1.2), (1, 4, 16), (0.02, 0.04, 0.1), idle_seconds=(0.5, 0.5, 0.4))
    widths = level_widths(TreeTable(profiler.PROFILE_VECTOR, 16, 4).tree(16, 4))
    work = sum(base.draft(w) for w in widths)
    saved = base.draft(widths[0]) + base.draft(widths[1])
    use = profiler.fit_overlap_use([(16, 4), (1, 1)], [[0, 2, 0, 2, 0, 0], [0, 0, 0]], base)
    assert use == pytest.approx(2 * saved / (3 * min(work, 0.5)))
    assert profiler.fit_overlap_use([(16, 4)], [[0, 0, 0, 0]], base) == 0.0
    assert profiler.fit_overlap_use([(16, 4)], [[0, 2]], Timings(ns, (1.0, 1.0, 1.2), (1,), (0.02,))) == 0.0


def test_the_step_models_terms_are_chosen_by_cross_validation(monkeypatch):
    """One slow isolated pass (64 tokens, timed once in a slow spell) among otherwise true ones:
    a per-node slope fitted through it mispredicts the other shapes; cross-validation keeps the
    constant alone (their median), which predicts the (16, 4) step within 2%. Where the slope is
    real it is kept (test_the_step_model_fitted_to_real_steps_recovers_known_parts)."""
    from offload_engine.planning import profiler
    ns = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    true = Timings(ns, tuple(0.2 + 0.001 * n for n in ns), (1, 16, 64, 256), (0.02, 0.03, 0.06, 0.2))
    slow = Timings(ns, tuple(t * (1.6 if n == 64 else 1.0) for n, t in zip(ns, true.target_seconds)),
                   true.draft_widths, true.draft_seconds)
    shapes = [(64, 8), (4, 3), (16, 4), (128, 10), (1, 1)]
    times = []
    for n, d in shapes:
        draft = sum(true.draft(w) for w in profiler.step_widths(profiler.PROFILE_VECTOR, n, d))
        target = true.target(n) + (0.03 if n > 1 else 0.0)
        times.append((draft + target, draft if n > 1 else 0.0, target))

    def predicted_16_4(a, b, f):
        return slow.target(16) + f * sum(slow.draft(w) for w in profiler.step_widths(profiler.PROFILE_VECTOR, 16, 4)) \
            + a + b * 16
    measured = times[2][0]
    a, b, f, _, cv = profiler.fit_step_model(shapes, times, slow)
    assert b == 0.0 and a == pytest.approx(0.03, abs=1e-9)  # the constant, not "none"
    assert abs(predicted_16_4(a, b, f) / measured - 1) < 0.02
    monkeypatch.setattr(profiler, "STEP_TERMS", ("constant and per node",))  # the slope forced
    a2, b2, f2, _, cv2 = profiler.fit_step_model(shapes, times, slow)
    assert b2 < 0 and abs(predicted_16_4(a2, b2, f2) / measured - 1) > 0.05 and cv2 > cv


# ---- the generation's length (a short answer throws away its last step's tokens past the end) ----

def _steps_by_simulation(pmf, length: int, runs: int, seed: int):
    """Mean and standard error of the steps whose tokens (drawn from pmf) reach `length`."""
    import numpy as np
    rng = np.random.default_rng(seed)
    draws = rng.choice(len(pmf), size=(runs, length), p=pmf / pmf.sum())
    steps = (np.cumsum(draws, axis=1) < length).sum(axis=1) + 1
    return steps.mean(), steps.std() / runs ** 0.5


def test_the_steps_of_a_generation_are_the_renewal_function_of_the_trees_tokens():
    import numpy as np
    from sequoia_trees.optimizer import EXACT_LENGTH, expected_steps, step_tokens_distribution
    # exact cases: X always 3 takes ceil(L / 3) steps; plain decoding (X = 1) L steps, wasting nothing
    three, one = np.array([0, 0, 0, 1.0]), np.array([0, 1.0])
    for length in (1, 2, 3, 4, 7, 9, 10, EXACT_LENGTH + 50):
        assert expected_steps(three, length)[0] == pytest.approx(-(-length // 3), abs=0.34 if length > EXACT_LENGTH else 1e-9)
        assert expected_steps(one, length)[0] == pytest.approx(length)
    vector = AcceptanceVector((0.6, 0.15, 0.05, 0.03))
    tree = optimal_tree(vector, 64, 12)
    pmf = step_tokens_distribution(tree, vector)
    # its mean is the tree's value (Sequoia's F(T)): the two are computed independently
    assert (pmf * np.arange(len(pmf))).sum() == pytest.approx(tree.expected_tokens, rel=1e-9)
    assert pmf[0] == 0 and pmf.sum() == pytest.approx(1.0)
    # against simulated generations, within 4 standard errors (20,000 runs: about 0.01-0.1 steps),
    # both sides of EXACT_LENGTH (past it the function is continued at slope 1 / E[X])
    for length, seed in ((5, 1), (20, 2), (127, 3), (EXACT_LENGTH + 300, 4)):
        mean, se = _steps_by_simulation(pmf, length, 20000, seed)
        assert expected_steps(pmf, length)[0] == pytest.approx(mean, abs=4 * se), length
    # a long generation's steps: L / E[X] plus the last step's waste, (E[X^2] - E[X]) / (2 E[X]^2)
    k = np.arange(len(pmf))
    ex, ex2 = (pmf * k).sum(), (pmf * k * k).sum()
    assert expected_steps(pmf, 2000)[0] == pytest.approx(2000 / ex + (ex2 - ex) / (2 * ex * ex), rel=1e-4)


def test_a_short_generation_chooses_a_shallower_tree_and_a_long_one_the_unbounded_choice():
    from sequoia_trees.optimizer import Candidates
    vector = AcceptanceVector((0.8, 0.1, 0.05))
    ns = (1, 16, 32, 64, 128)
    timings = Timings(ns, tuple(1.0 + n / 512 for n in ns), (1, 16, 64), (0.01, 0.015, 0.03))
    cands = Candidates(vector, [2, 4, 8, 16, 32, 64, 96, 128], 12)
    long, short = cands.best(timings), cands.best(timings, length=4)
    assert short.depth < long.depth and short.length == 4 and long.length is None
    assert type(short.tokens_per_step) is float  # (not numpy's: stats are printed as JSON)
    # the short one's tokens per step: 4 / E[N(4)], under the tree's own value
    assert short.tokens_per_step < short.tree_tokens and "where no step is cut short" in short.describe()
    # each (budget, depth)'s value for 4 tokens is its own, and the short choice is their best
    rates = {(n, d): cands.choice(n, d, timings, 4).tokens_per_second for n, d, *_ in cands.items}
    assert rates[(short.budget, short.depth)] == pytest.approx(max(rates.values()))
    very_long = cands.best(timings, length=100_000)
    assert (very_long.budget, very_long.depth) == (long.budget, long.depth)
    assert very_long.tokens_per_step == pytest.approx(long.tokens_per_step, rel=1e-3)
    # what one step hands out with `left` tokens to go: E[min(X, left)], against simulation
    import numpy as np
    from sequoia_trees.optimizer import step_tokens_distribution
    pmf = step_tokens_distribution(cands._trees[(long.budget, long.depth)], vector)
    draws = np.random.default_rng(5).choice(len(pmf), size=20000, p=pmf)
    for left in (1, 3, 6):
        sim = np.minimum(draws, left)
        assert cands.emitted(long.budget, long.depth, left) == pytest.approx(sim.mean(), abs=4 * sim.std() / 20000 ** 0.5)
    assert cands.emitted(1, 1, 5) == 1.0


def test_merged_candidates_keep_each_trees_own_distribution():
    """Online re-planning refills the small budgets under a new vector and keeps the large ones
    from the last fill (`Candidates.merged`): a kept tree's step-token distribution stays the one
    of the vector it was filled with, so its tokens per step for a very long answer is its value G
    (and not G's of one vector beside the distribution of another)."""
    from sequoia_trees.optimizer import Candidates
    old, new = AcceptanceVector((0.8, 0.1, 0.05)), AcceptanceVector((0.3, 0.1, 0.05))
    kept = Candidates(old, [2, 4, 8, 16, 32, 64], 8)
    kept.tokens_for(10)  # (its distributions made before the merge, as a planner's would be)
    merged = Candidates(new, [2, 4, 8, 16], 8).merged(kept, above=16)
    values, long = merged.tokens_for(None), merged.tokens_for(10**7)
    assert any(n > 16 for n, *_ in merged.items)
    for (n, d, *_), g, t in zip(merged.items, values, long):
        assert t == pytest.approx(g, rel=1e-4), (n, d)


def test_the_distribution_of_a_generations_steps_matches_simulated_generations():
    """`steps_distribution` (P(N(L) = j)) against 20,000 simulated generations of a real tree's
    step tokens: every probability within 5 standard errors of the simulated frequency (a
    binomial's, at most 0.0035 here), exact cases exactly, and its mean the renewal function."""
    import numpy as np
    from sequoia_trees.optimizer import expected_steps, step_tokens_distribution, steps_distribution
    assert steps_distribution(np.array([0, 0, 0, 1.0]), 7).tolist() == [0, 0, 0, 1.0, 0, 0, 0, 0]
    assert steps_distribution(np.array([0, 1.0]), 5)[5] == 1.0
    vector = AcceptanceVector((0.6, 0.15, 0.05, 0.03))
    pmf = step_tokens_distribution(optimal_tree(vector, 64, 12), vector)
    rng = np.random.default_rng(7)
    for length in (3, 24, 67):
        dist = steps_distribution(pmf, length)
        assert dist.sum() == pytest.approx(1.0) and (dist * np.arange(len(dist))).sum() == pytest.approx(
            expected_steps(pmf, length)[0], rel=1e-9)
        steps = np.zeros(20000, dtype=int)
        left = np.full(20000, length)
        while (left > 0).any():
            live = left > 0
            left[live] -= rng.choice(len(pmf), size=live.sum(), p=pmf)
            steps[live] += 1
        freq = np.bincount(steps, minlength=len(dist))[:len(dist)] / 20000
        se = np.sqrt(dist * (1 - dist) / 20000) + 1e-4
        assert np.all(np.abs(freq - dist) <= 5 * se), (length, freq, dist)


def test_a_negative_constant_never_takes_a_step_under_the_pass_compute_and_the_draft_work():
    """The fitted per-step constant may be negative (the next pass's reads done while the draft
    computes), but that hides at most the pass's waits: a small tree's step costs at least its
    pass less the waits plus the draft's work; a deep tree's, whose draft hides the waits, is as
    the constant says; without known waits the constant is taken as it is."""
    import dataclasses
    t = Timings((1, 4, 64), (0.10, 0.14, 0.30), (1, 4, 16), (0.02, 0.022, 0.03), step_seconds=-0.118,
                idle_seconds=(0.04, 0.05, 0.15))
    small, _, draft = t.step(4, (1, 1, 2))
    assert small == pytest.approx(0.14 - 0.05 + draft)  # (the constant would give 0.14 + draft - 0.118)
    assert 0.14 + draft - 0.118 < small
    deep, _, draft = t.step(64, (1, 4, 8, 16, 16, 16, 3))
    assert deep == pytest.approx(0.30 + draft - 0.118)  # (above the floor: the fitted model)
    blind = dataclasses.replace(t, idle_seconds=())
    assert blind.step(4, (1, 1, 2))[0] == pytest.approx(0.14 + draft_sum(blind, (1, 1, 2)) - 0.118)


def draft_sum(t, widths):
    return sum(t.draft(w) for w in widths)
