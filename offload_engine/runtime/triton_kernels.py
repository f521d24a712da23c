"""The fused GGUF dequantization kernel (Triton), imported only where it runs: importing Triton
costs half a second that a process which never dequantizes on a GPU should not pay. What the
kernel computes, and why it equals the CPU path bit for bit: runtime/triton_dequant.py."""

import triton
import triton.language as tl


@triton.jit
def _half(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["n_blocks"])  # one compiled kernel per format and dtype, any size
def dequant_kernel(src, dst, n_blocks, KIND: tl.constexpr, SIZE: tl.constexpr, PER: tl.constexpr,
                   BLOCKS: tl.constexpr, BF16: tl.constexpr):
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # [BLOCKS, 1]
    i = tl.arange(0, PER)[None, :]  # [1, PER]: the weight within its block
    ok = blk < n_blocks
    mask = ok & (i < PER)
    base = src + blk.to(tl.int64) * SIZE
    if KIND == 0:  # Q8_0: w = q * d
        q = tl.load(base + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _half(base, ok)
    elif KIND <= 4:  # Q4_0 Q4_1 Q5_0 Q5_1: low nibbles are weights 0..15, high ones 16..31
        OFF: tl.constexpr = 2 if (KIND == 1 or KIND == 3) else 4
        QS: tl.constexpr = OFF + 4 if KIND >= 3 else OFF
        byte = tl.load(base + QS + (i % 16), mask=mask, other=0)
        q = tl.where(i < 16, byte & 15, byte >> 4).to(tl.int32)
        if KIND >= 3:  # the fifth bit of weight i: bit i of a little-endian u32
            qh = tl.load(base + OFF + i // 8, mask=mask, other=0).to(tl.int32)
            q = q | (((qh >> (i % 8)) & 1) << 4)
        d = _half(base, ok)
        if KIND == 1:
            w = d * (q - 8).to(tl.float32)
        elif KIND == 3:
            w = d * (q - 16).to(tl.float32)
        else:
            x = d * q.to(tl.float32)
            w = x + _half(base + 2, ok)
    elif KIND <= 6:  # Q4_K Q5_K: 8 sub-blocks of 32, six-bit scale and minimum each
        j = i // 32
        lane = i % 32
        s_j = tl.load(base + 4 + j, mask=mask, other=0).to(tl.int32)
        s_j4 = tl.load(base + 8 + j, mask=mask, other=0).to(tl.int32)
        s_jm4 = tl.load(base + 4 + tl.maximum(j - 4, 0), mask=mask, other=0).to(tl.int32)
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 2) & 0x30))
        mn = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 2) & 0x30))
        dd = _half(base, ok) * sc.to(tl.float32)
        dm = _half(base + 2, ok) * mn.to(tl.float32)
        QS: tl.constexpr = 48 if KIND == 6 else 16
        byte = tl.load(base + QS + (j // 2) * 32 + lane, mask=mask, other=0).to(tl.int32)
        q = tl.where(j % 2 == 1, byte >> 4, byte & 15)
        if KIND == 6:
            qh = tl.load(base + 16 + lane, mask=mask, other=0).to(tl.int32)
            q = q | (((qh >> j) & 1) << 4)
        x = dd * q.to(tl.float32)
        w = x - dm
    else:  # Q6_K: 16 sub-blocks of 16, int8 scales; ql low nibbles, qh two high bits
        h = i // 128
        r = i % 128
        low = (tl.load(base + h * 64 + r % 64, mask=mask, other=0).to(tl.int32) >> (4 * (r // 64))) & 15
        high = (tl.load(base + 128 + h * 32 + r % 32, mask=mask, other=0).to(tl.int32) >> (2 * (r // 32))) & 3
        q = (low | (high << 4)) - 32
        scale = tl.load(base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        ds = _half(base + 208, ok) * scale
        w = ds * q.to(tl.float32)
    if BF16:  # round to nearest even by hand, as torch does (NaN -> 0x7fc0): one rule everywhere
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        bits = tl.where(w != w, 0x7FC0, bits)
        tl.store(dst + blk.to(tl.int64) * PER + i, bits.to(tl.uint16), mask=mask)
    else:
        tl.store(dst + blk.to(tl.int64) * PER + i, w.to(dst.dtype.element_ty), mask=mask)
