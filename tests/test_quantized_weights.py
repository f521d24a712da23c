"""Quantized weights end to end (issue 18): GGUF files loaded directly and streamed in their own
block formats, 16-bit checkpoints quantized at store build (--weights), conversion to the compute
dtype on the copy side, resident layers kept in blocks, drafts from GGUF files.

The reference for every exactness test is the model run resident from the dequantized weights:
the GGUF converted to a float32 Hugging Face folder by `convert-gguf` (whose dequantization is
bitwise `gguf.quants.dequantize`, tests/test_gguf_blocks.py) and loaded as plain tensors.
"""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf import gpt2_tokenizer_meta, tiny_llama, write_gguf

from offload_engine import Engine
from offload_engine.formats import gguf_blocks
from offload_engine.formats.checkpoint import Checkpoint, open_checkpoint
from offload_engine.formats.config import load_config
from offload_engine.formats.gguf_import import convert_gguf
from offload_engine.runtime.blocks import storage_format, to_dense
from offload_engine.runtime.layer_store import open_or_build, store_layout
from offload_engine.runtime.model import Transformer, causal_mask
from offload_engine.speculation.decoder import TREE_KINDS
from tiny_models import make_tiny_checkpoint

# Each layer its own mix: every supported block format appears, and layers differ (as in a
# Q4_K_M file, whose layouts vary by layer). Matrices have 256 or 512 columns: whole K blocks.
LAYER_TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0},
    {"attn_q": Q.Q5_1, "attn_k": Q.F16, "attn_v": Q.BF16, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q6_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_K},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0,
     "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q6_K},
]
K_F16_FIELDS = {Q.Q4_K: [(0, 2), (2, 4)], Q.Q5_K: [(0, 2), (2, 4)], Q.Q6_K: [(208, 210)]}


@pytest.fixture(scope="module")
def meta():
    return gpt2_tokenizer_meta("smollm")


def _random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Valid K-quant blocks (the gguf package has no K quantizer): random codes and small finite
    half-precision scales."""
    block, size = gguf_blocks.BLOCK_SIZES[qtype.name]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for lo, hi in K_F16_FIELDS[qtype]:
        raw[:, lo:hi] = (rng.standard_normal(n) * 0.004).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def write_mixed_gguf(path, meta, seed: int = 0, layers: int = 3):
    """A tiny llama GGUF (hidden 256, 4 heads of 64, 2 KV heads, MLP 512) whose layers hold the
    mixes of LAYER_TYPES; embeddings Q8_0, head F16, norms F32."""
    model = tiny_llama(len(meta["tokens"]), seed=seed, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    rng = np.random.default_rng(seed)
    override = {"token_embd.weight": Q.Q8_0, "output.weight": Q.F16}
    k_blocks = {}
    for i in range(layers):
        for short, qtype in LAYER_TYPES[i % len(LAYER_TYPES)].items():
            override[f"blk.{i}.{short}.weight"] = qtype
    real_quantize = gguf.quants.quantize

    def quantize(arr, qtype):  # the K-quants get random valid blocks of the same shape
        if qtype in K_F16_FIELDS:
            raw = _random_k_blocks(arr.shape[0], arr.shape[1], qtype, rng)
            k_blocks[id(raw)] = raw
            return raw
        return real_quantize(arr, qtype)

    gguf.quants.quantize = quantize
    try:
        write_gguf(path, model, meta, type_override=override)
    finally:
        gguf.quants.quantize = real_quantize
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, meta):
    """(the GGUF file, its float32 conversion) in a module-wide cache folder."""
    root = tmp_path_factory.mktemp("mixed")
    src = write_mixed_gguf(root / "mixed.gguf", meta)
    return src, convert_gguf(src, root / "f32", progress=False)


@pytest.fixture()
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sequoia-offload"


def _reference(folder) -> Transformer:
    return Transformer.from_checkpoint(Checkpoint(folder, load_config(folder)), torch.float32)


def _passes(model: Transformer) -> list[torch.Tensor]:
    """Logits of a prefill (12 tokens), a decode step, and a tree pass of 5 nodes (two branches),
    with every input on the model's device."""
    g = torch.Generator().manual_seed(0)
    vocab, dev = model.cfg.vocab_size, model.device
    cache = model.new_cache(64)
    out = []
    ids = torch.randint(0, vocab, (12,), generator=g)
    out.append(model.forward(ids.to(dev), torch.arange(12, device=dev), cache))
    cache.advance(12)
    out.append(model.forward(torch.tensor([7], device=dev), torch.tensor([12], device=dev), cache))
    cache.advance(1)
    tree = torch.randint(0, vocab, (5,), generator=g)
    depth = torch.tensor([0, 1, 1, 2, 2])
    parent = [-1, 0, 0, 1, 2]
    mask = causal_mask(13, 5)
    mask[:, 13:] = False
    for i in range(5):  # each node sees itself and its ancestors
        j = i
        while j >= 0:
            mask[i, 13 + j] = True
            j = parent[j]
    out.append(model.forward(tree.to(dev), (13 + depth).to(dev), cache, mask=mask.to(dev)))
    return out


