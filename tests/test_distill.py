"""`distill`: training reduces the KL, `--resume` reproduces an uninterrupted run exactly, an
interrupted run never leaves a folder that loads as a draft, and the result is a usable draft."""

import json

import pytest
import torch
from safetensors.torch import load_file

from offload_engine import Engine, UserError
from offload_engine.apps.cli import main
from offload_engine.apps.distill import DistillOptions, distill, generate_batch, load_teacher, work_dir
from offload_engine.formats.checkpoint import Checkpoint
from offload_engine.formats.config import load_config
from offload_engine.formats.tokenizer import Tokenizer
from offload_engine.runtime.model import Transformer
from tiny_models import greedy_past_eos, make_tiny_checkpoint

PROMPTS = ["Hello, how are you?", "What is the capital of France?", "Write add(a, b) in Python.",
           "Count from 1 to 10.", "Tell me about speculative decoding.", "Numbers: 3.14159",
           "The capital of Italy is", "def add(a, b):"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = make_tiny_checkpoint(root / "target", "smollm-tied", layers=3, init_std=0.3, seed=5)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS))
    return root, target, prompts


def _opts(prompts, **kw):
    base = dict(layers=1, tokens=1200, gen_tokens=400, max_answer_tokens=24, prompts=str(prompts), batch_size=2,
                gen_batch=4, val_sequences=3, eval_every=4, save_every=3, lr=3e-3, save_dtype="float32")
    return DistillOptions(**{**base, **kw})


def test_batched_generation_equals_one_at_a_time(setup):
    """Left padding and the batch cache must not change what the target says (greedy)."""
    root, target, prompts = setup
    model, teacher_engine = load_teacher(target, DistillOptions(offload="none"), progress=False)
    tok = Tokenizer.from_folder(target)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    assert len({len(i) for i in ids}) > 1  # different lengths: padding is exercised
    batch = generate_batch(model, ids, 12, [0.0] * 4, set(), torch.Generator())
    teacher_engine.close()
    engine = Engine.load(target, progress=False)
    engine.eos_token_ids = frozenset()
    for prompt, got in zip(ids, batch):
        assert got == engine.generate(input_ids=prompt, max_new_tokens=12).token_ids


def test_training_reduces_kl_and_writes_a_loadable_draft(setup, tmp_path):
    root, target, prompts = setup
    out = distill(target, tmp_path / "draft", _opts(prompts), progress=False)
    report = json.loads((out / "distill.json").read_text())
    curve = report["learning_curve"]
    assert curve[0]["tokens"] == 0 and curve[-1]["tokens"] >= 1200
    # the training loss falls by half between the first and the last evaluation interval, and the
    # held-out KL falls too (less: 4 held-out answers of a random model are hard to generalise to)
    assert curve[-1]["train_kl"] < 0.5 * curve[1]["train_kl"]
    assert curve[-1]["kl"] < curve[0]["kl"]
    assert not work_dir(out).exists()
    cfg = load_config(out)
    assert cfg.num_layers == 1 and cfg.vocab_size == load_config(target).vocab_size
    # the embeddings stayed the target's (frozen); the layer moved away from its copy of layer 0
    got, want = load_file(str(out / "model.safetensors")), load_file(str(target / "model.safetensors"))
    assert torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])
    assert not torch.equal(got["model.layers.0.mlp.up_proj.weight"], want["model.layers.0.mlp.up_proj.weight"])
    # usable as a draft: greedy speculation still gives exactly the target's tokens
    spec = greedy_past_eos(target, "Hello", 24, tree="sequoia", draft=out, tree_budget=16, tree_depth=4)[0]
    assert spec.token_ids == greedy_past_eos(target, "Hello", 24)[0].token_ids


