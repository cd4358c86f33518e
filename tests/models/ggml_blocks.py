"""The block formats of ggml's quant types, decoded one value at a time as ggml-quants.c's
`dequantize_row_*` reference functions do (and `ggml_compute_bf16_to_fp32`): an independent
reference for models.gguf, which dequantizes through gguf-py's vectorised numpy. Arithmetic is in
f32 in C's order, so the results are exactly C's. Also: random raw blocks of each type, with sane
f16 scales (random bytes there could be NaN or inf)."""
import numpy as np

# type name -> (values per block, bytes per block), from ggml-common.h's block structs
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
          "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "IQ2_XXS": (256, 66), "IQ3_XXS": (256, 98)}
F32 = np.float32


def _f16(b: bytes) -> np.float32:
    return F32(np.frombuffer(b, np.float16)[0])


def _q8_0(b: bytes) -> list:  # block_q8_0 { ggml_half d; int8_t qs[32]; }
    d, qs = _f16(b[0:2]), np.frombuffer(b[2:34], np.int8)
    return [F32(qs[j]) * d for j in range(32)]


def _q4_0(b: bytes) -> list:  # block_q4_0 { ggml_half d; uint8_t qs[16]; }
    d, qs, y = _f16(b[0:2]), b[2:18], [None] * 32
    for j in range(16):
        y[j] = F32((qs[j] & 0x0F) - 8) * d
        y[j + 16] = F32((qs[j] >> 4) - 8) * d
    return y


def _q4_1(b: bytes) -> list:  # block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }
    d, m, qs, y = _f16(b[0:2]), _f16(b[2:4]), b[4:20], [None] * 32
    for j in range(16):
        y[j] = F32(qs[j] & 0x0F) * d + m
        y[j + 16] = F32(qs[j] >> 4) * d + m
    return y


def _q5_0(b: bytes) -> list:  # block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }
    d, qh, qs, y = _f16(b[0:2]), int.from_bytes(b[2:6], "little"), b[6:22], [None] * 32
    for j in range(16):
        xh_0 = ((qh >> (j + 0)) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j] = F32(((qs[j] & 0x0F) | xh_0) - 16) * d
        y[j + 16] = F32(((qs[j] >> 4) | xh_1) - 16) * d
    return y


def _q5_1(b: bytes) -> list:  # block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }
    d, m, qh, qs, y = _f16(b[0:2]), _f16(b[2:4]), int.from_bytes(b[4:8], "little"), b[8:24], [None] * 32
    for j in range(16):
        xh_0 = ((qh >> (j + 0)) << 4) & 0x10
        xh_1 = (qh >> (j + 12)) & 0x10
        y[j] = F32((qs[j] & 0x0F) | xh_0) * d + m
        y[j + 16] = F32((qs[j] >> 4) | xh_1) * d + m
    return y


def _q2_k(b: bytes) -> list:  # block_q2_K { uint8_t scales[16]; uint8_t qs[64]; ggml_half d, dmin; }
    scales, q, d, dmin, y = b[0:16], b[16:80], _f16(b[80:82]), _f16(b[82:84]), []
    is_ = 0
    for n in range(2):  # 128 values per half: 4 shifts of 32 bytes, each byte holding 4 two-bit values
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                sc = scales[is_]
                is_ += 1
                dl, ml = d * F32(sc & 0xF), dmin * F32(sc >> 4)
                y += [dl * F32((q[32 * n + half + l] >> shift) & 3) - ml for l in range(16)]
    return y