def test_storage_format_rules():
    f32, bf16 = torch.float32, torch.bfloat16
    assert storage_format("Q4_K", (8, 256), f32) == "Q4_K"  # auto: the file's own blocks
    assert storage_format("F32", (8,), bf16) == "BF16"  # 1-D: always the compute dtype
    assert storage_format("Q4_1", (8,), f32) == "F32"
    assert storage_format("BF16", (8, 64), f32) == "BF16"  # narrower than compute: kept, cast per use
    assert storage_format("F32", (8, 64), bf16) == "BF16"  # wider: the cast every use would make
    assert storage_format("F16", (8, 64), bf16) == "BF16"  # same width, other float: the compute dtype
    assert storage_format("BF16", (8, 64), f32, "q8_0") == "Q8_0"
    assert storage_format("Q4_1", (8, 64), f32, "f32") == "F32"
    assert storage_format("Q4_1", (8, 64), f32, "f16") == "F16"


def test_gguf_folder_and_file_resolve_to_one_metadata_folder(mixed, cache_home, tmp_path):
    from offload_engine.engine import resolve_target
    src, _ = mixed
    side = resolve_target(src, progress=False)
    assert side.parent == cache_home / "models" and (side / "gguf.json").is_file()
    assert not list(side.glob("*.safetensors"))
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "model.gguf").symlink_to(src)
    assert (resolve_target(holder, progress=False) / "gguf.json").is_file()
    ckpt = open_checkpoint(side, load_config(side))
    formats = ckpt.source_formats()
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "Q4_K"
    assert formats["model.layers.1.self_attn.v_proj.weight"] == "BF16"


@pytest.mark.parametrize("offload,buffers", [("disk", 1), ("disk", 3), ("ram", 2), ("none", None)])
def test_streamed_gguf_equals_resident_dequantized_bitwise(mixed, cache_home, offload, buffers):
    src, f32 = mixed
    expected = _passes(_reference(f32))
    engine = Engine.load(src, device="cpu", offload=offload, buffers=buffers, progress=False)
    try:
        plan = engine.plan
        if offload != "none":
            assert plan.streamed_layers == (0, 1, 2)
            # exactly the file's bytes for each layer (aligned), not their float32 size
            raw = [sum(gguf_blocks.nbytes(f, n) for f, n in _layer_formats(src, i)) for i in range(3)]
            assert all(r <= s < r + 4096 + 256 * 9 for r, s in zip(raw, plan.sizes)), (raw, plan.sizes)
            assert len(set(plan.sizes)) > 1  # per-layer layouts
        got = _passes(engine.model)
    finally:
        engine.close()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _layer_formats(src, i):
    reader = gguf.GGUFReader(src)
    for t in reader.tensors:
        if t.name.startswith(f"blk.{i}."):
            n = int(np.prod(t.shape))
            yield (t.tensor_type.name if t.tensor_type.name != "F32" else "F32", n)


