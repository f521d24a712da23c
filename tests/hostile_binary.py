"""Hostile binary inputs for the fuzzed-parser suite (issue 22, item 1): safetensors checkpoints and
GGUF files, valid and small, and the damage done to them (see hostile_inputs.py for the scheme).

A safetensors header's entries get wrong dtypes, shapes and offsets (overlapping, out of range, a
tensor claiming terabytes), its length field extreme values; a GGUF file is written field by field
(`GGUFBuffer`) so that every length, count and type field, and every section boundary, is known
and can be set to an extreme value or cut at.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from hostile_inputs import base_config, damage_bytes, mutate_doc

# ---- safetensors ------------------------------------------------------------------------------

def tiny_tensors() -> dict[str, tuple[int, ...]]:
    """The tensors of base_config(): one layer, tied embeddings."""
    h, f, q, kv = 32, 64, 32, 16
    shapes = {"model.embed_tokens.weight": (16, h), "model.norm.weight": (h,)}
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
             "mlp.down_proj.weight": (h, f)}
    shapes.update({f"model.layers.0.{k}": v for k, v in layer.items()})
    return shapes


ST_DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "F4", "Q4", "", "f32"]


def st_header(names: list[str]) -> tuple[dict, int]:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    shapes = tiny_tensors()
    for name in names:
        n = int(np.prod(shapes[name])) * 4
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
        offset += n
    return header, offset


def st_edit(draw, header: dict, size: int) -> None:
    """One targeted edit of a tensor entry: its dtype, shape or offsets, with plausible wrong values."""
    names = [k for k in header if k != "__metadata__"]
    name = draw(st.sampled_from(names))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "overlap", "terabytes"]))
    entry = header[name]
    if field == "dtype":
        entry["dtype"] = draw(st.sampled_from(ST_DTYPES))
    elif field == "shape":
        entry["shape"] = draw(st.lists(st.sampled_from([0, 1, 2, 16, 32, 2**31, 2**32, 2**63 - 1, -1]), max_size=4))
    elif field == "data_offsets":
        near = [0, 1, size - 1, size, size + 1, 2**32, 2**63 - 1, 2**64 - 1, -1] + entry["data_offsets"]
        entry["data_offsets"] = draw(st.lists(st.sampled_from(near), min_size=0, max_size=3))
    elif field == "overlap":
        other = header[draw(st.sampled_from(names))]
        entry["data_offsets"] = list(other["data_offsets"])
    else:
        entry.update(shape=[2**20, 2**20, 2**10], data_offsets=[0, 2**42 * 4])


def st_file(draw, header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    length = len(text)
    if draw is not None and draw(st.integers(0, 5)) == 0:
        length = draw(st.sampled_from([0, 1, length - 1, length + 1, 2**63, 2**64 - 1, 100 * 2**20 + 1, 8]))
    raw = struct.pack("<Q", length) + text + data
    if draw is not None and draw(st.integers(0, 4)) == 0:
        raw = damage_bytes(draw, raw)
    return raw


def build_safetensors(folder: Path, draw=None) -> Path:
    """config.json + model.safetensors (or two shards and an index), headers damaged."""
    (folder / "config.json").write_text(json.dumps(base_config()))
    names = list(tiny_tensors())
    sharded = draw is not None and draw(st.booleans())
    groups = [names[:5], names[5:]] if sharded else [names]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)] if sharded else ["model.safetensors"]
    rng = np.random.default_rng(0)
    for group, fname in zip(groups, files):
        header, size = st_header(group)
        data = rng.standard_normal(size // 4).astype(np.float32).tobytes()
        if draw is not None and draw(st.booleans()):
            for _ in range(draw(st.integers(1, 3))):
                st_edit(draw, header, size)
        elif draw is not None and draw(st.booleans()):
            header = mutate_doc(draw, header)
        (folder / fname).write_bytes(st_file(draw, header, data))
    if sharded:
        index = {"metadata": {"total_size": 0}, "weight_map": {n: files[0] if n in groups[0] else files[1]
                                                              for n in names}}
        if draw(st.booleans()):
            weight_map = index["weight_map"]
            for _ in range(draw(st.integers(1, 3))):
                weight_map[draw(st.sampled_from(names))] = draw(
                    st.sampled_from(files + ["missing.safetensors", "../model.safetensors", "/etc/hostname",
                                             "config.json", "", 5, None, ["x"]]))
        (folder / "model.safetensors.index.json").write_bytes(json.dumps(index).encode())
    return folder


# ---- GGUF -------------------------------------------------------------------------------------

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STR, ARR, U32, I32, F32, U64 = 8, 9, 4, 5, 6, 10
SPM_TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "\u2581a", "\u2581b", "ab", "bc", "\u2581ab", "x", "y",
              "z", "<0x0A>"]


class GGUFBuffer:
    """A GGUF file written field by field, noting where each length, count and type field sits
    (`fields`: offset, struct format) and where each section ends (`bounds`)."""

    def __init__(self):
        self.buf, self.fields, self.bounds = bytearray(), [], []

    def put(self, fmt: str, value, structural: bool = False) -> None:
        if structural:
            self.fields.append((len(self.buf), fmt))
        self.buf += struct.pack(fmt, value)

    def string(self, text) -> None:
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        self.put("<Q", len(data), True)
        self.buf += data

    def value(self, vtype: int, v) -> None:
        if vtype == STR:
            self.string(v)
        elif vtype == ARR:
            itype, items = v
            self.put("<I", itype, True)
            self.put("<Q", len(items), True)
            for item in items:
                self.value(itype, item)
        elif vtype in SCALARS:
            self.put(SCALARS[vtype], v)
        else:
            self.buf += bytes(v)  # an unknown type: its (made-up) payload

    def mark(self) -> None:
        self.bounds.append(len(self.buf))


def gguf_base() -> tuple[list, list]:
    """(metadata [(key, type, value)], tensors [(name, dims cols-first, ggml type, bytes)]) of a
    one-layer llama, hidden 32, vocabulary 16, SentencePiece tokenizer, one Q8_0 tensor."""
    import gguf
    rng = np.random.default_rng(0)
    kvs = [("general.architecture", STR, "llama"), ("general.alignment", U32, 32), ("llama.block_count", U32, 1),
           ("llama.context_length", U32, 64), ("llama.embedding_length", U32, 32),
           ("llama.feed_forward_length", U32, 64), ("llama.attention.head_count", U32, 2),
           ("llama.attention.head_count_kv", U32, 1), ("llama.rope.freq_base", F32, 10000.0),
           ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5), ("tokenizer.ggml.model", STR, "llama"),
           ("tokenizer.ggml.tokens", ARR, (STR, SPM_TOKENS)),
           ("tokenizer.ggml.scores", ARR, (F32, [-float(i) for i in range(16)])),
           ("tokenizer.ggml.token_type", ARR, (I32, [2, 3, 3] + [1] * 12 + [6])),
           ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
           ("tokenizer.ggml.unknown_token_id", U32, 0), ("tokenizer.chat_template", STR, "{{ messages }}"),
           ("general.hostile.bytes", ARR, (0, [1, 2, 3]))]  # a key nobody reads: an array of 1-byte items
    shapes = [("token_embd.weight", (32, 16)), ("blk.0.attn_norm.weight", (32,)), ("blk.0.attn_q.weight", (32, 32)),
              ("blk.0.attn_k.weight", (32, 16)), ("blk.0.attn_v.weight", (32, 16)),
              ("blk.0.attn_output.weight", (32, 32)), ("blk.0.ffn_norm.weight", (32,)),
              ("blk.0.ffn_gate.weight", (32, 64)), ("blk.0.ffn_up.weight", (32, 64)),
              ("blk.0.ffn_down.weight", (64, 32)), ("output_norm.weight", (32,))]
    tensors = []
    for name, dims in shapes:
        w = rng.standard_normal(tuple(reversed(dims))).astype(np.float32)
        if name == "blk.0.attn_v.weight":
            tensors.append((name, dims, 8, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).tobytes()))
        else:
            tensors.append((name, dims, 0, w.tobytes()))
    return kvs, tensors


def gguf_bytes(kvs: list, tensors: list, alignment: int = 32) -> GGUFBuffer:
    b = GGUFBuffer()
    b.buf += b"GGUF"
    b.mark()
    b.put("<I", 3)
    b.mark()
    b.put("<Q", len(tensors), True)
    b.put("<Q", len(kvs), True)
    b.mark()
    for key, vtype, v in kvs:
        b.string(key)
        b.put("<I", vtype, True)
        b.value(vtype, v)
        b.mark()
    offset = 0
    for name, dims, ttype, data in tensors:
        b.string(name)
        b.put("<I", len(dims), True)
        for d in dims:
            b.put("<Q", d, True)
        b.put("<I", ttype, True)
        b.put("<Q", offset, True)
        b.mark()
        offset += -(-len(data) // alignment) * alignment
    b.buf += bytes(-len(b.buf) % alignment)
    b.mark()
    for _, _, _, data in tensors:
        b.buf += data + bytes(-len(data) % alignment)
        b.mark()
    return b


TYPED_HOSTILE = [(U64, 2**64 - 1), (U64, 2**63), (U64, 2**32), (I32, -1), (U32, 0), (U32, 3), (STR, "abc"),
                 (STR, b"\xff\xfe"), (F32, float("nan")), (F32, float("inf")), (12, 1e308), (7, True),
                 (ARR, (STR, ["a", "b"])), (ARR, (U32, [1, 2])), (ARR, (ARR, [(U32, [1])])), (ARR, (STR, [])),
                 (13, b"\0" * 8), (2**32 - 1, b""), (ARR, (13, [b"\0"])), (11, -(2**63)), (ARR, (F32, [0.5] * 3)),
                 (ARR, (0, [1, 2, 3])), (ARR, (7, [True]))]


def gguf_edit(draw, kvs: list, tensors: list) -> None:
    """One structured edit: a metadata value retyped, removed or repeated, or a tensor's name,
    dimensions, type or offset changed."""
    kind = draw(st.sampled_from(["kv", "kv", "drop", "repeat", "tensor"]))
    i = draw(st.integers(0, len(kvs) - 1))
    if kind == "kv":
        kvs[i] = (kvs[i][0], *draw(st.sampled_from(TYPED_HOSTILE)))
    elif kind == "drop":
        del kvs[i]
    elif kind == "repeat":
        kvs.append(kvs[i])
    else:
        j = draw(st.integers(0, len(tensors) - 1))
        name, dims, ttype, data = tensors[j]
        what = draw(st.sampled_from(["dims", "type", "name", "data"]))
        if what == "dims":
            dims = tuple(draw(st.lists(st.sampled_from([0, 1, 15, 16, 17, 32, 33, 2**32, 2**63, 2**64 - 1]),
                                       max_size=5)))
        elif what == "type":
            ttype = draw(st.sampled_from([1, 2, 3, 8, 12, 14, 30, 39, 40, 2**32 - 1]))
        elif what == "name":
            name = draw(st.sampled_from([tensors[0][0], "blk.99.attn_q.weight", "rope_freqs.weight", "",
                                         "output.weight", "blk.0.attn_q.bias", "\u2028"]))
        else:
            data = data[:draw(st.integers(0, len(data)))]
        tensors[j] = (name, dims, ttype, data)


def gguf_damage(draw, b: GGUFBuffer) -> bytes:
    """A length/count/type field overwritten with an extreme value, a cut at a section boundary,
    or bytes overwritten."""
    kind = draw(st.sampled_from(["field", "field", "cut", "flip"]))
    data = bytearray(b.buf)
    if kind == "field":
        offset, fmt = draw(st.sampled_from(b.fields))
        top = 2**32 if fmt == "<I" else 2**64
        value = draw(st.sampled_from([0, 1, 13, 2**16, top // 2 - 1, top // 2, top - 2, top - 1,
                                      struct.unpack_from(fmt, data, offset)[0] + 1]))
        struct.pack_into(fmt, data, offset, value % top)
        return bytes(data)
    if kind == "cut":
        return bytes(data[:max(0, draw(st.sampled_from(b.bounds)) - draw(st.integers(0, 1)))])
    return damage_bytes(draw, bytes(data))


def build_gguf(folder: Path, draw=None, cut: int | None = None) -> Path:
    """model.gguf: the base, with structured edits and/or byte damage; `cut` truncates the base."""
    kvs, tensors = gguf_base()
    if draw is not None and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3))):
            gguf_edit(draw, kvs, tensors)
    b = gguf_bytes(kvs, tensors)
    data = bytes(b.buf)
    if cut is not None:
        data = data[:cut]
    elif draw is not None and draw(st.booleans()):
        data = gguf_damage(draw, b)
    path = folder / "model.gguf"
    path.write_bytes(data)
    return path


def build_gguf_field(folder: Path, offset: int, fmt: str, value: int) -> Path:
    """model.gguf: the base with one length, count or type field set to `value`."""
    data = bytearray(gguf_bytes(*gguf_base()).buf)
    struct.pack_into(fmt, data, offset, value)
    path = folder / "model.gguf"
    path.write_bytes(bytes(data))
    return path


def gguf_extremes() -> list[tuple[int, str, int]]:
    """Every length, count and type field of the base file, with its largest value (2^64-1 or
    2^32-1), and 2^63 for the 64-bit ones."""
    out = []
    for offset, fmt in gguf_bytes(*gguf_base()).fields:
        out.append((offset, fmt, 2**64 - 1 if fmt == "<Q" else 2**32 - 1))
        if fmt == "<Q":
            out.append((offset, fmt, 2**63))
    return out


KV_SWEEP = [(U64, 2**64 - 1), (I32, -1), (U32, 0), (STR, "abc"), (F32, float("nan")), (ARR, (U32, [1, 2]))]


def build_gguf_kv(folder: Path, index: int, vtype: int, value) -> Path:
    """model.gguf: the base with metadata value `index` retyped (vtype, value)."""
    kvs, tensors = gguf_base()
    kvs[index] = (kvs[index][0], vtype, value)
    path = folder / "model.gguf"
    path.write_bytes(bytes(gguf_bytes(kvs, tensors).buf))
    return path


def gguf_sweep() -> list:
    """Every cut at a section boundary, every length/count/type field at its extremes, every
    metadata value retyped to each of KV_SWEEP."""
    out = [(f"cut-{c}", lambda folder, c=c: build_gguf(folder, cut=c)) for c in gguf_cuts()]
    out += [(f"field-{o}={v}", lambda folder, o=o, f=f, v=v: build_gguf_field(folder, o, f, v))
            for o, f, v in gguf_extremes()]
    return out + [(f"{key}={i}", lambda folder, k=k, t=t, v=v: build_gguf_kv(folder, k, t, v))
                  for k, (key, _, _) in enumerate(gguf_base()[0]) for i, (t, v) in enumerate(KV_SWEEP)]


def gguf_cuts() -> list[int]:
    """Every section boundary of the base file, and one byte short of each."""
    bounds = gguf_bytes(*gguf_base()).bounds
    return sorted({c for b in bounds for c in (b, b - 1) if c >= 0})


def _single_file(folder: Path, edit) -> Path:
    """config.json + model.safetensors whose header `edit(header, size) -> header length` changed
    (the length written: None for the true one); returns the folder."""
    (folder / "config.json").write_text(json.dumps(base_config()))
    header, size = st_header(list(tiny_tensors()))
    data = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32).tobytes()
    length = edit(header, size)
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text) if length is None else length)
                                              + text + data)
    return folder


def safetensors_sweep() -> list:
    """Each dtype for one tensor, shapes of wrong size, huge and negative; offsets out of range,
    reversed, overlapping; a tensor of terabytes; the length field at its extremes; the file cut
    short at each part (length, header, data)."""
    name = "model.layers.0.self_attn.k_proj.weight"

    def entry(**change):
        def edit(header, size):
            header[name].update(change)
        return edit

    def cut(n):
        def build(folder):
            _single_file(folder, lambda h, s: None)
            path = folder / "model.safetensors"
            path.write_bytes(path.read_bytes()[:n])
            return folder
        return build
    edits = [entry(dtype=d) for d in ST_DTYPES]
    edits += [entry(shape=s) for s in ([16], [32, 16], [16, 32, 1], [], [2**63 - 1, 2], [-1, 32], [2**64, 1])]
    edits += [entry(data_offsets=o) for o in ([0, 2**64 - 1], [-1, 2047], [2048, 0], [0, 2048], [1, 2049], [5],
                                              [2**63, 2**63 + 2048])]
    edits += [entry(shape=[2**20, 2**20, 2**10], data_offsets=[0, 2**44])]
    edits += [lambda h, s, v=v: v for v in (0, 1, 8, 2**63, 2**64 - 1, 100 * 2**20 + 1)]
    out = [(f"edit-{i}", lambda folder, e=e: _single_file(folder, e)) for i, e in enumerate(edits)]
    return out + [(f"cut-{n}", cut(n)) for n in (0, 4, 8, 40, 400, 3000, 20000)]
