"""The acceptance hazards from verified paths (`RankEvidence`, `path_evidence`) and the on-policy
measurement's deep measuring tree (`measure.measuring_tree`): hand-worked paths, the exact
equality with the one-level tree's frequencies, and a statistical test of the deep tree's
estimate against the one-level tree's under Sequoia's model."""

import json

import numpy as np
import pytest

from sequoia_trees.acceptance import AcceptanceVector, RankEvidence, path_evidence
from offload_engine.speculation.measure import measuring_tree


def test_path_evidence_by_hand():
    # root 0: children 1, 2, 3 (ranks 0, 1, 2); node 2: children 4, 5; node 4: child 6
    parents = (-1, 0, 0, 0, 2, 2, 4)
    # accepted node 2 (rank 1 at the root), then node 5 (rank 1 below 2): a leaf, nothing more
    assert path_evidence(parents, [2, 5], [1, 1]) == [(3, 1), (2, 1)]
    # accepted 2 then 4 (rank 0), then 6 was rejected: node 4 had 1 child, all rejected
    assert path_evidence(parents, [2, 4], [1, 0]) == [(3, 1), (2, 0), (1, None)]
    # everything rejected at the root
    assert path_evidence(parents, [], []) == [(3, None)]
    # node 1 accepted: a leaf
    assert path_evidence(parents, [1], [0]) == [(3, 0)]


def test_rank_evidence_counts_and_vector_by_hand():
    e = RankEvidence(3)
    e.observe(3, 1)       # ranks 0, 1 tried; 1 accepted
    e.observe(2, None)    # ranks 0, 1 tried, both rejected
    e.observe(5, 0)       # rank 0 tried and accepted
    e.observe(3, 4)       # (a rank past the width: ranks 0..2 tried, none counted accepted)
    assert e.at_risk == [4, 3, 1] and e.accepted == [1, 1, 0]
    h0, h1 = 1 / 4, 1 / 3
    assert e.vector().probs == pytest.approx((h0, (1 - h0) * h1, 0.0))
    f = RankEvidence(3)
    f.add_counts(**{k: v for k, v in e.as_dict().items()})
    f.add_counts([2, 0, 0], [2, 0, 0])
    assert f.at_risk == [6, 3, 1] and f.accepted == [3, 1, 0]


def test_a_one_level_tree_gives_exactly_each_ranks_frequency():
    """From a one-level tree of k children the hazards make exactly count(rank r) / steps: what
    the measurement stored before the deep tree (and still does with --depth 2)."""
    rng = np.random.default_rng(3)
    k = 6
    parents = measuring_tree(k, depth=2)
    assert parents == (-1,) + (0,) * k
    outcomes = rng.choice(k + 1, size=500, p=[0.3, 0.2, 0.1, 0.1, 0.05, 0.05, 0.2])  # k: all rejected
    e = RankEvidence(k)
    for o in outcomes:
        accepted, ranks = ([], []) if o == k else ([1 + int(o)], [int(o)])
        e.observe_step(parents, accepted, ranks)
    freq = [float(np.mean(outcomes == r)) for r in range(k)]
    assert e.vector().probs == pytest.approx(freq, abs=1e-12)


def test_measuring_tree_shape():
    parents = measuring_tree(5, depth=4, spine=2)
    # root's 5 children (1..5); node 1's 2 children (6, 7); node 6's 2 children (8, 9)
    assert parents == (-1, 0, 0, 0, 0, 0, 1, 1, 6, 6)
    with pytest.raises(ValueError):
        measuring_tree(4, depth=1)