def test_resident_layers_kept_in_blocks_equal_dense(mixed, cache_home):
    """A device too small for the dense model keeps resident layers in their blocks (the plan says
    so and counts their real bytes); the logits are the same bits."""
    src, f32 = mixed
    expected = _passes(_reference(f32))
    probe = Engine.load(src, device="cpu", offload="none", progress=False)
    need = probe.plan.vram_bytes
    dense_layer = probe.plan.dense_layer_bytes
    probe.close()
    # room for every layer in its blocks but not dense: all resident, in blocks
    engine = Engine.load(src, device="cpu", offload="auto", vram=need - dense_layer // 2, progress=False)
    try:
        assert engine.plan.resident_format == "blocks", engine.plan.table()
        assert len(engine.plan.resident_layers) >= 2
        assert engine.plan.resident_bytes < len(engine.plan.resident_layers) * dense_layer / 2
        assert "kept in their blocks" in engine.plan.table()
        got = _passes(engine.model)
    finally:
        engine.close()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [k for k in TREE_KINDS if k != "none"])
def test_greedy_speculation_on_a_quantized_target_equals_plain(mixed, meta, cache_home, tmp_path, kind):
    """A GGUF target streamed from disk with a GGUF draft (another random model, same tokenizer,
    resident in its blocks): greedy output equals plain greedy decoding of the target."""
    src, _ = mixed
    draft = write_mixed_gguf(tmp_path / "draft.gguf", meta, seed=1, layers=1)
    plain = Engine.load(src, device="cpu", offload="none", progress=False)
    spec = Engine.load(src, device="cpu", offload="disk", buffers=2, draft=draft, tree=kind, tree_budget=12,
                       tree_depth=4, progress=False)
    try:
        assert all(isinstance(w, torch.Tensor) or hasattr(w, "linear") for w in spec.draft.layers[0].values())
        assert any(hasattr(w, "linear") for w in spec.draft.layers[0].values())  # kept in blocks
        a = plain.generate("Hello there, friend", max_new_tokens=20)
        b = spec.generate("Hello there, friend", max_new_tokens=20)
        assert a.token_ids == b.token_ids
        assert b.stats["target_steps"] < len(b.token_ids) or kind == "chain"
    finally:
        spec.close()
        plain.close()


