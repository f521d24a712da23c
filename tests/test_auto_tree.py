"""Hardware profiles and `--tree auto`: profile files are validated field by field; auto picks a
plan from a (fake, fast) profile and still decodes exactly; a real profile is measured, cached
and reused."""

import json
import statistics
from dataclasses import replace

import pytest

from offload_engine.apps.cli import main
from offload_engine.errors import UserError
from offload_engine.planning.hw_profile import GpuSpec, MeasuredProfile, from_dict, gpu_names, load_gpu_spec, load_measured
import offload_engine.planning.profiler as profiler
import offload_engine.speculation.measure as measure
from tiny_models import greedy_past_eos, make_tiny_checkpoint

GOOD_GPU = {"kind": "gpu-spec", "name": "x", "description": "a GPU", "vram_gib": 24.0, "h2d_pinned_gb_per_s": 25.0,
            "fp16_dense_tflops": 82.6, "mem_gb_per_s": 1008.0, "pcie": "4.0 x16",
            "sources": {"vram_gib": "a", "h2d_pinned_gb_per_s": "b", "fp16_dense_tflops": "c", "mem_gb_per_s": "d"}}


@pytest.mark.parametrize("change, message", [
    ({"drop": "h2d_pinned_gb_per_s"}, "field 'h2d_pinned_gb_per_s' is missing"),
    ({"h2d_pinned_gb_per_s": -3.0}, "field 'h2d_pinned_gb_per_s' must be positive"),
    ({"vram_gib": 0}, "field 'vram_gib' must be positive"),
    ({"vram_gib": "24 GB"}, "field 'vram_gib' must be a number"),
    ({"drop": "vram_gib", "vram_gb": 24}, "field 'vram_gb' has the wrong unit: this field is 'vram_gib'"),
    ({"h2d_pinned_mb_per_s": 25000}, "field 'h2d_pinned_mb_per_s' has the wrong unit"),
    ({"colour": "green"}, "unknown field 'colour'"),
    ({"kind": "measured"}, "field 'kind' is 'measured'"),
])
def test_profile_fields_are_checked_by_name(tmp_path, change, message):
    data = dict(GOOD_GPU)
    if "drop" in change:
        del data[change.pop("drop")]
    data.update(change)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as e:
        load_gpu_spec(path)
    assert str(path) in str(e.value)


