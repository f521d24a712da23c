"""benchmarks/forecast_floor.py: how close a step-by-step forecast can be when the model is right,
checked on cases worked by hand and against the exact step-count distribution."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import forecast_floor as ff
from sequoia_trees.optimizer import steps_distribution


def test_a_step_that_always_makes_the_same_tokens_is_forecast_exactly():
    pmf = np.array([0.0, 0.0, 0.0, 1.0])  # three tokens a step, always
    r = ff.floor(pmf, 10, answers=3, tolerance=0.0, samples=500, seed=1)
    assert r["one_within"] == r["pooled_within"] == 1.0 and r["steps"] == [4]


def test_two_tokens_of_one_or_two_a_step_as_worked_by_hand():
    # L = 2, X = 1 or 2 with 1/2 each. The first step is forecast E[min(X, 2)] = 1.5 tokens. X = 2: done,
    # forecast 1.5 for 2 measured (forecast s/token 2 / 1.5 = 1.333x the measured one). X = 1: one token
    # left, forecast E[min(X, 1)] = 1 more, 2.5 in all: 0.8x. Two answers pooled: 4 / (1.5 + 1.5) = 1.333x
    # (chance 1/4), 4 / (1.5 + 2.5) = 1.0x (1/2), 4 / (2.5 + 2.5) = 0.8x (1/4)
    pmf = np.array([0.0, 0.5, 0.5])
    n = 20000
    r = ff.floor(pmf, 2, answers=2, tolerance=0.25, samples=n, seed=2)
    assert r["steps"] == [1, 2]
    assert r["one_within"] == pytest.approx(0.5, abs=5 * (0.25 / (2 * n)) ** 0.5)  # the 0.8x answers
    assert r["pooled_within"] == pytest.approx(0.75, abs=5 * (0.1875 / n) ** 0.5)  # all but the 1.333x pairs
    tight = ff.floor(pmf, 2, answers=2, tolerance=0.10, samples=n, seed=3, observed=1.2)
    assert tight["one_within"] == 0.0
    assert tight["pooled_within"] == pytest.approx(0.5, abs=5 * (0.25 / n) ** 0.5)  # the 1.0x pairs only
    assert tight["pooled_as_far"] == pytest.approx(0.25, abs=5 * (0.1875 / n) ** 0.5)  # the 1.333x pairs
    assert ff.floor(pmf, 2, answers=2, tolerance=0.35, samples=2000, seed=2)["one_within"] == 1.0


def test_the_simulated_step_counts_have_the_exact_distribution():
    # a deep tree's step tokens (the shape of self-q8's (16, 13) at p_1 = 0.97) against
    # `steps_distribution`, the exact recursion; 20,000 answers, each step count's frequency within
    # 5 standard errors of its chance
    reach = 0.97 ** np.arange(15)
    pmf = np.zeros(15)
    pmf[1:] = reach[:-1] - np.append(reach[1:-1], 0.0)
    pmf /= pmf.sum()
    n, length = 20000, 39
    sims = ff.forecast_ratios(pmf, length, n, np.random.default_rng(4))
    exact = steps_distribution(pmf, length)
    for steps, chance in enumerate(exact):
        seen = float(np.mean(sims[:, 1] == steps))
        assert abs(seen - chance) <= 5 * (chance * (1 - chance) / n) ** 0.5 + 1e-9, (steps, seen, chance)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        ff.forecast_ratios(np.array([0.5, 0.5]), 5, 10, np.random.default_rng(0))  # P(X = 0) > 0
    with pytest.raises(ValueError):
        ff.forecast_ratios(np.array([0.0, 1.0]), 0, 10, np.random.default_rng(0))


def test_the_command_prints_a_row_per_tree_and_length_and_refuses_a_bad_vector(tmp_path, capsys):
    vec = tmp_path / "v.json"
    vec.write_text(json.dumps({"acceptance": [0.9, 0.05, 0.0]}))
    assert ff.main(["--vector", str(vec), "--trees", "8,8 4,2", "--lengths", "10,20", "--samples", "300",
                    "--observed", "1.1"]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("| (8, 8) |") for line in out.splitlines()) == 2
    assert sum(line.startswith("| (4, 2) |") for line in out.splitlines()) == 2
    (tmp_path / "bad.json").write_text("{")
    assert ff.main(["--vector", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not an acceptance vector" in capsys.readouterr().err
    assert ff.main(["--vector", str(vec), "--trees", "8"]) == 2