@pytest.mark.parametrize("weights", ["q8_0", "q4_0", "q4_1", "bf16"])
def test_weights_quantize_a_16_bit_checkpoint_at_store_build(tmp_path, cache_home, weights):
    """--weights on a safetensors checkpoint: each matrix's stored blocks are what the gguf
    package's quantizer makes of it, and the streamed model equals the resident one built from
    those blocks dequantized."""
    folder = make_tiny_checkpoint(tmp_path / "m", "llama3-gqa", layers=2, hidden=64, intermediate=128)
    ckpt = Checkpoint(folder, load_config(folder))
    store = open_or_build(ckpt, torch.float32, cache_home / "stores", progress=False, weights=weights)
    qtype = Q[weights.upper()]
    lay = store.layout.layouts[1]
    block = store.load_block(1)
    slot = next(s for s in lay.slots if s.name == "mlp.up_proj.weight")
    w = ckpt.load("model.layers.1.mlp.up_proj.weight", torch.float32)
    want = gguf.quants.quantize(w.numpy(), qtype).view(np.uint8).reshape(-1)
    assert np.array_equal(block[slot.offset: slot.offset + slot.nbytes].numpy(), want)
    assert slot.fmt == weights.upper() and lay.slots[0].fmt == "F32"  # norms stay in the compute dtype
    # the reference: the checkpoint's matrices quantized and dequantized by the gguf package
    deq = {}
    for i in range(2):
        layer = ckpt.load_layer(i, torch.float32)
        for name, t in layer.items():
            if t.dim() == 2:
                q = gguf.quants.quantize(t.numpy(), qtype)
                t = torch.from_numpy(np.array(gguf.quants.dequantize(q, qtype), dtype=np.float32))
            layer[name] = t.clone()
        deq[i] = layer
    from offload_engine.runtime.model import load_globals
    ref = Transformer(ckpt.config, load_globals(ckpt, torch.float32, torch.device("cpu")), [deq[0], deq[1]],
                      torch.float32, torch.device("cpu"))
    engine = Engine.load(folder, device="cpu", offload="disk", weights=weights, progress=False)
    resident = Engine.load(folder, device="cpu", offload="none", weights=weights, progress=False)
    try:
        assert engine.plan.bytes_per_pass == store.layout.total_bytes
        assert resident.plan.resident_format == "dense"  # dequantized once, from the stored format
        expected = _passes(ref)
        for model in (engine.model, resident.model):  # the same model wherever its layers live
            for a, b in zip(_passes(model), expected):
                assert torch.equal(a, b)
    finally:
        engine.close()
        resident.close()
    ckpt.close()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_torch_quantizers_make_the_gguf_packages_bytes(qtype):
    """Random rows of many scales, blocks of zeros, of one repeated value, of halves (ties at every
    rounding step), of a denormal: bit for bit what `gguf.quants.quantize` writes."""
    from offload_engine.runtime.blocks import quantize
    rng = np.random.default_rng(len(qtype))
    w = (rng.standard_normal((64, 256)) * rng.uniform(1e-3, 10, (64, 1))).astype(np.float32)
    w[0, :32] = 0
    w[1, 32:64] = -3.0
    w[2] = rng.integers(-16, 16, 256) / 2
    w[3, :32] = np.linspace(-1, 1, 32)
    w[4, :32] = 1e-40
    with np.errstate(all="ignore"):
        want = gguf.quants.quantize(w, Q[qtype]).view(np.uint8).reshape(64, -1)
    assert np.array_equal(quantize(torch.from_numpy(w), qtype).numpy(), want)


def test_to_dense_into_a_bfloat16_scratch_is_the_cast_of_the_float32_dequantization():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = torch.from_numpy(gguf.quants.quantize(w, Q[qtype]).view(np.uint8).reshape(-1).copy())
        ref = gguf_blocks.dequantize(raw, qtype, (4, 64))
        out = torch.empty(4, 64, dtype=torch.bfloat16)
        assert torch.equal(to_dense(raw, qtype, (4, 64), torch.bfloat16, out=out), ref.to(torch.bfloat16))
        assert torch.equal(to_dense(raw, qtype, (4, 64), torch.float32), ref)


def test_plan_counts_real_bytes_and_names_the_formats(mixed, cache_home, capsys):
    from offload_engine.apps.cli import main
    src, _ = mixed
    assert main(["plan", "--target", str(src), "--device", "cpu", "--offload", "disk"]) == 0
    out = capsys.readouterr().out
    assert "stored weights:" in out and "Q4_K" in out and "Q6_K" in out
    engine_plan = store_layout(open_checkpoint(*_side(src)), torch.float32)
    assert engine_plan.total_bytes < 0.4 * _dense_bytes(src)


def _side(src):
    from offload_engine.engine import resolve_target
    side = resolve_target(src, progress=False)
    return side, load_config(side)


def _dense_bytes(src):
    side, cfg = _side(src)
    from offload_engine.runtime.layer_store import LayerLayout
    return cfg.num_layers * LayerLayout.for_config(cfg, torch.float32).block_bytes


def _trusted(cache_home) -> list:
    models = cache_home / "models"
    return [p for p in models.iterdir() if not p.name.startswith(".")] if models.exists() else []


