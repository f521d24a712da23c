"""`sequoia_trees.acceptance.prompt_tau`: how much the first rank's acceptance moves from one
prompt to the next beyond chance (`benchmarks/prompt_spread.py`), on counts simulated from its
own model with a known tau."""

import math

import numpy as np

from sequoia_trees.acceptance import PROMPT_MIN_PROMPTS, PROMPT_MIN_TRIES, prompt_tau


def _estimates(tau, h0=0.95, prompts=40, tries=60, reps=100, seed=0):
    rng = np.random.default_rng(seed)
    centre = math.log(h0 / (1 - h0))
    out = []
    for _ in range(reps):
        h = 1 / (1 + np.exp(-(centre + tau * rng.standard_normal(prompts))))
        out.append(prompt_tau(list(zip([tries] * prompts, rng.binomial(tries, h).tolist()))))
    return np.array([e for e, _ in out]), np.array([u for _, u in out])


def test_the_spread_beyond_chance_is_found_where_there_is_one_and_not_where_there_is_none():
    """100 simulated sets of 40 prompts x 60 rank-1 tries at a hazard of 0.95 (a self-draft's),
    with tau 0 and 0.8. Measured (seed 0 and others): tau 0: 56-63% of the estimates 0, 1-3% over
    0.4, mean 0.09-0.10; tau 0.8: mean 0.77, 98% over 0.4; the 90% upper end at or above the true tau
    in 95%, and at tau 0 its median 0.35. Thresholds (with 100 sets a share's standard error is
    at most 0.05, a mean's about 0.013): tau 0: at most 6% over 0.4, mean under 0.2, the upper
    end's median at most 0.6; tau 0.8: mean within 0.15, at least 90% over 0.4, the upper end at
    or above 0.8 in at least 85%. The spread of the log-odds with their binomial noise left in
    fails (every estimate 1 or more at tau 0); so does a likelihood whose normal is half as wide
    as its tau (24% over 0.4 at tau 0)."""
    none, none_up = _estimates(0.0)
    assert (none > 0.4).mean() <= 0.06 and none.mean() < 0.2, (none.mean(), (none > 0.4).mean())
    some, some_up = _estimates(0.8, seed=1)
    assert abs(some.mean() - 0.8) <= 0.15 and (some > 0.4).mean() >= 0.9, (some.mean(), (some > 0.4).mean())
    assert (some_up >= 0.8).mean() >= 0.85, (some_up >= 0.8).mean()
    assert np.median(none_up) <= 0.6, np.median(none_up)  # (no spread: the interval says how little)


def test_too_few_counted_prompts_give_no_estimate():
    enough = [(PROMPT_MIN_TRIES, PROMPT_MIN_TRIES - 1)] * PROMPT_MIN_PROMPTS
    assert prompt_tau(enough) is not None
    assert prompt_tau(enough[1:]) is None
    assert prompt_tau(enough[1:] + [(PROMPT_MIN_TRIES - 1, 3)]) is None  # (too few tries to count)
    assert prompt_tau(enough[1:] + [(10, 11)]) is None  # (more accepted than tried: not a count)