def _simulate_step(parents, probs, rng):
    """One step under Sequoia's model: at a node with k children the child of rank r is accepted
    with probability probs[r] (r < k), none with the rest; then on from the accepted child."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], 1):
        children.setdefault(p, []).append(i)
    node, accepted, ranks = 0, [], []
    while node in children:
        kids = children[node]
        p = list(probs[:len(kids)])
        r = rng.choice(len(kids) + 1, p=p + [1.0 - sum(p)])
        if r == len(kids):
            break
        node = kids[r]
        accepted.append(node)
        ranks.append(int(r))
    return accepted, ranks


@pytest.mark.parametrize("truth", [(0.97, 0.02, 0.005, 0.0025, 0.001, 0.0005),
                                   (0.5, 0.2, 0.1, 0.05, 0.03, 0.02)])
def test_the_deep_measuring_tree_estimates_the_vector_and_pins_the_first_rank_better(truth):
    """Under Sequoia's model (each node's accepted rank drawn from the vector, independently),
    the deep measuring tree's estimate is unbiased and, for the same number of steps, its first
    rank's is far tighter than the one-level tree's when the draft is good.

    Thresholds: over R = 150 repetitions of 48 steps (the old quick measurement's steps), the mean
    estimate of every p_r lies within 4 standard errors of the truth (a false alarm about 1 in
    16000 per rank) plus 0.002: a rank that 48 steps try less than once on average is estimated 0
    most of the time, a small-sample bias of the hazards (the deep tree's ranks past its spine's 4
    are tried at the root alone: p_5 = 0.001 of the strong draft came out 0.0002), and for the strong draft (p_1 = 0.97: about 6 observations of rank 1 per
    step on 8 levels) the spread of p_1's estimate is under half the one-level tree's (expected
    about 0.4 of it: sqrt(1/6)); for the weak one (p_1 = 0.5: 1.5 observations a step) at most
    as wide. Seeded, so the test is repeatable."""
    rng = np.random.default_rng(11)
    width, steps, reps = len(truth), 48, 150
    trees = {"one-level": measuring_tree(width, depth=2), "deep": measuring_tree(width, depth=8, spine=4)}
    estimates = {name: [] for name in trees}
    for _ in range(reps):
        for name, parents in trees.items():
            e = RankEvidence(width)
            for _ in range(steps):
                e.observe_step(parents, *_simulate_step(parents, truth, rng))
            estimates[name].append(e.vector().probs)
    for name, rows in estimates.items():
        rows = np.array(rows)
        mean, se = rows.mean(axis=0), rows.std(axis=0, ddof=1) / np.sqrt(reps) + 1e-12
        assert np.all(np.abs(mean - truth) <= 4 * se + 0.002), (name, mean, truth)
    spread = {name: np.std(np.array(rows)[:, 0]) for name, rows in estimates.items()}
    if truth[0] > 0.9:
        assert spread["deep"] < 0.5 * spread["one-level"], spread
    else:
        assert spread["deep"] <= spread["one-level"], spread


def test_cached_vectors_of_an_older_measurement_are_measured_again(tmp_path, monkeypatch):
    """A vector the quick measurement cached before the deep measuring tree (no "measurement"
    field) is not used: the pair is measured again; one of this version is used."""
    import offload_engine.speculation.acceptance_store as store
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(store, "STORE_DIR", tmp_path / "repo")  # (no repo vectors for this pair)
    cache = store.acceptance_cache_dir()
    cache.mkdir(parents=True)
    record = {"acceptance": [0.9375, 0.0625], "temperature": 0.0, "target_fingerprint": "fp", "draft_key": "d"}
    (cache / "fp__d__t0.json").write_text(json.dumps(record))
    assert store.known_vectors("fp", "d") == {}
    (cache / "fp__d__t0.json").write_text(json.dumps({**record, "measurement": store.MEASUREMENT}))
    found = store.known_vectors("fp", "d")
    assert list(found) == [0.0] and found[0.0][0] == AcceptanceVector((0.9375, 0.0625))


def test_the_quick_measurement_keeps_deep_trees_for_a_good_draft_and_stops_at_its_trials(tmp_path):
    """On a tiny pair: a draft identical to the target (every first child accepted at T=0) goes
    from SHALLOW_DEPTH levels on the first prompt to 8 and stops after the prompt at which rank 1
    reached its trials; a draft the target does not follow stays at SHALLOW_DEPTH levels, and
    stops once the first rank was rejected the number of times asked."""
    from sequoia_trees.sampling import SamplingParams
    from offload_engine import Engine
    from offload_engine.speculation import measure
    from tiny_models import make_tiny_pair
    target, other = make_tiny_pair(tmp_path)
    prompts = [{"prompt": p} for p in ("The capital of France is", "Numbers: 1 2 3", "Hello there", "Once upon")]
    with Engine.load(target, draft=target, tree="sequoia", progress=False) as same:
        got = measure.on_policy(same, prompts, 4, SamplingParams(0.0, 1.0), 12, 0, depth=None, trials=20)
    # 3 levels first: 12 tokens in 4 steps of 3, 2 first-rank trials each (8); then 8 levels: 12
    # tokens in 2 steps of 8, 7 trials each (22)
    assert got.depths == (measure.SHALLOW_DEPTH, 8)
    assert got.evidence.at_risk[0] == got.evidence.accepted[0] == 22 and got.vector.probs[0] == 1.0
    with Engine.load(target, draft=other, tree="sequoia", progress=False) as wrong:
        got = measure.on_policy(wrong, prompts, 4, SamplingParams(0.0, 1.0), 12, 0, depth=None, trials=10 ** 6)
        assert got.vector.probs[0] < measure.DEEP_HAZARD
        assert got.depths == (measure.SHALLOW_DEPTH,) * 4
        rejected = got.evidence.at_risk[0] - got.evidence.accepted[0]
        # ... and with a number of rejections to reach, it stops after the prompt that reached it
        cut = measure.on_policy(wrong, prompts, 4, SamplingParams(0.0, 1.0), 12, 0, depth=None, trials=10 ** 6,
                                rejections=rejected // 2)
    done = cut.evidence.at_risk[0] - cut.evidence.accepted[0]
    assert 1 <= len(cut.depths) < 4 and done >= rejected // 2