@pytest.mark.parametrize("damage", ["truncated", "size", "unsupported", "arch"])
def test_bad_gguf_files_get_one_line_and_leave_nothing_trusted(meta, tmp_path, cache_home, damage, capsys):
    model = tiny_llama(len(meta["tokens"]), hidden_size=64, intermediate_size=128)
    path = tmp_path / "bad.gguf"
    if damage == "unsupported":
        src = write_gguf(path, model, meta, type_override={"blk.0.ffn_up.weight": Q.Q8_0})
        data = bytearray(src.read_bytes())
        # relabel that tensor's type in its header entry as IQ4_NL: a real llama.cpp format (32
        # weights in 18 bytes, so the file still parses) that this runtime does not read
        name = b"blk.0.ffn_up.weight"
        at = data.index(name) + len(name)
        n_dims = int.from_bytes(data[at:at + 4], "little")
        type_at = at + 4 + 8 * n_dims
        assert int.from_bytes(data[type_at:type_at + 4], "little") == Q.Q8_0
        data[type_at:type_at + 4] = int(Q.IQ4_NL).to_bytes(4, "little")
        src.write_bytes(bytes(data))
        expect = "IQ4_NL"
    elif damage == "arch":
        write_gguf(path, model, meta, arch="gpt2")
        expect = "architecture 'gpt2' is not supported"
    else:
        write_gguf(path, model, meta, type_override={"blk.1.ffn_down.weight": Q.Q8_0})
        data = path.read_bytes()
        if damage == "truncated":
            path.write_bytes(data[: len(data) - 1000])
            expect = "bad.gguf"
        else:  # the last tensor's header claims more rows than the file holds bytes for
            name = b"output.weight"
            at = data.index(name) + len(name)
            raw = bytearray(data)
            rows_at = at + 4 + 8  # second dimension (rows) of a 2-D tensor
            rows = int.from_bytes(raw[rows_at:rows_at + 8], "little")
            raw[rows_at:rows_at + 8] = (rows * 2).to_bytes(8, "little")
            path.write_bytes(bytes(raw))
            expect = "bad.gguf"
    from offload_engine.apps.cli import main
    capsys.readouterr()
    rc = main(["generate", "--target", str(path), "--draft", "none", "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sequoia-offload: error:") and expect in lines[0], lines
    assert _trusted(cache_home) == []
    # a second run finds nothing half-made to trust, and says the same
    assert main(["generate", "--target", str(path), "--draft", "none", "--prompt", "hi", "--device", "cpu"]) == 2
    assert expect in capsys.readouterr().err


def test_gguf_with_attention_biases_streams_as_its_conversion(meta, cache_home, tmp_path):
    """llama.cpp permutes the q and k biases as it permutes the rows: undone on the raw bytes."""
    model = tiny_llama(len(meta["tokens"]), attention_bias=True)
    src = write_gguf(tmp_path / "bias.gguf", model, meta, qtype=Q.Q8_0)
    f32 = convert_gguf(src, tmp_path / "f32", progress=False)
    expected = _passes(_reference(f32))
    engine = Engine.load(src, device="cpu", offload="disk", progress=False)
    try:
        for a, b in zip(_passes(engine.model), expected):
            assert torch.equal(a, b)
    finally:
        engine.close()


def test_a_damaged_metadata_folder_is_written_again(mixed, cache_home):
    """A power cut after the folder's rename can leave an empty file in it: not trusted."""
    from offload_engine.engine import resolve_target
    src, _ = mixed
    side = resolve_target(src, progress=False)
    (side / "gguf.json").write_text("")
    again = resolve_target(src, progress=False)
    assert again == side and json.loads((side / "gguf.json").read_text())["tensors"]


def test_sidecar_of_a_changed_file_is_not_trusted(mixed, cache_home, tmp_path):
    from offload_engine.engine import resolve_target
    from offload_engine.errors import UserError
    src, _ = mixed
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(src.read_bytes())
    side = resolve_target(copy, progress=False)
    copy.write_bytes(copy.read_bytes()[:-10] + bytes(10))  # same size, new mtime
    with pytest.raises(UserError, match="changed since"):
        open_checkpoint(side, load_config(side))
    assert resolve_target(copy, progress=False) != side  # the file itself gets a new folder


def test_default_target_streams_its_own_q4_1_blocks():
    """The embedded default is read from its GGUF: Q4_1 matrices, about a sixth of float32's bytes."""
    from offload_engine.engine import plan_only
    plan, folder, _, _ = plan_only("default", device="cpu", offload="disk")
    assert json.loads((folder / "gguf.json").read_text())["file"].endswith("Q4_1.gguf")
    assert "Q4_1 x7" in plan.weights
    f32 = plan_only("default", device="cpu", offload="disk", weights="f32")[0]
    assert 0.14 < plan.bytes_per_pass / f32.bytes_per_pass < 0.2



@pytest.mark.parametrize("draft", ["self-int8", "self-int4"])
def test_self_drafts_start_from_a_quantized_targets_dequantized_weights(mixed, cache_home, draft):
    src, f32 = mixed
    plain = Engine.load(src, device="cpu", offload="none", progress=False)
    spec = Engine.load(src, device="cpu", offload="disk", draft=draft, tree="sequoia", tree_budget=8, tree_depth=4,
                       progress=False)
    from_f32 = Engine.load(f32, device="cpu", offload="none", draft=draft, tree="sequoia", tree_budget=8,
                           tree_depth=4, progress=False)
    try:
        # the self-draft quantizes the target's dequantized weights: the same draft as from the
        # float32 conversion, whose proposals (hence the steps taken) are then the same too
        # (q, k and v as one matrix: `model.fuse_projections`)
        for name, inputs in (("self_attn.qkv_proj.weight", 256), ("mlp.down_proj.weight", 512)):
            a, b = spec.draft.layers[1][name], from_f32.draft.layers[1][name]
            x = torch.randn(3, inputs, generator=torch.Generator().manual_seed(0))
            assert torch.equal(a.linear(x, None), b.linear(x, None))
        want = plain.generate("Hello there, friend", max_new_tokens=16)
        got = spec.generate("Hello there, friend", max_new_tokens=16)
        assert want.token_ids == got.token_ids
    finally:
        for e in (spec, from_f32, plain):
            e.close()


def test_the_command_line_offers_every_format_the_runtime_has():
    """The CLI lists its choices literally (parsing arguments must not import torch): they must
    stay the runtime's."""
    from offload_engine.apps.cli import build_parser
    from offload_engine.planning.simulator import PRECISIONS
    from offload_engine.runtime.blocks import WEIGHTS_CHOICES
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    weights = next(a for a in sub["generate"]._actions if a.dest == "weights")
    assert tuple(weights.choices) == WEIGHTS_CHOICES
    for dest in ("precision", "draft_precision"):
        action = next(a for a in sub["simulate"]._actions if a.dest == dest)
        assert set(action.choices) == set(PRECISIONS)


def test_distill_starts_a_student_from_a_quantized_targets_dequantized_layers(mixed, cache_home):
    from offload_engine.apps.distill import DistillOptions, init_student, load_teacher
    from offload_engine.engine import resolve_target
    src, f32 = mixed
    side = resolve_target(src, progress=False)
    cfg = load_config(side)
    teacher, engine = load_teacher(side, DistillOptions(offload="none"), progress=False)
    try:
        tensors, _ = init_student(teacher, side, cfg, (1,), torch.Generator().manual_seed(0))
    finally:
        engine.close()
    want = Checkpoint(f32, load_config(f32)).load_layer(1, torch.float32)
    for name, w in want.items():
        assert torch.equal(tensors[f"model.layers.0.{name}"], w), name
