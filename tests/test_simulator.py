"""The simulator: presets parse like checkpoints' configs, the modelled pass time is the copy
time when streaming dominates (computed here by hand from the shapes), and its answers move the
right way with RAM, precision and bandwidth."""

import json

import pytest

from offload_engine.apps.cli import main
from offload_engine.errors import UserError
from offload_engine.planning import simulator
from offload_engine.planning.hw_profile import load_gpu_spec, load_model_shape, model_names

GIB = 2**30


def test_every_preset_parses_and_has_its_published_shape():
    names = set(model_names())
    assert {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-8b", "llama-3.1-70b",
            "llama-3.2-1b", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "smollm2-135m"} <= names
    for name in names:
        shape, cfg = load_model_shape(name)
        assert cfg.num_layers > 0 and cfg.vocab_size > 0, name
    _, cfg = load_model_shape("llama-2-70b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size) == (8192, 28672, 80, 64, 8, 32000)
    with pytest.raises(UserError, match="no such preset"):
        load_model_shape("llama-9-1t")


def test_streamed_pass_is_the_copy_time_when_every_layer_streams():
    # Llama-2-70B fp16, every layer from pinned RAM on an L40: per layer q,o 8192^2, k,v 1024x8192,
    # gate/up/down 8192x28672, two norms of 8192, 2 bytes each
    per_layer = (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672 + 2 * 8192) * 2
    assert simulator.layer_bytes(load_model_shape("llama-2-70b")[1], "fp16") == per_layer
    gpu = load_gpu_spec("l40")
    sim = simulator.simulate("l40", 512 * GIB, "llama-2-70b", "llama-2-7b", offload="ram")
    assert len(sim.plan.ram_layers) == 80 and not sim.plan.resident_layers and not sim.plan.disk_layers
    copy = 80 * per_layer / (gpu.h2d_pinned_gb_per_s * 1e9)
    assert sim.timings.target_seconds[0] == pytest.approx(copy, rel=0.01)  # the head adds well under 1%
    # flat while the copy dominates: 1024 tokens cost little more than one
    assert sim.timings.target_seconds[-1] < 1.02 * sim.timings.target_seconds[0]
    assert sim.choice.budget >= 256 and sim.speedup > 3


def test_answers_move_the_right_way():
    base = simulator.simulate("rtx4090", 64 * GIB, "llama-2-70b", "llama-2-7b")
    more_ram = simulator.simulate("rtx4090", 192 * GIB, "llama-2-70b", "llama-2-7b")
    int4 = simulator.simulate("rtx4090", 64 * GIB, "llama-2-70b", "llama-2-7b", precision="int4")
    assert base.plan.disk_layers and not more_ram.plan.disk_layers  # 64 GiB cannot hold 138 GB
    assert more_ram.plain_seconds_per_token < base.plain_seconds_per_token
    assert int4.plan.bytes_per_pass < 0.3 * base.plan.bytes_per_pass
    assert int4.plain_seconds_per_token < more_ram.plain_seconds_per_token
    for sim in (base, more_ram, int4):
        assert sim.choice.seconds_per_token < sim.plain_seconds_per_token
    no_draft = simulator.simulate("rtx4090", 192 * GIB, "llama-2-70b", None)
    assert no_draft.choice.budget == 1 and no_draft.speedup == pytest.approx(1.0)
    with pytest.raises(UserError, match="vocabulary"):
        simulator.simulate("rtx4090", 192 * GIB, "llama-2-70b", "llama-3-8b")


def test_fixed_tree_with_published_tokens_per_step():
    sim = simulator.simulate("l40", 512 * GIB, "llama-2-70b", "llama-2-7b", offload="ram", tree=(768, 18),
                             tokens_per_step=10.30)
    assert (sim.choice.budget, sim.choice.depth, sim.choice.tokens_per_step) == (768, 18, 10.30)
    # the step: one target pass over 768 tokens, then one draft pass per level of the tree
    # (the level widths counted here from the tree's depths), plus the assumed 1 ms
    gpu, a = load_gpu_spec("l40"), simulator.Assumptions()
    _, cfg = load_model_shape("llama-2-70b")
    _, dcfg = load_model_shape("llama-2-7b")
    widths = [sim.choice.tree.depths.count(level) for level in range(18)]
    assert sum(widths) == 768 and widths[0] == 1
    draft = sum(simulator.draft_level_s(dcfg, "fp16", w, gpu, a) for w in widths)
    step = simulator.target_pass_s(cfg, sim.plan, "fp16", 768, gpu, a) + draft + 1e-3
    assert sim.choice.seconds_per_step == pytest.approx(step, rel=0.02)  # level times interpolated
    assert sim.choice.seconds_per_token == pytest.approx(sim.choice.seconds_per_step / 10.30)


def test_cli_json_and_errors(capsys):
    assert main(["simulate", "--gpu", "rtx4090", "--ram", "64GiB", "--model", "llama-2-70b", "--draft",
                 "llama-2-7b", "--precision", "int4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("plan", "tree", "tokens_per_step", "seconds_per_token", "plain_seconds_per_token", "speedup"):
        assert key in out
    assert out["setting"]["precision"] == "int4" and out["speedup"] > 1
    assert main(["simulate", "--gpu", "gtx480"]) == 2
    assert "no such profile" in capsys.readouterr().err
    for bad, message in ((["--tree", "768"], "N,D"), (["--tree", "2048,20"], "2..1024 nodes"),
                         (["--tree", "768,18", "--tokens-per-step", "0"], "makes 1..768 tokens"),
                         (["--tokens-per-step", "3"], "needs --tree"), (["--max-budget", "0"], "must be >= 1"),
                         (["--draft", "none", "--tree", "64,8"], "need a draft"),
                         (["--profile", "x.json"], "one of --gpu")):
        assert main(["simulate", "--gpu", "l40", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (bad, err)
    assert main(["simulate", "--gpu", "rtx3090", "--ram", "256GiB", "--draft", "none", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)  # strict JSON: no Infinity
    assert plain["tree"]["budget"] == 1 and plain["speedup"] == pytest.approx(1.0)


def test_gguf_precisions_use_their_real_bits_and_pay_their_dequantization():
    """--precision q4_k and friends: layer bytes at the format's bits per weight (norms fp16), a
    pass that moves those bytes, and each layer's dequantization counted in its compute."""
    from offload_engine.formats.gguf_blocks import bits_per_weight
    from offload_engine.planning.hw_profile import load_gpu_spec, load_model_shape
    _, cfg = load_model_shape("llama-3.1-70b")
    fp16 = simulator.layer_bytes(cfg, "fp16")
    for fmt in ("q8_0", "q4_0", "q4_k", "q6_k"):
        ratio = simulator.layer_bytes(cfg, fmt) / fp16
        assert abs(ratio - bits_per_weight(fmt.upper()) / 16) < 1e-3, (fmt, ratio)
    gpu = load_gpu_spec("rtx4090")
    assert simulator.dequant_s(cfg, "q4_k", gpu) > 0 == simulator.dequant_s(cfg, "fp16", gpu)
    runs = {p: simulator.simulate("rtx4090", 64 * GIB, "llama-3.1-70b", None, precision=p) for p in ("q8_0", "q4_k")}
    # the plan reserves what the runtime's would: a dense layer per buffer to dequantize into
    assert runs["q4_k"].plan.fixed_bytes["dequant scratch"] == 2 * 2 * simulator.layer_params(cfg)
    assert runs["q4_k"].plan.bytes_per_pass < 0.6 * runs["q8_0"].plan.bytes_per_pass
    assert runs["q4_k"].plain_seconds_per_token < runs["q8_0"].plain_seconds_per_token
    # a draft kept in q8_0 blocks is counted at its block size and pays dequantization per level
    a = simulator.simulate("rtx4090", 64 * GIB, "llama-3.1-70b", "llama-3.2-1b", precision="q4_k")
    b = simulator.simulate("rtx4090", 64 * GIB, "llama-3.1-70b", "llama-3.2-1b", precision="q4_k",
                           draft_precision="q8_0")
    assert b.plan.fixed_bytes["draft"] < 0.7 * a.plan.fixed_bytes["draft"]  # its embeddings stay fp16
    assert b.timings.draft_seconds[0] > a.timings.draft_seconds[0]


def test_substitute_self_drafts_count_a_copy_per_streamed_layer_and_say_when_they_do_not_fit():
    """--draft self-q4: no draft model, an int4 copy of each streamed layer on the device, the
    resident layers chosen with both counted; on a 24 GB card a 70B's substitutes alone do not
    fit, and the error names them."""
    sim = simulator.simulate("l40", 192 * 2**30, "llama-3.1-70b", "self-q4")
    plan, cfg = sim.plan, load_model_shape("llama-3.1-70b")[1]
    streamed = cfg.num_layers - len(plan.resident_layers)
    sub = simulator.layer_bytes(cfg, "int4")
    assert plan.fixed_bytes[f"draft substitutes ({streamed} streamed layers)"] == streamed * sub
    assert "draft" not in plan.fixed_bytes and plan.vram_bytes <= plan.vram_budget_bytes
    # one more resident layer would not fit: it costs its fp16 bytes and saves only its substitute
    assert plan.vram_bytes + simulator.layer_bytes(cfg, "fp16") - sub > plan.vram_budget_bytes
    # a level: resident layers at fp16, the others at the substitute's bytes (memory-bound at w=1)
    gpu, a = load_gpu_spec("l40"), simulator.Assumptions()
    fp16_all = simulator.draft_level_s(cfg, "fp16", 1, gpu, a)
    assert sim.timings.draft_seconds[0] < 0.5 * fp16_all
    with pytest.raises(UserError, match=r"draft substitutes \(every layer\) 63\.76 GiB"):  # int8: 48 GB is short
        simulator.simulate("l40", 192 * 2**30, "llama-3.1-70b", "self-q8")
    q4, q8 = (simulator.simulate("h100-pcie", 192 * 2**30, "llama-3.1-70b", d) for d in ("self-q4", "self-q8"))
    assert len(q4.plan.resident_layers) > len(q8.plan.resident_layers)  # smaller copies leave more room
    with pytest.raises(UserError, match=r"draft substitutes \(every layer\) 35\.86 GiB"):
        simulator.simulate("rtx4090", 192 * 2**30, "llama-3.1-70b", "self-q4")


def test_the_substitute_draft_grows_the_next_tree_in_the_pass_waits():
    """simulate --draft self-q4: the idle time of a pass is every streamed layer's copy less its
    compute (but the last two layers', where the engine grows nothing); the share used is the
    probability that a step ends as one of the cases grown; the step pays the draft work less
    what was overlapped, and --overlap off pays it all."""
    from offload_engine.runtime.streamer import IDLE_TAIL_LAYERS
    on = simulator.simulate("l40", 192 * 2**30, "llama-3.1-70b", "self-q4")
    off = simulator.simulate("l40", 192 * 2**30, "llama-3.1-70b", "self-q4", overlap="off", tree=(on.choice.budget,
                                                                                               on.choice.depth))
    cfg, gpu, a = load_model_shape("llama-3.1-70b")[1], load_gpu_spec("l40"), simulator.Assumptions()
    compute, ram_copy, _ = simulator._layer_s(cfg, "fp16", 1, gpu, a)
    waits = sum(1 for i in on.plan.ram_layers if i < cfg.num_layers - IDLE_TAIL_LAYERS) * (ram_copy - compute)
    assert on.plan.ram_layers and not on.plan.disk_layers
    assert on.timings.idle(1) == pytest.approx(waits)
    assert on.timings.overlap_use == pytest.approx(simulator.overlap_use(on.choice.tree, on.acceptance))
    assert 0 < on.timings.overlap_use < 1 and not off.timings.overlap_use
    c = on.choice
    assert c.overlap_seconds == pytest.approx(on.timings.overlap_use * min(c.draft_seconds, on.timings.idle(c.budget)))
    assert c.seconds_per_step == pytest.approx(off.choice.seconds_per_step - c.overlap_seconds)
    assert "overlap:" in on.report() and "overlap:" not in off.report()
    # a separate draft model is not grown ahead unless asked
    assert not simulator.simulate("l40", 192 * 2**30, "llama-3.1-70b", "llama-3.1-8b").timings.overlap_use


def test_the_hit_probability_of_the_cases_grown_ahead():
    """A root with two children, p = (0.6, 0.2): the cases (end node, bonus guess) are the root
    with a third or fourth choice (each half of the 0.2 the vector leaves), the first child with
    its first or second choice (0.6 x 0.6, 0.6 x 0.2) and the second child's (0.2 x 0.6, 0.2 x 0.2):
    worked by hand, the four likeliest sum to 0.36 + 0.12 + 0.12 + 0.1."""
    from sequoia_trees.acceptance import AcceptanceVector
    from sequoia_trees.tree import TreePlan, ahead_hit_probability, end_probabilities
    tree = TreePlan((-1, 0, 0), (0, 1, 1), (0, 0, 1), 1.8)
    vec = AcceptanceVector((0.6, 0.2))
    ends = end_probabilities(tree.parents, tree.ranks, vec, 2)
    assert [x for row in ends for x in row] == pytest.approx([0.1, 0.1, 0.36, 0.12, 0.12, 0.04])
    assert ahead_hit_probability(tree, vec, 4, 2) == pytest.approx(0.70)
    assert ahead_hit_probability(tree, vec, 1, 2) == pytest.approx(0.36)