def _q3_k(b: bytes) -> list:  # block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; }
    hm, q, packed, d, y = b[0:32], b[32:96], b[96:108], _f16(b[108:110]), []
    # The 16 six-bit scales, as the reference unpacks them through four uint32 words (kmask1/kmask2).
    aux = [int.from_bytes(packed[4 * k: 4 * k + 4], "little") for k in range(3)]
    tmp, k1, k2 = aux[2], 0x03030303, 0x0F0F0F0F
    words = [(aux[0] & k2) | (((tmp >> 0) & k1) << 4), (aux[1] & k2) | (((tmp >> 2) & k1) << 4),
             ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = np.frombuffer(b"".join(w.to_bytes(4, "little") for w in words), np.int8)
    is_, m = 0, 1
    for n in range(2):
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d * F32(int(scales[is_]) - 32)
                is_ += 1
                y += [dl * F32(((q[32 * n + half + l] >> shift) & 3) - (0 if hm[half + l] & m else 4))
                      for l in range(16)]
            m <<= 1
    return y


IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl


def _iq4_nl(b: bytes) -> list:  # block_iq4_nl { ggml_half d; uint8_t qs[16]; }
    d, qs = _f16(b[0:2]), b[2:18]
    return [d * F32(IQ4_VALUES[qs[j] & 0xF]) for j in range(16)] + [d * F32(IQ4_VALUES[qs[j] >> 4]) for j in range(16)]


def _iq4_xs(b: bytes) -> list:  # block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; }
    d, scales_h, scales_l, qs, y = _f16(b[0:2]), int.from_bytes(b[2:4], "little"), b[4:8], b[8:136], []
    for ib in range(8):  # 32 values per sub-block, each with a six-bit scale
        ls = ((scales_l[ib // 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
        dl, sub = d * F32(ls - 32), qs[16 * ib: 16 * ib + 16]
        y += [dl * F32(IQ4_VALUES[sub[j] & 0xF]) for j in range(16)]
        y += [dl * F32(IQ4_VALUES[sub[j] >> 4]) for j in range(16)]
    return y


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:  # get_scale_min_k4
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _q4_k(b: bytes) -> list:  # block_q4_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[128]; }
    d, dmin, scales, q, y = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:144], []
    for j in range(4):  # 64 values per step: 32 low nibbles, then 32 high ones, each with its scale
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * F32(sc), dmin * F32(m)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * F32(sc), dmin * F32(m)
        y += [d1 * F32(q[32 * j + l] & 0xF) - m1 for l in range(32)]
        y += [d2 * F32(q[32 * j + l] >> 4) - m2 for l in range(32)]
    return y


def _q5_k(b: bytes) -> list:  # block_q5_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }
    d, dmin, scales, qh, ql, y = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176], []
    u1, u2 = 1, 2  # the bit of qh that is the fifth bit of the low / high nibble's value, per 64 values
    for j in range(4):
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * F32(sc), dmin * F32(m)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * F32(sc), dmin * F32(m)
        y += [d1 * F32((ql[32 * j + l] & 0xF) + (16 if qh[l] & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * F32((ql[32 * j + l] >> 4) + (16 if qh[l] & u2 else 0)) - m2 for l in range(32)]
        u1, u2 = u1 << 2, u2 << 2
    return y


def _q6_k(b: bytes) -> list:  # block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }
    ql, qh, sc, d = b[0:128], b[128:192], np.frombuffer(b[192:208], np.int8), _f16(b[208:210])
    y = [None] * 256
    for n in range(2):  # 128 values per half, from 64 ql bytes, 32 qh bytes and 8 scales
        lo, hi, s, out = 64 * n, 32 * n, 8 * n, 128 * n
        for l in range(32):
            i = l // 16
            q1 = ((ql[lo + l] & 0xF) | (((qh[hi + l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[lo + l + 32] & 0xF) | (((qh[hi + l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[lo + l] >> 4) | (((qh[hi + l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[lo + l + 32] >> 4) | (((qh[hi + l] >> 6) & 3) << 4)) - 32
            y[out + l] = d * F32(sc[s + i]) * F32(q1)
            y[out + l + 32] = d * F32(sc[s + i + 2]) * F32(q2)
            y[out + l + 64] = d * F32(sc[s + i + 4]) * F32(q3)
            y[out + l + 96] = d * F32(sc[s + i + 6]) * F32(q4)
    return y


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
             "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def decode(kind: str, raw: np.ndarray) -> np.ndarray:  # u8[rows, bytes_per_row] -> f32[rows, cols]
    """What ggml's reference dequantizes `raw` (the file's bytes, row-major) to."""
    if kind == "F32":
        return raw.view(np.float32).copy()
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32)
    if kind == "BF16":  # the top half of an f32's bits
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    size = BLOCKS[kind][1]
    return np.array([[y for i in range(0, len(row), size) for y in _DECODERS[kind](bytes(row[i:i + size]))]
                     for row in raw], np.float32)


def random_blocks(kind: str, rng, rows: int, blocks_per_row: int, scale=(1e-3, 1e-1)) -> np.ndarray:
    """Random raw blocks of `kind` -> u8[rows, bytes_per_row]; its f16 scale fields are in `scale` in
    magnitude, either sign."""
    _, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, blocks_per_row, size), dtype=np.uint8)
    scale_at = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,), "IQ4_XS": (0,),
                "IQ2_XXS": (0,), "IQ3_XXS": (0,)}[kind]
    for at in scale_at:
        scales = (rng.uniform(*scale, (rows, blocks_per_row)) * rng.choice([-1, 1], (rows, blocks_per_row)))
        raw[..., at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * size)