def test_sources_are_required_and_shipped_specs_load(tmp_path):
    data = dict(GOOD_GPU, sources={"vram_gib": "a"})
    (tmp_path / "g.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="no source for h2d_pinned_gb_per_s"):
        load_gpu_spec(tmp_path / "g.json")
    assert isinstance(from_dict(GpuSpec, GOOD_GPU, tmp_path / "x.json"), GpuSpec)
    names = gpu_names()
    assert {"rtx4090", "rtx3090", "rtx4080", "l40", "a100-40gb", "h100-pcie"} <= set(names)
    for name in names:
        spec = load_gpu_spec(name)
        assert spec.vram_gib > 0 and spec.h2d_pinned_gb_per_s < spec.mem_gb_per_s


def _fake_profile(engine, pass_s=1.0, draft_s=1e-4) -> MeasuredProfile:
    ns = (1, 16, 64, 128)
    ws = (1, 8, 64)
    return MeasuredProfile(machine="fake", device="cpu", dtype="float32", target=str(engine.folder),
                           target_fingerprint=engine.target_fingerprint, draft_key=engine.draft_key, plan={},
                           stream_source="none", stream_gb_per_s=0.0, prefix_tokens=128, target_tokens=ns,
                           target_pass_s=tuple(pass_s for _ in ns), draft_widths=ws,
                           draft_level_s=tuple(draft_s for _ in ws), step_residual_s=0.0,
                           draft_level_greedy_s=tuple(draft_s for _ in ws), step_residual_greedy_s=0.0, measured_at="now",
                           measure_s=0.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    target = make_tiny_checkpoint(root / "t", "llama3-gqa", layers=2, seed=3, init_std=0.05)
    return target


def test_auto_with_a_fast_fake_profile_picks_a_plan_and_decodes_exactly(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", lambda engine, *a, **k: _fake_profile(engine))
    # a flat pass time and a nearly free draft: the deepest, widest tree the vector supports pays
    # (the int8 copy of a tiny model agrees with it almost always at T=0: a long chain)
    result, engine = greedy_past_eos(pair, "Hello", 24, draft="self-int8", tree="auto")
    assert sorted(engine.auto_plans) == [0.0, 0.6]
    plan = engine.auto_plans[0.0]
    assert plan.choice.depth >= 16 and plan.choice.tokens_per_step > 8 and result.stats["tree"] == "sequoia"
    assert result.stats["tree_budget"] == plan.choice.budget and result.stats["auto"]["budget"] == plan.choice.budget
    assert result.token_ids == greedy_past_eos(pair, "Hello", 24)[0].token_ids
    # with no stored vector, the pair's vectors were measured once into the cache, and reused
    cached = sorted((tmp_path / "cache" / "sequoia-offload" / "acceptance").glob("*.json"))
    assert sorted(json.loads(p.read_text())["temperature"] for p in cached) == [0.0, 0.6]
    monkeypatch.setattr(measure, "measure_and_cache", lambda *a: pytest.fail("measured again"))
    # the profile is cached too: a second load measures nothing
    monkeypatch.setattr(profiler, "measure", lambda *a, **k: pytest.fail("profiled again"))
    again, _ = greedy_past_eos(pair, "Hello", 24, draft="self-int8", tree="auto", tree_budget=16)
    assert again.token_ids == result.token_ids and again.stats["tree_budget"] <= 16  # the cap holds


def test_auto_skips_a_draft_that_does_not_pay(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(profiler, "measure", lambda engine, *a, **k: _fake_profile(engine, pass_s=0.001, draft_s=5.0))
    result, engine = greedy_past_eos(pair, "Hello", 12, draft="self-int8", tree="auto")
    assert all(p.choice.budget == 1 for p in engine.auto_plans.values())
    assert result.stats["tree"] == "none" and result.token_ids == greedy_past_eos(pair, "Hello", 12)[0].token_ids


def test_profile_command_measures_caches_and_validates(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "p.json"
    args = ["profile", "--target", str(pair), "--device", "cpu", "--draft", "self-int4", "--draft-group-size", "32",
            "--offload", "disk", "--budget-s", "30", "--out", str(out)]
    assert main(args) == 0
    prof = load_measured(out)
    assert prof.stream_source == "o_direct-read" and prof.stream_gb_per_s > 0
    assert prof.target_tokens[0] == 1 and len(prof.target_tokens) >= 2 and all(t > 0 for t in prof.target_pass_s)
    assert prof.draft_widths[:2] == (1, 2) and prof.plan["disk_layers"] == 2
    # real steps of at least four tree shapes and a plain one, and the fit's cross-validated error
    assert len(prof.fit_budgets) >= 5 and prof.fit_budgets[-1] == 1 and all(t > 0 for t in prof.fit_step_s)
    assert 0 < prof.fit_cv_error < 5 and 0 < prof.fit_cv_error_greedy < 5 and prof.draft_factor >= 0
    printed = capsys.readouterr().out
    assert "measured:" in printed and "cross-validated error" in printed and "| plain |" in printed
    # the speed check's readings, taken in the profile's own spell (`profiler.check_readings`)
    assert prof.check_target_s > 0 and prof.check_draft_s > 0 and "speed check readings" in printed
    # no vector for this pair yet: the generic one shaped the timed trees, and the profile says so
    assert prof.fit_vector == prof.fit_vector_greedy == () and "shaped by a generic acceptance vector" in printed
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "cached:" in printed and "speed check against the profile of " in printed
    good = json.loads(out.read_text())
    old = {k: v for k, v in good.items() if not k.startswith(("fit_", "plain_step", "draft_factor", "step_per_node"))}
    out.write_text(json.dumps(old))  # a profile written before the step model loads, with the old model
    legacy = load_measured(out).timings(greedy=False)
    assert (legacy.node_seconds, legacy.draft_factor, legacy.plain_seconds) == (0.0, 1.0, 0.0)
    for change, message in (({"target_pass_s": good["target_pass_s"][:-1]}, "differ in length"),
                            ({"target_pass_s": 1.0}, "'target_pass_s' must be a list"),
                            ({"stream_gb_per_s": [1.0]}, "'stream_gb_per_s' must be a number"),
                            ({"draft_widths": [1, "2"]}, "'draft_widths' must be a list of positive whole"),
                            ({"prefix_tokens": 0}, "'prefix_tokens' must be a positive whole number"),
                            ({"step_residual_s": 1e400}, "must be a finite number"),
                            ({"draft_factor": "1"}, "'draft_factor' must be a number, got '1'"),
                            ({"draft_factor": -0.5}, "'draft_factor' must be >= 0"),
                            ({"check_draft_s": -0.5}, "'check_draft_s' must be >= 0"),
                            ({"fit_depths": good["fit_depths"][:-1]}, "'fit_budgets' and 'fit_depths' differ"),
                            ({"fit_step_s": [0.1] * len(good["fit_budgets"]) + [0.1]}, "differ in length"),
                            ({"fit_vector": [0.7, 0.6]}, "'fit_vector' is not an acceptance vector"),
                            ({"fit_vector_greedy": [0.5, "x"]}, "'fit_vector_greedy' must be a number"),
                            ({"fit_vector_greedy": 0.5}, "'fit_vector_greedy' must be a list"),
                            ({"target_retimed": [64] * (len(good["target_retimed_from_s"]) + 1)},
                             "'target_retimed' and 'target_retimed_from_s' differ"),
                            ({"target_retimed": [64], "target_retimed_from_s": [0.0]},
                             "'target_retimed_from_s' must be positive")):
        out.write_text(json.dumps({**good, **change}).replace("Infinity", "1e400"))
        with pytest.raises(UserError, match=message):
            load_measured(out)
    # a damaged cached profile is measured again (with a warning), not a crash
    cached = next(p for p in (tmp_path / "cache" / "sequoia-offload" / "profiles").glob("*.json")
                  if "-target-" not in p.name)
    cached.write_text("{not json")
    assert main(args) == 0
    assert "measured:" in capsys.readouterr().out


def test_the_timed_steps_trees_are_shaped_by_the_pairs_own_vectors(pair, tmp_path, monkeypatch, capsys):
    """With a vector cached for the pair, the profile's timed tree steps are the trees the
    optimizer will choose among for it (the greedy steps shaped by the T=0 vector, the sampled
    ones by the sampled vector), and the profile records both; the step model is fitted to
    those trees' level widths."""
    from offload_engine import Engine
    from offload_engine.speculation.acceptance_store import MEASUREMENT, acceptance_cache_dir
    from offload_engine.speculation.decoder import SpeculativeDecoder
    from sequoia_trees.acceptance import AcceptanceVector
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with Engine.load(str(pair), device="cpu", draft="self-int8", tree="sequoia", offload="disk") as engine:
        fp, dkey = engine.target_fingerprint, engine.draft_key
    vectors = {0.0: (0.9, 0.05, 0.02), 0.6: (0.3, 0.3, 0.2)}
    acceptance_cache_dir().mkdir(parents=True)
    for t, probs in vectors.items():
        (acceptance_cache_dir() / f"pair-t{t:g}.json").write_text(json.dumps(
            {"acceptance": list(probs), "temperature": t, "target_fingerprint": fp, "draft_key": dkey,
             "measurement": MEASUREMENT}))
    used = []  # every timed tree step's (greedy, the vector shaping its tree)
    real_set_spec = SpeculativeDecoder.set_spec

    def set_spec(self, spec):
        if spec.kind == "sequoia":
            used.append((self.params.greedy, spec.acceptance.probs))
        return real_set_spec(self, spec)
    monkeypatch.setattr(SpeculativeDecoder, "set_spec", set_spec)
    fitted = []
    real_fit = profiler.fit_step_model
    monkeypatch.setattr(profiler, "fit_step_model", lambda *a: fitted.append(a[3]) or real_fit(*a))
    out = tmp_path / "p.json"
    assert main(["profile", "--target", str(pair), "--device", "cpu", "--draft", "self-int8", "--offload", "disk",
                 "--budget-s", "10", "--out", str(out)]) == 0
    prof = load_measured(out)
    assert prof.fit_vector_greedy == vectors[0.0] and prof.fit_vector == vectors[0.6]
    assert used and {greedy for greedy, _ in used} == {True, False}
    assert all(probs == vectors[0.0 if greedy else 0.6] for greedy, probs in used)
    assert [v.probs for v in fitted] == [vectors[0.0], vectors[0.6]]
    assert "greedy steps' trees shaped by the pair's acceptance vector: [0.900, 0.050, 0.020]" in capsys.readouterr().out
    # a profile cached before the pair had vectors (generic trees) is measured again once it has
    cached = next(p for p in (tmp_path / "cache" / "sequoia-offload" / "profiles").glob("*.json")
                  if "-target-" not in p.name)
    cached.write_text(json.dumps({**json.loads(out.read_text()), "fit_vector": [], "fit_vector_greedy": []}))
    again = tmp_path / "again.json"
    assert main(["profile", "--target", str(pair), "--device", "cpu", "--draft", "self-int8", "--offload", "disk",
                 "--budget-s", "10", "--out", str(again)]) == 0
    assert "measured:" in capsys.readouterr().out and load_measured(again).fit_vector_greedy == vectors[0.0]
    # a vector too narrow for every timed shape (no (16, 4) tree with 2 children a node) is not used
    (acceptance_cache_dir() / "pair-t0.json").write_text(json.dumps(
        {"acceptance": [0.9, 0.05], "temperature": 0.0, "target_fingerprint": fp, "draft_key": dkey,
         "measurement": MEASUREMENT}))
    with Engine.load(str(pair), device="cpu", draft="self-int8", tree="sequoia", offload="disk") as engine:
        shaping = profiler.shaping_vectors(engine)
    assert shaping[True] == profiler.PROFILE_VECTOR and shaping[False].probs == vectors[0.6]
    # the widths differ from the generic vector's, which is why this matters
    assert profiler.step_widths(AcceptanceVector(vectors[0.0]), 16, 4) != \
        profiler.step_widths(profiler.PROFILE_VECTOR, 16, 4)


def test_the_passes_and_levels_are_timed_again_between_the_steps_rounds(pair, tmp_path, monkeypatch):
    """The repeats of the isolated passes and draft levels are taken in the rounds of the real
    steps (two rounds, each after some steps and before others), not back to back before them:
    a slow spell then falls on one timing of each and the medians drop it, instead of making
    every pass look slow beside the steps."""
    from offload_engine.speculation.decoder import SpeculativeDecoder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    log = []
    real_step, real_round = SpeculativeDecoder.step, profiler._Repeats.round
    monkeypatch.setattr(SpeculativeDecoder, "step", lambda self, root: log.append("step") or real_step(self, root))
    monkeypatch.setattr(profiler._Repeats, "round",
                        lambda self: log.append(f"repeat {len(self.again)} {len(self.times)}") or real_round(self))
    assert main(["profile", "--target", str(pair), "--device", "cpu", "--draft", "self-int8", "--offload", "disk",
                 "--budget-s", "10", "--force"]) == 0
    repeats = [k for k, e in enumerate(log) if e.startswith("repeat")]
    assert len(repeats) == 4  # two rounds, each of the passes and of the levels
    assert all(log[k].split()[1] == log[k].split()[2] for k in repeats)  # (every timing here is short: all repeated)
    assert "step" in log[:repeats[0]] and "step" in log[repeats[1]:repeats[2]] and "step" in log[repeats[-1]:]


def test_a_second_draft_on_the_same_target_and_plan_reuses_the_targets_part(pair, tmp_path, monkeypatch):
    """The target's passes (and their waits, and the bandwidth) are the same whatever the draft:
    profiling a second draft on the same target, plan and machine times only its levels and
    steps (what `--draft auto` does once per candidate); `profile --force` measures all again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    base = ["profile", "--target", str(pair), "--device", "cpu", "--offload", "disk", "--budget-s", "10"]
    assert main([*base, "--draft", "self-int8", "--out", str(tmp_path / "a.json")]) == 0
    first = load_measured(tmp_path / "a.json")
    monkeypatch.setattr(profiler, "disk_read_gbps", lambda *a: pytest.fail("the target's part measured again"))
    # the machine 2.5x slower since: the one-token pass timed again reads so (the clock told), and the
    # shared part is scaled to this profile's spell; every other timing is real
    real_timed, one = profiler._timed, first.check_target_s
    monkeypatch.setattr(profiler, "_timed", lambda fn, device: (
        real_timed(fn, device) if getattr(fn, "reading", None) != ("target", 1) else (fn(), 2.5 * one)[1]))
    assert main([*base, "--draft", "self-int4", "--draft-group-size", "32", "--out", str(tmp_path / "b.json")]) == 0
    second = load_measured(tmp_path / "b.json")
    assert second.draft_key != first.draft_key and second.fit_budgets
    assert (second.target_tokens, second.stream_gb_per_s) == (first.target_tokens, first.stream_gb_per_s)
    assert second.target_pass_s == pytest.approx([2.5 * t for t in first.target_pass_s])
    assert second.target_idle_s == pytest.approx([2.5 * t for t in first.target_idle_s])
    monkeypatch.setattr(profiler, "_timed", real_timed)
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = []
    real = profiler.disk_read_gbps
    monkeypatch.setattr(profiler, "disk_read_gbps", lambda *a: measured.append(1) or real(*a))
    assert main([*base, "--draft", "self-int4", "--draft-group-size", "32", "--force",
                 "--out", str(tmp_path / "c.json")]) == 0
    assert measured  # --force: the target's part too


def test_the_machine_name_names_the_cpu_extensions_the_kernels_depend_on(monkeypatch):
    """Two hosts with the same model name, one with AVX-512 VNNI and one with AVX2 only (the same
    VM kind, 2026-12-03: the int8 GEMM 15x apart), are two machines to the profile's key."""
    import torch

    def host(flags):
        class FakePath:
            def __init__(self, *a):
                pass

            def read_text(self):
                return f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n"
        monkeypatch.setattr(profiler, "Path", FakePath)
        return profiler.machine_name(torch.device("cpu"))

    avx2, vnni = host("avx avx2 fma"), host("avx2 avx512f avx512_vnni")
    assert avx2.startswith("AMD EPYC x") and avx2.endswith("(avx2)")
    assert vnni.endswith("(avx2, avx512f, avx512_vnni)")


def test_a_speed_check_rescales_both_parts_half_the_way():
    """`profiler.rescaled`: the target's passes and waits by the check's target ratio, the draft's
    levels (greedy and sampled) by its draft ratio, each to the power CHECK_TRUST (a reading is
    half believed), within CHECK_TOLERANCE too (past it, the readings are taken twice: `moved`);
    a reading not taken leaves its part."""
    k = profiler.CHECK_TRUST
    assert 0 < k < 1
    class _E:
        folder, target_fingerprint, draft_key = "t", "fp", "dk"
    prof = replace(_fake_profile(_E(), pass_s=0.2, draft_s=0.05), target_idle_s=(0.02, 0.01, 0.0, 0.0))
    check = profiler.SpeedCheck(target_now=0.1, target_then=0.2, draft_now=0.0525, draft_then=0.05)
    assert check.moved and check.target == pytest.approx(0.5 ** k) and check.draft == pytest.approx(1.05 ** k)
    assert check.target_ratio == 0.5
    now = profiler.rescaled(prof, check)
    assert now.target_pass_s == pytest.approx([0.2 * 0.5 ** k] * 4)
    assert now.target_idle_s == pytest.approx([0.02 * 0.5 ** k, 0.01 * 0.5 ** k, 0, 0])
    assert now.draft_level_s == pytest.approx([0.05 * 1.05 ** k] * 3)
    assert now.draft_level_greedy_s == pytest.approx([0.05 * 1.05 ** k] * 3)
    assert (now.step_residual_s, now.plain_step_s, now.measured_at) == (prof.step_residual_s, prof.plain_step_s, "now")
    quiet = profiler.SpeedCheck(target_now=0.19, target_then=0.2, draft_now=0.054, draft_then=0.05)
    assert not quiet.moved and quiet.target == pytest.approx(0.95 ** k) and quiet.draft == pytest.approx(1.08 ** k)
    calm = profiler.rescaled(prof, quiet)
    assert calm.target_pass_s == pytest.approx([0.2 * 0.95 ** k] * 4)
    assert calm.draft_level_s == pytest.approx([0.05 * 1.08 ** k] * 3)
    assert profiler.rescaled(prof, profiler.SpeedCheck(None, 0.2, None, 0.05)) == prof  # (nothing read)
    assert f"the profile is rescaled: its target passes {0.5 ** k:.2f}x and draft levels {1.05 ** k:.2f}x" \
        in check.describe()
    untimed = profiler.SpeedCheck(target_now=None, target_then=3.0, draft_now=0.1, draft_then=0.05)
    scaled = profiler.rescaled(prof, untimed)
    assert scaled.target_pass_s == prof.target_pass_s and scaled.draft_level_s == pytest.approx([0.05 * 2 ** k] * 3)
    spike = profiler.SpeedCheck(target_now=2.0, target_then=0.2, draft_now=0.05, draft_then=0.05)
    assert spike.clamped and spike.target == pytest.approx(profiler.CHECK_MAX_SCALE ** k) and spike.draft == 1.0
    # the printed range's share: the part of the move not taken (10x read, 3x ** k applied)
    import math
    assert spike.spell == pytest.approx(math.log(10) - k * math.log(profiler.CHECK_MAX_SCALE))


def test_a_speed_check_splits_the_target_s_move_into_its_compute_and_its_waits():
    """A one-token pass that waits for streamed layers (a quarter of it here) moves with the disk
    as well as with the cores; the draft's level moves with the cores alone. The check splits the
    pass's move: its compute as the draft's, its waits the rest. The disk slower (the pass read
    1.4x, the draft 1.0x): the waits 2.6x, taken half believed, the narrow passes slower, a wide
    one that does not wait as it was (every pass scaled by 1.4 ** k had put the trees' steps 16-22%
    slow on the 2-vCPU machine, 2026-12-07). The cores slower (both 1.4x): every part 1.4x, as one
    ratio did. No waits recorded: one ratio, as before."""
    k = profiler.CHECK_TRUST
    class _E:
        folder, target_fingerprint, draft_key = "t", "fp", "dk"
    prof = replace(_fake_profile(_E(), pass_s=0.2, draft_s=0.05), target_pass_s=(0.2, 0.22, 0.3, 0.4),
                   target_idle_s=(0.05, 0.01, 0.0, 0.0))
    assert profiler._wait_share(prof) == pytest.approx(0.25)
    disk = profiler.SpeedCheck(target_now=0.28, target_then=0.2, draft_now=0.05, draft_then=0.05,
                               wait_share=profiler._wait_share(prof))
    compute, waits = disk.split
    assert compute == pytest.approx(1.0) and waits == pytest.approx(2.6 ** k)
    now = profiler.rescaled(prof, disk)
    assert now.target_pass_s == pytest.approx([0.15 + 0.05 * 2.6 ** k, 0.21 + 0.01 * 2.6 ** k, 0.3, 0.4])
    assert now.target_idle_s == pytest.approx([0.05 * 2.6 ** k, 0.01 * 2.6 ** k, 0.0, 0.0])
    assert now.draft_level_s == prof.draft_level_s
    assert disk.target == pytest.approx(now.target_pass_s[0] / 0.2)  # (the one-token pass's own scale)
    assert "waits for streamed layers" in disk.describe() and disk.as_dict()["target_wait_scale"] == waits
    # (the spell: the part of the one-token reading's move not taken)
    import math
    assert disk.spell == pytest.approx(abs(math.log(1.4) - math.log(disk.target)))
    cores = profiler.SpeedCheck(target_now=0.28, target_then=0.2, draft_now=0.07, draft_then=0.05, wait_share=0.25)
    assert cores.split == pytest.approx((1.4 ** k, 1.4 ** k))
    assert profiler.rescaled(prof, cores).target_pass_s == pytest.approx([p * 1.4 ** k for p in prof.target_pass_s])
    # a split that does not fit (the pass read faster than its compute alone can be: r_waits -1),
    # or waits too small a share to split (the readings' noise times 1 / w): the one ratio
    fast = profiler.SpeedCheck(target_now=0.1, target_then=0.2, draft_now=0.05, draft_then=0.05, wait_share=0.25)
    assert fast.split is None and fast.target == pytest.approx(0.5 ** k)
    small = profiler.SpeedCheck(target_now=0.208, target_then=0.2, draft_now=0.05, draft_then=0.05,
                                wait_share=0.5 * profiler.SPLIT_MIN_SHARE)  # (r_waits 1.8 would fit)
    assert small.split is None and small.target == pytest.approx(1.04 ** k)
    # no waits recorded, or no draft read: the one ratio, as before
    flat = replace(prof, target_idle_s=())
    assert profiler._wait_share(flat) is None
    one = profiler.SpeedCheck(target_now=0.28, target_then=0.2, draft_now=0.05, draft_then=0.05, wait_share=None)
    assert one.split is None and profiler.rescaled(flat, one).target_pass_s == pytest.approx(
        [p * 1.4 ** k for p in prof.target_pass_s])
    nodraft = profiler.SpeedCheck(target_now=0.28, target_then=0.2, draft_now=None, draft_then=None, wait_share=0.25)
    assert nodraft.split is None and nodraft.target == pytest.approx(1.4 ** k)


@pytest.mark.parametrize("first_target", [0.30, None])
def test_the_profile_s_check_readings_are_the_median_of_one_per_round(pair, tmp_path, monkeypatch, first_target):
    """The readings a later speed check is compared with are taken like the profile's passes and
    levels: one in each round of its timed steps and one at its end, the median kept (one reading
    alone read 0.77-1.11x its profile's plain step on the 2-vCPU machine). Here the readings are
    told: every round's and the last, the middle one stored; a reading not taken (None) is left out.
    A target pass the first reading did not take (too long) is not asked for again."""
    from offload_engine import Engine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # (their median is no first nor last one)
    told = iter([(first_target, 0.010), (0.10, None), (0.90, 0.030), (0.20, 0.020), (0.50, 0.050)])
    taken, asked = [], []

    def reading(engine, *a, target=True, **k):
        asked.append(target)
        t, d = next(told)
        taken.append((t if target else None, d))
        return taken[-1]
    monkeypatch.setattr(profiler, "check_readings", reading)
    engine = Engine.load(pair, draft="self-int8", draft_group_size=32, tree="sequoia", tree_budget=4, tree_depth=2,
                         progress=False)
    try:
        prof = profiler.measure(engine, budget_s=8, progress=False)
    finally:
        engine.close()
    assert len(taken) >= 2  # (the steps' rounds, two at most, and the end)
    if first_target is None:
        assert asked == [True] + [False] * (len(asked) - 1) and prof.check_target_s == 0.0
    else:
        assert all(asked) and prof.check_target_s == statistics.median(t for t, _ in taken)
    assert prof.check_draft_s == statistics.median(d for _, d in taken if d is not None)


def test_a_cached_profile_from_another_spell_is_rescaled_to_now_at_load(pair, tmp_path, monkeypatch):
    """A cached profile is timed again when `--tree auto` loads it (`profiler.speed_now`, the
    real jobs run, the clock told what a machine 0.4x as slow as the profile's would read): both
    parts are rescaled, the plan is made from the rescaled timings, the stats say so, output stays
    exact; a reading past CHECK_MAX_SCALE is held there and the line says so; a profile measured
    at this load is not checked."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, first = greedy_past_eos(pair, "Hello", 4, draft="self-int8", tree="auto", offload="disk")
    assert first.speed_check is None  # (measured at this load: nothing to check)
    cached = next(p for p in (tmp_path / "cache" / "sequoia-offload" / "profiles").glob("*.json")
                  if "-target-" not in p.name)
    prof = load_measured(cached)
    assert prof.check_target_s > 0 and prof.check_draft_s > 0  # (recorded when it was measured)
    then = {("target", 1): prof.check_target_s, ("draft", profiler.CHECK_WIDTH, True): prof.check_draft_s}
    real_timed, ran = profiler._timed, []

    def clock(scale):
        def timed(fn, device):
            if getattr(fn, "reading", None) not in then:
                return real_timed(fn, device)
            fn()
            ran.append(fn.reading)
            return scale * then[fn.reading]
        return timed
    monkeypatch.setattr(profiler, "_timed", clock(0.4))
    result, engine = greedy_past_eos(pair, "Hello", 12, draft="self-int8", tree="auto", offload="disk")
    check = engine.speed_check
    k = profiler.CHECK_TRUST
    assert (check.target, check.draft) == (pytest.approx(0.4 ** k), pytest.approx(0.4 ** k)) and not check.clamped
    # (the profile's one-token pass's share of waits, for splitting a move: none for this tiny
    # target, its layers in the page cache, so one ratio)
    assert check.wait_share is not None and check.wait_share == profiler._wait_share(prof)
    assert check.split is None
    # (a move is read twice before it is believed: `speed_now`)
    assert ran.count(("target", 1)) == ran.count(("draft", 16, True)) == 2 * (profiler.CHECK_REPEATS + 1)
    assert check.first == (pytest.approx(0.4 * prof.check_target_s), pytest.approx(0.4 * prof.check_draft_s))
    want = profiler.rescaled(prof, check)
    assert want.target_pass_s == pytest.approx([0.4 ** k * t for t in prof.target_pass_s])
    # the plan made from the rescaled profile, then its trees' parts rescaled by real steps of the
    # chosen tree (`profiler.step_check`: test_real_steps_of_the_chosen_tree_...)
    sc = engine.step_check
    assert sc is not None
    for t, plan in engine.auto_plans.items():
        base = want.timings(greedy=t == 0)
        assert plan.timings == base.scaled(sc.target, sc.draft, base.plain())
    assert result.stats["auto"]["speed_check"]["target_scale"] == pytest.approx(0.4 ** k)
    assert result.token_ids == greedy_past_eos(pair, "Hello", 12)[0].token_ids
    monkeypatch.setattr(profiler, "_timed", clock(0.05))  # a load spike in the other direction: 20x
    _, spiked = greedy_past_eos(pair, "Hello", 2, draft="self-int8", tree="auto", offload="disk")
    assert spiked.speed_check.clamped and spiked.speed_check.target == pytest.approx(profiler.CHECK_MAX_SCALE ** -k)
    assert "held at 3x" in spiked.speed_check.describe()
    # a slow second: the first readings 1.5x, the second ones as the profile's; the second agree
    # with the profile, and nothing is rescaled (the draft's: 1.5x, then 1.3x: taken as 1.3x)
    calls = {}

    def moody(fn, device):
        if getattr(fn, "reading", None) not in then:
            return real_timed(fn, device)
        fn()
        calls[fn.reading] = calls.get(fn.reading, 0) + 1
        first = calls[fn.reading] <= profiler.CHECK_REPEATS + 1
        return then[fn.reading] * (1.5 if first else 1.0 if fn.reading[0] == "target" else 1.3)
    monkeypatch.setattr(profiler, "_timed", moody)
    _, calm = greedy_past_eos(pair, "Hello", 2, draft="self-int8", tree="auto", offload="disk")
    c = calm.speed_check
    assert c.first == (pytest.approx(1.5 * prof.check_target_s), pytest.approx(1.5 * prof.check_draft_s))
    assert c.moved and c.target == pytest.approx(1.0) and c.draft == pytest.approx(1.3 ** k)
    assert "read twice" in c.describe()
    # the printed range's spell: how far two readings of a part disagreed (1.5 against 1.0), or
    # the part of the move not taken (0.4x read twice, (1 - CHECK_TRUST) of it left)
    import math
    assert c.spell == pytest.approx(math.log(1.5)) and check.spell == pytest.approx((1 - k) * -math.log(0.4))
    assert all(plan.spell == pytest.approx(math.log(1.5)) for plan in calm.auto_plans.values())
    calls.clear()
    monkeypatch.setattr(profiler, "_timed", lambda fn, device: (
        real_timed(fn, device) if getattr(fn, "reading", None) not in then else (fn(), then[fn.reading] * 1.1)[1]))
    _, quiet = greedy_past_eos(pair, "Hello", 2, draft="self-int8", tree="auto", offload="disk")
    assert quiet.speed_check.first is None and not quiet.speed_check.moved  # (within 20%: read once)
    # rescaled half the way, 10% off: the rest stays in the prediction, and the range says so
    assert quiet.speed_check.target == pytest.approx(1.1 ** k)
    assert quiet.speed_check.spell == pytest.approx((1 - k) * math.log(1.1))
    assert quiet.auto_plans[0.0].spell == pytest.approx((1 - k) * math.log(1.1))


def test_real_steps_of_the_chosen_tree_are_timed_at_load_and_rescale_its_parts(pair, tmp_path, monkeypatch):
    """`profiler.step_check`: a cached profile whose step model prices the draft's levels at a
    third of their cost (a draft factor fitted, as on 2026-12-07, to levels timed in a slow spell), while
    its speed check's readings agree with the machine: the check's readings cannot see it, real
    steps of the chosen tree can. Timed at load, they read the draft at 2.5-3.3x the model (at least
    1.6x asked: the median of three steps of about 14 ms; 1.8x measured with it halved),
    every plan's trees are rescaled part by part by the ratios to the power STEP_CHECK_TRUST (plain
    decoding's step kept), the checked tree's predicted step moves toward what the steps took,
    the stats carry the check, and output stays exact. A profile measured at this load is checked
    too; no step is timed where the chosen tree's step is predicted over STEP_CHECK_MAX_S."""
    import math
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, first = greedy_past_eos(pair, "Hello", 4, draft="self-int8", tree="auto", offload="disk")
    assert first.speed_check is None  # (measured at this load; where a tree pays, step-checked: below)
    assert first.step_check is not None or all(p.choice.budget == 1 for p in first.auto_plans.values())
    cached = next(p for p in (tmp_path / "cache" / "sequoia-offload" / "profiles").glob("*.json")
                  if "-target-" not in p.name)
    prof = load_measured(cached)
    cached.write_text(replace(prof, draft_factor=prof.draft_factor / 3,
                              draft_factor_greedy=prof.draft_factor_greedy / 3).to_json())
    plain = greedy_past_eos(pair, "Hello", 12)[0].token_ids
    result, engine = greedy_past_eos(pair, "Hello", 12, draft="self-int8", tree="auto", offload="disk")
    sc, check = engine.step_check, engine.speed_check
    assert sc is not None and check is not None and len(sc.measured_s) == profiler.STEP_CHECK_STEPS
    assert sc.draft_ratio > 1.6, sc
    k = profiler.STEP_CHECK_TRUST
    held = profiler._held  # (each ratio held within CHECK_MAX_SCALE first: a third of the draft can read over 3x)
    assert (sc.target, sc.draft) == (pytest.approx(held(sc.target_ratio) ** k), pytest.approx(held(sc.draft_ratio) ** k))
    halved = profiler.rescaled(load_measured(cached), check)
    for t, plan in engine.auto_plans.items():
        base = halved.timings(greedy=t == 0)
        assert plan.timings == base.scaled(sc.target, sc.draft, base.plain())
        assert plan.plain_seconds_per_token == pytest.approx(base.plain())
    checked = engine.auto_plans[0.0 if sc.greedy else 0.6]
    now = checked.candidates.choice(sc.budget, sc.depth, checked.timings, checked.length).seconds_per_step
    measured = statistics.median(sc.measured_s)
    assert abs(math.log(now / measured)) < abs(math.log(sc.predicted_s / measured))
    stats = result.stats["auto"]["step_check"]
    assert stats["draft_ratio"] == pytest.approx(sc.draft_ratio) and stats["measured_step_s"] == list(sc.measured_s)
    assert "step check: 3 real" in sc.describe()
    assert result.token_ids == plain
    # a profile measured at this load is step-checked too (the measurement stood in for by the
    # doctored profile, whose trees pay: a fresh one of a busy machine may choose plain decoding)
    doctored = load_measured(cached)
    cached.unlink()
    monkeypatch.setattr(profiler, "measure", lambda engine, *a, **k: doctored)
    _, fresh = greedy_past_eos(pair, "Hello", 2, draft="self-int8", tree="auto", offload="disk")
    assert fresh.speed_check is None and fresh.step_check is not None and fresh.step_check.draft_ratio > 1.6
    monkeypatch.setattr(profiler, "STEP_CHECK_MAX_S", 1e-9)  # (every tree's step is predicted over it)
    _, unchecked = greedy_past_eos(pair, "Hello", 2, draft="self-int8", tree="auto", offload="disk")
    assert unchecked.step_check is None
    halved = profiler.rescaled(load_measured(cached), unchecked.speed_check)
    assert all(plan.timings == halved.timings(greedy=t == 0) for t, plan in unchecked.auto_plans.items())


@pytest.mark.parametrize("error,spell", [(0.0, 0.0), (0.06, 0.0), (0.03, 0.12)])
def test_the_printed_range_holds_eight_in_ten_simulated_answers(error, spell):
    """`speedup_spread`: answers of 67 tokens, each its steps drawn from the chosen tree's own
    step tokens and its measured step and plain times each off by a normal error whose mean
    absolute value is the profile's cross-validated `error`, and the ratio by the machine's
    `spell` (a log-sigma) besides: of 40,000 simulated answers, 10% fall
    below the range and 10% above (within 0.012: a binomial's standard error is 0.0015 here; with
    error 0 the steps are whole numbers and each tail is at most 10%, and more than 3% (the
    range is the tightest that holds 80%)."""
    import math
    import numpy as np
    from offload_engine.planning.auto_tree import speedup_spread
    from sequoia_trees.acceptance import AcceptanceVector
    from sequoia_trees.dp import TreeTable
    from sequoia_trees.optimizer import Candidates, Timings
    vector = AcceptanceVector((0.8, 0.1, 0.04))
    cands = Candidates(vector, [8, 16, 32], 16, TreeTable(vector, 32, 16))
    timings = Timings((1, 16, 32), (0.1, 0.12, 0.13), (1, 16), (0.02, 0.03))
    length = 66
    choice = cands.best(timings, length=length)
    assert choice.budget > 1
    low, high = speedup_spread(cands, choice, timings.plain(), length, error, spell=spell)
    pmf = cands.step_tokens(choice.budget, choice.depth)
    rng = np.random.default_rng(11)
    runs = 40000
    steps, left = np.zeros(runs), np.full(runs, length)
    while (left > 0).any():
        live = left > 0
        left[live] -= rng.choice(len(pmf), size=live.sum(), p=pmf)
        steps[live] += 1
    sd = error * math.sqrt(math.pi / 2)  # a normal error of mean absolute value `error`
    tree_s = choice.seconds_per_step * np.exp(rng.normal(0, sd, runs))
    plain_s = timings.plain() * np.exp(rng.normal(0, sd, runs))
    # (and the machine's wander from the profile: a log-normal factor of sigma `spell` on the ratio)
    measured = plain_s * length / (steps * tree_s) * np.exp(rng.normal(0, spell, runs))
    below, above = (measured < low * (1 - 1e-9)).mean(), (measured > high * (1 + 1e-9)).mean()
    if error or spell:
        assert abs(below - 0.1) < 0.012 and abs(above - 0.1) < 0.012, (below, above, low, high)
    else:
        assert 0.03 < below <= 0.1 + 0.006 and 0.03 < above <= 0.1 + 0.006, (below, above, low, high)
    assert low < timings.plain() / choice.seconds_per_token < high
    # plain decoding and long answers have no range
    assert speedup_spread(cands, cands.choice(1, 1, timings), timings.plain(), length, error) is None
    assert speedup_spread(cands, choice, timings.plain(), None, error) is None


def _line_curve(n: int) -> float:
    return 0.01 + 0.0005 * n


def test_a_pass_off_its_neighbours_line_is_timed_again_with_them(monkeypatch):
    """`retime_bumps`: a median 1.5x off the line through its neighbours' (a slow spell of its
    own) is timed again back to back with them, each round in a spell of its own (1x to 2x for
    the three timings of a round, each besides off by up to 2% of its own), and comes back to the
    curve (within 8%, the jitter's worst case): the spells cancel in the ratio, as they did not in
    a median. A shape of the pass's own (here the 2-token pass, 1.3x its neighbours' line;
    1.04-1.44x on the 2-vCPU machine) is re-timed and kept, and so is the 4-token one that it puts
    0.85x below the line through it; a pass off its line by less than 1 + BUMP_TOLERANCE (here
    1.1x), or one taking long_s, is not timed again."""
    import random
    rng = random.Random(0)
    true = {n: _line_curve(n) * (1.3 if n == 2 else 1.0) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    true[512] = 2.0  # (a pass of seconds: timed once, never again)
    medians = dict(true)
    medians[64] *= 1.5
    medians[16] *= 1.1  # (within the tolerance)
    medians[512] *= 1.5
    spell, timed = [1.0], []

    def clock(fn, device):
        if len(timed) % 3 == 0:
            spell[0] = rng.uniform(1.0, 2.0)
        timed.append(fn.width)
        return true[fn.width] * spell[0] * rng.uniform(0.98, 1.02)

    class Job:
        def __init__(self, n):
            self.width = n
    monkeypatch.setattr(profiler, "_timed", clock)
    before = profiler.retime_bumps({n: Job(n) for n in true}, medians, None)
    assert before == {64: pytest.approx(1.5 * true[64]), 2: pytest.approx(true[2]), 4: pytest.approx(true[4])}
    assert [medians[n] for n in (2, 4, 64)] == pytest.approx([true[n] for n in (2, 4, 64)], rel=0.08)
    assert medians[16] == pytest.approx(1.1 * true[16]) and medians[512] == 3.0  # (left as they were)
    assert all(medians[n] == true[n] for n in true if n not in (2, 4, 16, 64, 512))
    # the farthest off first, each with its neighbours, BUMP_ROUNDS rounds
    assert timed == [32, 64, 128] * profiler.BUMP_ROUNDS + [1, 2, 4] * profiler.BUMP_ROUNDS + [2, 4, 8] * profiler.BUMP_ROUNDS
    timed.clear()
    on_line = {n: _line_curve(n) for n in true}
    assert profiler.retime_bumps({n: Job(n) for n in true}, on_line, None) == {} and timed == []
    assert profiler.retime_bumps({n: Job(n) for n in true}, medians, None, deadline=0.0) == {}


def test_the_profile_retimes_a_pass_slow_in_its_rounds_and_says_so(pair, tmp_path, monkeypatch, capsys):
    """Wired into `measure`: a 16-token pass slow (1.6x) in every timing of the passes' rounds and
    not when timed again beside its neighbours is stored as the curve has it, before the step model
    is fitted to the passes; the profile records it and `profile` prints it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_timed, real_retime = profiler._timed, profiler.retime_bumps
    calm = []

    def clock(fn, device):
        reading = getattr(fn, "reading", None)
        if not reading or reading[0] != "target":
            return real_timed(fn, device)
        fn()
        return _line_curve(reading[1]) * (1.6 if reading[1] == 16 and not calm else 1.0)

    def retime(*a, **k):
        calm.append(True)
        return real_retime(*a, **k)
    fitted = []
    real_fit = profiler.fit_step_model
    monkeypatch.setattr(profiler, "fit_step_model", lambda *a: fitted.append(a[2]) or real_fit(*a))
    monkeypatch.setattr(profiler, "_timed", clock)
    monkeypatch.setattr(profiler, "retime_bumps", retime)
    out = tmp_path / "p.json"
    assert main(["profile", "--target", str(pair), "--device", "cpu", "--draft", "self-int8", "--offload", "disk",
                 "--budget-s", "10", "--out", str(out)]) == 0
    prof = load_measured(out)
    assert 16 in prof.target_tokens[1:-1]
    assert prof.target_pass_s == pytest.approx([_line_curve(n) for n in prof.target_tokens])
    assert prof.target_retimed == (16,) and prof.target_retimed_from_s == pytest.approx((1.6 * _line_curve(16),))
    assert all(f.target_seconds == pytest.approx(tuple(_line_curve(n) for n in prof.target_tokens)) for f in fitted)
    assert "the 16-token pass's median (0.0288 s) was over 1.15x off the line" in capsys.readouterr().out