def test_resume_gives_the_uninterrupted_result(setup, tmp_path):
    root, target, prompts = setup
    full = distill(target, tmp_path / "full", _opts(prompts), progress=False)
    part = tmp_path / "part"
    assert distill(target, part, _opts(prompts), progress=False, stop_after_steps=5) is None
    # interrupted: nothing at --out, and the work folder does not load as a draft
    assert not part.exists() and work_dir(part).exists()
    with pytest.raises(UserError):
        Engine.load(target, tree="sequoia", draft=work_dir(part), progress=False)
    with pytest.raises(UserError, match="--resume"):
        distill(target, part, _opts(prompts), progress=False)
    # resuming ignores new options: the run's own are kept
    done = distill(target, part, _opts(prompts, lr=1.0), resume=True, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(done / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ra, rb = (json.loads((p / "distill.json").read_text()) for p in (full, done))
    assert ra["learning_curve"] == rb["learning_curve"]


def test_resume_never_deletes_a_run_for_someone_elses_out(setup, tmp_path):
    """--out holding anything but the run's own finished student (a user's file, another model)
    is refused, and the interrupted run is kept."""
    root, target, prompts = setup
    part = tmp_path / "part"
    assert distill(target, part, _opts(prompts), progress=False, stop_after_steps=2) is None
    part.mkdir()
    (part / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        distill(target, part, _opts(prompts), resume=True, progress=False)
    assert (work_dir(part) / "options.json").exists() and (part / "notes.txt").exists()


def test_streamed_teacher_gives_the_same_draft(setup, tmp_path, monkeypatch):
    """A target too big for the device teaches with its layers streamed from disk: same draft,
    bit for bit (streamed passes equal resident ones)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root, target, prompts = setup
    opts = dict(tokens=300, gen_tokens=100, eval_every=100)
    a = distill(target, tmp_path / "resident", _opts(prompts, offload="none", **opts), progress=False)
    b = distill(target, tmp_path / "streamed", _opts(prompts, offload="disk", **opts), progress=False)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


@pytest.mark.parametrize("how", ["crash", "ctrl-c"])
def test_resume_after_a_crash_or_ctrl_c(setup, tmp_path, monkeypatch, how):
    """A crash mid-step (the process dies: the last periodic save, step 3, is what remains) and a
    Ctrl-C mid-step (noted, acted on after the step and its save) both resume to the exact
    uninterrupted result."""
    import os
    import signal

    import offload_engine.apps.distill as d
    root, target, prompts = setup
    full = distill(target, tmp_path / "full", _opts(prompts), progress=False)
    real, calls = d.kl_loss, {"n": 0}

    def failing(*a, **kw):
        calls["n"] += torch.is_grad_enabled()  # training steps only, not evaluations
        if calls["n"] == 5 and torch.is_grad_enabled():
            if how == "crash":
                raise RuntimeError("the process died here")
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of step 5
        return real(*a, **kw)

    monkeypatch.setattr(d, "kl_loss", failing)
    with pytest.raises(RuntimeError if how == "crash" else KeyboardInterrupt):
        distill(target, tmp_path / "x", _opts(prompts), progress=False)
    from safetensors import safe_open
    with safe_open(str(work_dir(tmp_path / "x") / "state.safetensors"), "pt") as f:
        saved_step = json.loads(f.metadata()["progress"])["step"]
    assert saved_step == (3 if how == "crash" else 5)
    monkeypatch.setattr(d, "kl_loss", real)
    done = distill(target, tmp_path / "x", _opts(prompts), resume=True, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(done / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_during_generation(setup, tmp_path, monkeypatch):
    """An interruption while the target is still answering keeps the answers written so far."""
    import offload_engine.apps.distill as d
    root, target, prompts = setup
    calls = {"n": 0}
    real = d.generate_batch

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(d, "generate_batch", flaky)
    with pytest.raises(KeyboardInterrupt):
        distill(target, tmp_path / "g", _opts(prompts), progress=False)
    saved = json.loads((work_dir(tmp_path / "g") / "data.json").read_text())
    assert saved["next_prompt"] == 4 and not saved["done"] and not (tmp_path / "g").exists()
    monkeypatch.setattr(d, "generate_batch", real)
    resumed = distill(target, tmp_path / "g", _opts(prompts), resume=True, progress=False)
    straight = distill(target, tmp_path / "h", _opts(prompts), progress=False)
    a, b = load_file(str(resumed / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_cli_refusals(setup, tmp_path, capsys):
    root, target, prompts = setup
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "busy")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "new"), "--resume"]) == 2
    assert "no interrupted run" in capsys.readouterr().err
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "n2"), "--init-layers", "0,x"]) == 2
    assert "--init-layers" in capsys.readouterr().err
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "n3"), "--layers", "2",
                 "--init-layers", "0,7", "--prompts", str(prompts), "--tokens", "10"]) == 2
    assert "--init-layers 0,7" in capsys.readouterr().err
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "n4"), "--batch-size", "0"]) == 2
    assert "--batch-size must be > 0" in capsys.readouterr().err
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "n5"), "--vram", "1KiB",
                 "--device", "cpu"]) == 2
    assert "training needs about" in capsys.readouterr().err
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())  # refusals leave nothing behind


def test_smaller_hidden_size_trains_everything(setup, tmp_path):
    root, target, prompts = setup
    out = distill(target, tmp_path / "narrow", _opts(prompts, hidden=32, tokens=900, eval_every=3), progress=False)
    cfg = load_config(out)
    assert cfg.hidden_size == 32 and cfg.head_dim == load_config(target).head_dim
    report = json.loads((out / "distill.json").read_text())
    assert report["learning_curve"][-1]["train_kl"] < report["learning_curve"][1]["train_kl"]
    ckpt = Checkpoint(out, cfg)
    ckpt.check()
    Transformer.from_checkpoint(ckpt, torch.float32)
    ckpt.close()


def test_default_draft_rebuilt_from_committed_layers(setup, tmp_path, monkeypatch):
    """The committed form (layers without the target's embeddings) rebuilds the distilled folder:
    exactly when stored as is; with int8 or int4 matrices, each weight within quant's bound for
    the scheme (plus the float16 rounding of int4's scale and minimum, and the bfloat16 rounding
    of the result), norms exact. It refuses another target and loads as --draft default."""
    from offload_engine.runtime.quant import error_bound
    import offload_engine.speculation.drafts as drafts
    root, target, prompts = setup
    out = distill(target, tmp_path / "d", _opts(prompts, tokens=200, save_dtype="bfloat16"), progress=False)
    a = load_file(str(out / "model.safetensors"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    sizes = {}
    for weights in ("same", "int8", "int4"):
        packed = tmp_path / f"committed-{weights}"
        drafts.pack_default_draft(out, packed, weights=weights)
        stored = load_file(str(packed / drafts.LAYERS_FILE))
        sizes[weights] = (packed / drafts.LAYERS_FILE).stat().st_size
        assert "model.embed_tokens.weight" not in stored
        monkeypatch.setattr(drafts, "DEFAULT_DRAFT", packed)
        rebuilt = drafts.default_draft_dir(target, progress=False)
        b = load_file(str(rebuilt / "model.safetensors"))
        assert a.keys() == b.keys() and all(b[n].dtype == a[n].dtype for n in a)
        if weights == "same":
            assert all(torch.equal(a[n], b[n]) for n in a)
            continue
        matrices = [n for n in a if a[n].dim() == 2 and n != "model.embed_tokens.weight"]
        suffix = drafts.Q8_SUFFIX if weights == "int8" else drafts.Q4_SUFFIX
        assert matrices and all(stored[n + suffix].dtype == (torch.int8 if weights == "int8" else torch.uint8)
                                for n in matrices)
        for n in a:
            if n in matrices:
                w = a[n].float()
                slack = error_bound(w, weights, 64) + w.abs().amax(1, keepdim=True) * 2 ** -8  # bf16 rounding
                if weights == "int4":  # float16 scale and minimum: 15 x scale (the group's range) and |min|
                    slack = slack + 2 * error_bound(w, "int4", 64) * 15 * 2 ** -11 + w.abs().amax(1, keepdim=True) * 2 ** -11
                err = (b[n].float() - w).abs()
                assert (err <= slack).all(), n
                assert err.max() > 0  # it really was quantised
            else:
                assert torch.equal(a[n], b[n]), n
    assert sizes["int4"] < 0.6 * sizes["int8"] and sizes["int8"] < 0.6 * sizes["same"]  # bytes per weight: 0.56, 1, 2
    assert drafts.default_draft_dir(target, progress=False) == rebuilt  # built once
    other = make_tiny_checkpoint(tmp_path / "other", "smollm-tied", layers=3, init_std=0.3, seed=6)
    with pytest.raises(UserError, match="distilled for another target"):
        drafts.default_draft_dir(other, progress=False)
    spec = greedy_past_eos(target, "Hi", 16, tree="sequoia", draft="default", tree_budget=8, tree_depth=4)[0]
    assert spec.token_ids == greedy_past_eos(target, "Hi", 16)[0].token_ids
