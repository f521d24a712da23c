"""`--overlap auto`'s gate on growing the next tree during the target's pass: the executor's
measure of what the draft work in a pass's waits delayed it by (`idle_overrun_seconds`) against
the pass's own length with and without that work; the gate's rule (`OverlapGate`) on made-up
steps; and on the real decoder, a gate that stops growing what is never used, with greedy output
equal to plain decoding's."""

import statistics
import time

import pytest
import torch

from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.planning.adaptive import GROW_CONTROL, GROW_FIRST, GROW_MIN, GROW_REST, GROW_REST_MAX, OverlapGate
from offload_engine.runtime import streamer
from offload_engine.runtime.layer_store import LayerLayout
from offload_engine.runtime.loader import OffloadOptions, load_target
from offload_engine.runtime.placement import fixed_parts, make_plan
from offload_engine.speculation.decoder import SpeculativeDecoder
from tiny_models import greedy_past_eos, make_tiny_checkpoint, slow_fills

LAYERS = 8
FILL_S = 0.02  # a layer's fill, slowed: the passes wait for every layer
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gate") / "m", "llama3-gqa", layers=LAYERS, seed=3,
                                  init_std=0.05)
    return folder


def _streamed(ckpt, tmp_path, buffers, ram_layers=0):
    """Every layer streamed through `buffers` buffers: from disk, or the first `ram_layers` from RAM."""
    c = Checkpoint(ckpt, load_config(ckpt))
    layer = LayerLayout.for_config(c.config, torch.float32).block_bytes
    fixed = sum(fixed_parts(c.config, torch.float32, 64, 16).values())
    offload = "auto" if ram_layers else "disk"
    plan = make_plan(c.config, torch.float32, offload=offload, vram_bytes=fixed + buffers * layer + layer // 2,
                     ram_bytes=ram_layers * layer + layer // 2, buffers=buffers, max_context=64, max_batch_tokens=16)
    assert plan.buffers == buffers and len(plan.disk_layers) == LAYERS - ram_layers, plan
    return load_target(c, torch.float32, torch.device("cpu"), plan,
                       OffloadOptions(offload, buffers=buffers, store_root=tmp_path), progress=False)


def _pass(model, idle) -> tuple[float, float]:
    """One one-token pass with `idle` as the executor's wait work: (seconds, its overrun)."""
    layers = model.layers
    layers.idle, before = idle, layers.snapshot().idle_overrun_seconds
    try:
        cache = model.new_cache(4)
        t0 = time.perf_counter()
        model.forward(torch.tensor([1]), torch.tensor([0]), cache)
        seconds = time.perf_counter() - t0
    finally:
        layers.idle = None
    return seconds, layers.snapshot().idle_overrun_seconds - before


def _interleaved(model, idles: dict, rounds=5) -> dict:
    """Passes of each kind of wait work, interleaved round by round (a slow spell of a shared
    machine falls on all kinds alike): per kind, (median seconds, median overrun)."""
    got = {name: [] for name in idles}
    for _ in range(rounds):
        for name, idle in idles.items():
            got[name].append(_pass(model, idle))
    return {name: (statistics.median(t for t, _ in v), statistics.median(o for _, o in v)) for name, v in got.items()}


def _timed_worker(seconds):
    """Wait work like a draft layer's, torch compute, in units of `seconds` by the clock (products
    until that much time has passed): a unit's length holds on a busy machine, where a counted
    number of products stretches; sleeps would hold it too, but a layer's compute after a wait
    that slept ran at a third of its speed (measured: 30 ms a pass against 10 with no work)."""
    a = torch.randn(128, 128)

    def unit():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ a
        return True
    return unit


@pytest.mark.parametrize("buffers", [1, 2])
def test_the_overrun_is_what_the_wait_work_added_to_the_pass(ckpt, tmp_path, monkeypatch, buffers):
    """Every fill takes FILL_S more, so every layer is waited for. Work in 1 ms units fits the
    waits: the overrun is at most a unit per layer, and so is what it adds to the pass. Work in
    45 ms units (by the clock: counted products calibrated in a slow spell ran 26 ms in a CI run,
    overrun 27 ms) outlasts each wait: with one buffer the pass is longer by the overrun (the loader
    cannot fill ahead while the layer in hand waits for the work); with two, the loader fills the
    next buffer meanwhile and hides part of it, and the overrun is an upper bound. Thresholds:
    10-15 ms and a tenth of the overrun for timing on a busy 2-core machine (measured with units
    by the clock, one buffer: lengthened by 140, 132 and 139 ms where the overrun read 144, 143
    and 146; with counted units, 84, 132 and 133 against 90, 135 and 140). Work that runs out
    before the layer is in adds nothing."""
    slow_fills(monkeypatch, FILL_S)
    model = _streamed(ckpt, tmp_path, buffers)
    model.layers.fit_units = False  # (the overrun as such: without the rule that holds long units back)
    try:
        _pass(model, None)  # (warm)
        got = _interleaved(model, {"none": None, "short": _timed_worker(0.001), "long": _timed_worker(0.045),
                                   "ran out": _limited(_timed_worker(0.001), 3)})
    finally:
        model.layers.close()
    (plain, none), (short, short_over), (long, long_over), (_, ran_out) = (
        got[k] for k in ("none", "short", "long", "ran out"))
    assert none == 0.0
    waited = LAYERS - streamer.IDLE_TAIL_LAYERS  # layers whose waits take work
    assert 0 <= short_over <= waited * 0.003 + 0.005, short_over
    assert short <= plain + waited * 0.003 + 0.015, (short, plain)
    assert 0 <= ran_out <= 0.005, ran_out  # (the layers came in after the work ran out: no overrun)
    lengthened = long - plain
    print(f"buffers {buffers}: pass {plain:.4f} s, with 45 ms units {long:.4f} s, overrun {long_over:.4f} s")
    if buffers == 1:
        assert long_over >= 0.03, long_over  # (units outlast the layers' waits)
        assert abs(lengthened - long_over) <= 0.1 * long_over + 0.012, (lengthened, long_over)
    else:  # (the loader a layer ahead: some layers are in when wanted, and take no work)
        assert long_over >= 0.02 and lengthened <= long_over + 0.01, (lengthened, long_over)


def test_the_fit_rule_starts_only_units_that_end_before_the_layer_is_in(ckpt, tmp_path, monkeypatch):
    """The CPU's fit rule (`LayerExecutor.fit_units`, FIT_*). One buffer, every fill slowed to
    FILL_S = 20 ms, wait work in units of 15 ms of compute by the clock (`_timed_worker`; units of
    about 8 ms made the control hang on the phase of the wait, 24 ms of units less a wait of
    20-23 ms, and a CI run read 1.8 ms a layer): unfitted,
    each wait runs units until the layer is in, and the second ends 4-10 ms after it (a wait is
    the 20 ms plus the fill's own read). Fitted, the second unit is held back once the rule has
    durations to go by: the overrun vanishes, the pass is no longer than without work, and work
    still runs in every wait (one unit of two). Thresholds, for timing on a busy 2-core machine:
    the unfitted overrun at least 2 ms a waited layer; the fitted overrun under a quarter of the
    unfitted one and under 1 ms a waited layer; the fitted pass within 10 ms of the pass without
    work; the fitted work at least 40% of the unfitted work and 10 ms a waited layer. Each kind's
    medians over 5 interleaved rounds."""
    slow_fills(monkeypatch, FILL_S)
    model = _streamed(ckpt, tmp_path, 1)
    layers = model.layers
    unit = _timed_worker(0.015)
    got = {k: [] for k in ("none", "unfitted", "fitted")}
    try:
        _pass(model, None)  # (warm: the fills' durations)
        for _ in range(6):
            for kind in got:
                layers.fit_units = kind != "unfitted"
                before = layers.snapshot()
                seconds, overrun = _pass(model, None if kind == "none" else unit)
                after = layers.snapshot()
                got[kind].append((seconds, overrun, after.idle_work_seconds - before.idle_work_seconds,
                                  after.idle_held - before.idle_held))
    finally:
        layers.close()
    med = {k: [statistics.median(x[j] for x in v[1:]) for j in range(4)] for k, v in got.items()}  # (round 1: learning)
    (plain, _, _, _), (unfit, unfit_over, unfit_work, unfit_held), (fit, fit_over, fit_work, fit_held) = (
        med[k] for k in ("none", "unfitted", "fitted"))
    waited = LAYERS - streamer.IDLE_TAIL_LAYERS
    print(f"pass {plain:.4f} s; unfitted {unfit:.4f} s, overrun {unfit_over:.4f}, work {unfit_work:.4f}; "
          f"fitted {fit:.4f} s, overrun {fit_over:.4f}, work {fit_work:.4f}, held {fit_held}")
    assert unfit_held == 0 and fit_held >= waited - 1, (unfit_held, fit_held)
    assert unfit_over >= waited * 0.002, unfit_over  # (the case the rule is for)
    assert fit_over <= 0.25 * unfit_over and fit_over <= waited * 0.001, (fit_over, unfit_over)
    assert fit <= plain + 0.010, (fit, plain)
    assert fit_work >= 0.4 * unfit_work and fit_work >= waited * 0.010, (fit_work, unfit_work)


@pytest.mark.parametrize("unit_s", [0.025, 0.060])
def test_the_next_waits_slack_takes_more_work_and_keeps_the_pass(ckpt, tmp_path, monkeypatch, unit_s):
    """The fit rule's slack (`LayerExecutor.fit_slack`). Two buffers, every fill slowed to
    FILL_S = 20 ms, layers of about a millisecond, units that sleep (the rule is about time alone,
    and sleeps keep to it on a busy machine). With the slack a unit may end up to the next
    wait's length (a fill less a layer's compute) after its layer is in: the loader fills the
    next layer meanwhile, so the lateness comes out of the next wait and the pass is no longer.
    25 ms units: strict, none fits a wait (20 ms); with the slack most waits run one, ending
    past its layer, the lateness growing until a wait holds its unit back. 60 ms units
    outlast a wait and the next one's slack: none runs, strict or with the slack, while unfitted
    they hold back the layers' buffers from the loader and the pass grows (the control: a slack
    too large, as if unfitted, fails). Thresholds, for timing on a busy 2-core machine: with the
    slack, the pass within 12 ms of the pass without work; 25 ms: strict, the work under 10 ms (a
    unit may run while the rule learns), with the slack at least two units' worth and an overrun
    of at least 2 ms a waited layer; 60 ms: the work with the slack under 10 ms and the unfitted
    pass at least 40 ms longer than without work. Each kind's medians over 5 interleaved rounds."""
    slow_fills(monkeypatch, FILL_S)
    model = _streamed(ckpt, tmp_path, 2)
    layers = model.layers
    def unit():
        time.sleep(unit_s)
        return True
    got = {k: [] for k in ("none", "strict", "slack", "unfitted")}
    try:
        _pass(model, None)  # (warm: the fills' and layers' durations)
        for _ in range(6):
            for kind in got:
                layers.fit_slack, layers.fit_units = kind != "strict", kind != "unfitted"
                before = layers.snapshot()
                seconds, overrun = _pass(model, None if kind == "none" else unit)
                got[kind].append((seconds, overrun, layers.snapshot().idle_work_seconds - before.idle_work_seconds))
    finally:
        layers.close()
    med = {k: [statistics.median(x[j] for x in v[1:]) for j in range(3)] for k, v in got.items()}  # (round 1: learning)
    (plain, _, _), (strict, _, strict_work), (slack, slack_over, slack_work), (unfit, _, unfit_work) = (
        med[k] for k in ("none", "strict", "slack", "unfitted"))
    waited = LAYERS - streamer.IDLE_TAIL_LAYERS
    print(f"units {unit_s}: pass {plain:.4f} s; strict {strict:.4f} s, work {strict_work:.4f}; slack {slack:.4f} s, "
          f"overrun {slack_over:.4f}, work {slack_work:.4f}; unfitted {unfit:.4f} s, work {unfit_work:.4f}")
    assert slack <= plain + 0.012, (slack, plain)
    if unit_s < 2 * FILL_S:
        assert strict_work < 0.010, strict_work
        assert slack_over >= waited * 0.002 and slack_work >= 2 * unit_s, (slack_over, slack_work)
    else:
        assert slack_work < 0.010, slack_work
        assert unfit >= plain + 0.040, (unfit, plain)


def _limited(unit, k):
    """`unit` k times a wait, then nothing left (the way a tree grown ahead runs out); the call
    after that starts the next wait's k."""
    left = [0]

    def limited():
        if left[0] <= 0:
            left[0] = k
            return False
        left[0] -= 1
        return unit()
    left[0] = k
    return limited


LEVEL = 0.01  # in the made-up steps, a level grown ahead and used saves this much of the draft's 40 ms


def _step(gate, grew=True, overrun=0.0, used=0, draft=None, fresh=4, nodes=16, seconds=0.1):
    gate.observe(grew, overrun, used, 0.04 - LEVEL * used if draft is None else draft, fresh - used, nodes, seconds)


def _started(gate=None):
    """A gate past its first GROW_FIRST steps (passes of 16 nodes in 0.1 s that grew nothing)."""
    gate = gate or OverlapGate()
    assert not gate.grow
    for _ in range(GROW_FIRST):
        _step(gate, grew=False)
    assert gate.grow
    return gate


def _run(gate, k, **step):
    """k steps, each growing when the gate says so (a control step or a rest: not), with the
    step's figures where it grew (its pass) and where the step before grew (the levels used);
    else a pass of 0.1 s and nothing used."""
    told, before = [], False
    for _ in range(k):
        grew = gate.grow and step.get("grew", True)
        told.append(gate.grow)
        _step(gate, **{**step, "grew": grew, "seconds": step.get("seconds", 0.1) if grew else 0.1,
                       "used": step.get("used", 0) if before else 0})
        before = grew
    return told


def test_the_gate_stops_growing_what_is_never_used_and_tries_again_ever_later():
    gate = OverlapGate()
    log = _run(gate, 400, overrun=0.0, used=0)
    # GROW_FIRST steps to compare with, then GROW_MIN + 1 grown steps (the last one's gain is
    # known only at the step after), then a rest; each trial loses again and doubles the rest,
    # up to the cap (a trial is shorter than GROW_CONTROL: no control step in it)
    runs, k = [], 0
    while k < len(log):
        j = k
        while j < len(log) and log[j] == log[k]:
            j += 1
        runs.append((log[k], j - k))
        k = j
    grown = [n for on, n in runs[:-1] if on]
    rests = [n for on, n in runs[:-1] if not on]
    assert all(n == GROW_MIN + 1 for n in grown), runs
    assert rests[:5] == [GROW_FIRST, GROW_REST, 2 * GROW_REST, 4 * GROW_REST, min(8 * GROW_REST, GROW_REST_MAX)]
    assert max(rests) == GROW_REST_MAX and gate.stops == len(grown)
    assert gate.grown_steps == sum(n for on, n in runs if on)


def test_the_gate_keeps_growing_while_the_levels_used_are_worth_what_the_pass_grew_by():
    gate = _started()
    told = _run(gate, 200, overrun=0.002, used=1, seconds=0.108)  # a level (10 ms) saved, the pass 8 ms longer
    assert gate.stops == 0
    # after every GROW_CONTROL grown steps a control (not grown); the step after it has nothing to use
    assert told.count(False) == 200 // (GROW_CONTROL + 1)
    assert gate.grown_steps == 200 - told.count(False)
    assert gate.cost_seconds == pytest.approx(gate.grown_steps * 0.008)
    assert 0 < gate.gain_seconds <= gate.grown_steps * LEVEL + 1e-9
    # the same levels with the pass 12 ms longer: it stops once the window says so
    _run(gate, GROW_MIN + 3, overrun=0.002, used=1, seconds=0.112)
    assert not gate.grow and gate.stops == 1


def test_the_cost_is_what_the_pass_grew_by_not_only_the_overrun():
    """Passes 50 ms longer when growing, of which the executor saw 5 ms as overrun (the loader
    slowed by the draft's work, as on a CPU): the gate counts the 50 and stops; without passes of
    the same width to compare with (until its first control step) it counts the overrun."""
    gate = _started()
    _run(gate, GROW_MIN + 2, overrun=0.005, used=2, seconds=0.15)  # gains 20 ms a step
    assert not gate.grow and gate.cost_seconds >= (GROW_MIN + 1) * 0.05 - 1e-9
    other = _started()  # (its steps compared with: 16 nodes; these 32, up to the first control step)
    _run(other, GROW_CONTROL, overrun=0.005, used=2, nodes=32, seconds=0.15)
    assert other.stops == 0 and other.cost_seconds == pytest.approx(GROW_CONTROL * 0.005)


def test_the_gain_is_what_the_draft_saved_not_the_levels_counted():
    """Levels used every step, but the draft's part only 3 ms shorter than without them (moving
    their K/V costs the rest), the pass 8 ms longer: the gate stops. Counted at the draft's
    time per level (10 ms), the same steps would have kept it growing."""
    gate = _started()
    _run(gate, 2 * GROW_MIN, overrun=0.0, used=1, draft=0.037, seconds=0.108)
    assert gate.stops >= 1


def test_a_pass_that_is_noisy_but_no_longer_costs_nothing_on_the_whole():
    """Passes 30 ms either side of the resting ones' 100 ms, in turn, with 10 ms of overrun each:
    the signed differences cancel, and a level's 10 ms saved each step keeps the gate growing (a
    cost floored at the overrun would read 20 ms a step and stop it)."""
    gate = _started()
    for k in range(100):
        _step(gate, grew=gate.grow, overrun=0.01, used=1, seconds=0.07 if k % 2 else 0.13)
    assert gate.stops == 0


def test_a_trial_that_wins_sets_the_rest_back():
    gate = _started()
    _run(gate, GROW_MIN + 1, overrun=0.01, used=0)  # loses: a rest of GROW_REST
    assert not gate.grow and gate.stops == 1
    _run(gate, GROW_REST + GROW_MIN + 1, overrun=0.01, used=0)  # the rest, a trial that loses again
    assert gate.stops == 2 and gate.rest == 4 * GROW_REST  # (the next rest, after this one of 2 x GROW_REST)
    _run(gate, 2 * GROW_REST)
    assert gate.grow
    _run(gate, GROW_MIN + 2, overrun=0.0, used=2)  # a trial whose levels are used
    assert gate.grow and gate.stops == 2 and gate.rest == GROW_REST


def test_steps_that_grew_nothing_do_not_count():
    """A pass with no wait grows nothing: no cost, no gain, and no reason to stop."""
    gate = _started()
    _run(gate, 100, grew=False, overrun=0.0, used=0)
    assert gate.stops == 0 and gate.grown_steps == 0


@pytest.mark.slow
def test_a_gate_stops_growing_trees_whose_case_never_comes_and_output_stays_plain(ckpt, tmp_path, monkeypatch):
    """self-q8 on a disk-streamed target whose every fill is slowed (the passes wait and grow
    trees ahead), with the check of a grown tree's case made to answer no: `--overlap auto`
    starts with GROW_FIRST steps without growing, grows GROW_MIN + 1 steps, stops, and tries
    again after GROW_REST, growing nothing while it rests; output equals plain greedy's, with the
    gate and with `--overlap on` (which grows in every step)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    slow_fills(monkeypatch, 0.01)
    plain = greedy_past_eos(ckpt, PROMPT, 64)[0].token_ids
    monkeypatch.setattr(SpeculativeDecoder, "_case_came", staticmethod(lambda job, last, result: False))
    kw = dict(tree="sequoia", draft="self-q8", draft_group_size=32, offload="disk", buffers=2, tree_budget=4,
              tree_depth=2)  # (at most 3 tokens a step: 21 steps at least, room for a rest and a trial)
    gated, _ = greedy_past_eos(ckpt, PROMPT, 64, overlap="auto", **kw)
    assert gated.token_ids == plain
    stats = gated.stats["overlap"]
    assert stats["hits"] == 0 and stats["gate_stops"] >= 1, stats
    assert stats["misses"] <= stats["grown_steps"], stats  # (nothing grown while it rests)
    assert stats["grown_steps"] <= (GROW_MIN + 1) * stats["gate_stops"] + GROW_MIN + 1, stats
    assert stats["rested_steps"] >= GROW_FIRST + GROW_REST, stats
    assert stats["grown_steps"] > GROW_MIN + 1, stats  # (it tried again after its rest)
    always, _ = greedy_past_eos(ckpt, PROMPT, 64, overlap="on", **kw)
    assert always.token_ids == plain
    assert "gate" not in always.stats["overlap"] and always.stats["overlap"]["misses"] >= gated.stats["target_steps"] - 1


def test_a_gain_with_nothing_to_compare_with_is_not_counted():
    """A step that used a tree grown ahead but has no step of as many nodes that used nothing
    (suffix nodes grafted onto it, a width new to the gate): the grown step before it counts for
    nothing, neither its cost nor a gain guessed from the levels."""
    gate = _started()
    _step(gate, grew=True, overrun=0.0, seconds=0.12)  # grown, 16 nodes: cost 20 ms
    assert len(gate.window) == 1
    _step(gate, grew=False, used=2, nodes=48)  # used 2 levels, no 48-node step to compare with
    assert len(gate.window) == 0 and gate.gain_seconds == 0.0


def test_the_fit_rule_goes_by_each_tiers_fills_and_probes_when_it_holds_every_unit(ckpt, tmp_path):
    """The rule's arithmetic on set durations (`LayerExecutor._unit_fits`, `FitMemory`), no
    timing involved. Fills are counted per tier: with RAM copies of 1 ms and disk reads of
    100 ms, a 10 ms unit fits a disk layer's wait and not a RAM layer's (pooled, the low quantile
    would be the RAM copy's and the disk wait would get nothing). A rule that holds every unit
    back would never time one again: after FIT_PROBE waits held in a row it lets one through
    and forgets the units' durations (the next FIT_MIN are learnt), the next probe after twice
    as many, up to FIT_PROBE_MAX, and back to FIT_PROBE once a unit fits."""
    model = _streamed(ckpt, tmp_path, 2, ram_layers=3)
    layers = model.layers
    try:
        ram, disk = min(layers.ram_blocks), min(layers.plan.disk_layers)
        time.sleep(0.3)  # (the loader has filled both buffers and waits: no fill begins below)
        layers._fill_began = [None] * len(layers._fill_began)  # (not begun: a whole fill ahead)
        mem = layers.fit_memory = streamer.FitMemory()
        mem.fills["ram"].extend([0.001] * 8)
        mem.fills["disk"].extend([0.100] * 8)
        mem.units.extend([0.010] * 8)
        assert not layers._unit_fits(0, ram) and layers._unit_fits(0, disk)

        mem = layers.fit_memory = streamer.FitMemory()
        mem.fills["disk"].extend([0.001] * 8)
        held, probes = 0, []
        for _ in range(8 * streamer.FIT_PROBE_MAX):  # (bounded: a rule that never probes must fail, not hang)
            if len(probes) == 6:
                break
            if len(mem.units) < streamer.FIT_MIN:  # (what the next units would have measured)
                mem.units.extend([0.5] * streamer.FIT_MIN)
            if layers._unit_fits(0, disk):
                probes.append(held + 1)
                assert len(mem.units) == 0  # (forgotten: learnt again)
                held = 0
            else:
                held += 1
        p, top = streamer.FIT_PROBE, streamer.FIT_PROBE_MAX
        assert probes == [min(p * 2 ** k, top) for k in range(6)], probes
        mem.units.extend([0.0001] * 8)
        assert layers._unit_fits(0, disk) and mem.probe_after == p and mem.held_in_a_row == 0
    finally:
        layers.close()


def test_calls_with_nothing_to_do_are_not_timed_and_idle_is_not_asked_again_in_the_pass(ckpt, tmp_path, monkeypatch):
    """Wait work of three 4 ms units, then nothing (as the draft's trees grown ahead end). The
    unit that ends the work (False after units that returned True) is timed; the executor asks no
    more in that pass: 4 calls a pass, 4 durations. Work that has nothing to do from the start
    (False at once) is asked once and not timed. Before, every later wait asked again and timed
    its microseconds, which made the units look short to the fit rule (the 75th percentile of 16
    durations, a third of them near 0) and let too-long units through."""
    slow_fills(monkeypatch, FILL_S)
    model = _streamed(ckpt, tmp_path, 1)
    layers = model.layers
    layers.fit_units = False  # (every unit runs until its layer is in: the calls do not depend on timing)
    calls = []

    def three_units():
        def work():
            for _ in range(3):
                time.sleep(0.004)
                yield
        it = work()

        def idle():
            calls.append(1)
            try:
                next(it)
                return True
            except StopIteration:
                return False
        return idle

    def nothing():
        calls.append(1)
        return False
    try:
        for _ in range(3):
            before = len(layers.fit_memory.units), len(calls)
            _pass(model, three_units())
            assert (len(layers.fit_memory.units) - before[0], len(calls) - before[1]) == (4, 4)
        assert sorted(layers.fit_memory.units)[-9:][0] >= 0.0035  # (the 9 units that worked)
        before = len(layers.fit_memory.units), len(calls)
        _pass(model, nothing)
        assert (len(layers.fit_memory.units) - before[0], len(calls) - before[1]) == (0, 1)
    finally:
        layers.close()


def test_a_rule_that_held_long_units_back_takes_short_ones_again(ckpt, tmp_path, monkeypatch):
    """The probe end to end. One buffer, fills of 20 ms, the rule on. Units of 30 ms (longer than
    a wait) for 3 passes: held back once learnt. Then units of 3 ms: without a probe the rule would
    never run one again (it times units only when they run, and remembers the 30 ms ones); with
    FIT_PROBE set to 4 (8 at most) it forgets them within two passes, learns the short ones and
    fills the waits again. Thresholds: the 30 ms units held back in at least half the waits of
    their last pass; in the last two of 4 passes of short units, at least 20 ms of work each
    (6 waits of about 20 ms; measured: 112 ms in each of the 4, a probe during the long units'
    passes having just forgotten them; with the probe taken out, none)."""
    slow_fills(monkeypatch, FILL_S)
    monkeypatch.setattr(streamer, "FIT_PROBE", 4)
    monkeypatch.setattr(streamer, "FIT_PROBE_MAX", 8)
    model = _streamed(ckpt, tmp_path, 1)
    layers = model.layers
    layers.fit_memory = streamer.FitMemory(probe_after=4)
    waited = LAYERS - streamer.IDLE_TAIL_LAYERS

    def sleeper(seconds):
        def unit():
            time.sleep(seconds)
            return True
        return unit
    try:
        for _ in range(3):
            before = layers.snapshot()
            _pass(model, sleeper(0.030))
        assert layers.snapshot().idle_held - before.idle_held >= waited // 2
        work = []
        for _ in range(4):
            before = layers.snapshot()
            _pass(model, sleeper(0.003))
            work.append(layers.snapshot().idle_work_seconds - before.idle_work_seconds)
        print("work a pass with the short units:", [round(w, 4) for w in work])
        assert min(work[2:]) >= 0.020, work
    finally:
        layers.close()
