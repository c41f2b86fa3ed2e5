"""GGUF's quantized blocks decoded into the layouts the kernels read (common/quantized/kernels.cpp).

Every conversion is exact: the kernels compute with the file's own integer codes and scales, so the weights they
multiply are the GGUF's weights, value for value (the float scales are fp16 in the file and float32 here). Block
layouts as llama.cpp's ggml-common.h defines them; `dequantize` computes the weights these tensors stand for, for
the tests and the float64 reference.
"""

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

# The block formats the kernels compute on, and the others this module reads as float (norms, biases).
KERNEL_FORMATS = (Q.Q4_K, Q.Q6_K, Q.Q4_1, Q.Q8_0, Q.Q5_0)
FLOAT_FORMATS = (Q.F32, Q.F16)


class UnsupportedFormat(ValueError):
    pass


@dataclass
class PackedWeight:
    """One [out_features, in_features] matrix in a kernel's layout: `kernel` names the kernel, `tensors` its
    operands after the activations, in the kernel's order."""

    kernel: str
    out_features: int
    in_features: int
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """A tensor's bytes [rows, row bytes] as [rows, blocks, block bytes]."""
    return raw.reshape(rows, -1, block_bytes)


def interleave_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [rows, K] in weight order -> [rows, K/2] bytes: in every 64 weights, byte i holds weight i in its
    low nibble and weight 32 + i in its high one (Q4_K's own layout)."""
    rows, k = codes.shape
    chunks = codes.reshape(rows, k // 64, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(rows, k // 2).astype(np.uint8)


def q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of packed 6-bit scales and mins -> (scales [..., 8], mins [..., 8]) (get_scale_min_k4)."""
    q = scales.astype(np.uint8)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


# Q4_K's codes in the kernels' grouped-lane order (kernels.cpp): a superblock's 128 bytes as 32 four-byte elements,
# the file's element 8c + u (group pair c's weights 4u..4u+3: group 2c's in the low nibbles, 2c + 1's in the high
# ones) stored as element 8k + j with c = j % 4 and u = 2k + j // 4, so that lane j of each 32 bytes holds group pair
# j % 4. Q4_K_GROUPED[e] is the file's element stored as element e.
Q4_K_GROUPED = np.array([8 * (j % 4) + 2 * k + j // 4 for k in range(4) for j in range(8)])
Q4_K_FILE = np.argsort(Q4_K_GROUPED)  # the inverse: where the file's element e is stored


def q4_k_grouped(codes: np.ndarray) -> np.ndarray:
    """Q4_K's codes [..., superblocks, 128] in the file's order -> the same bytes in grouped-lane order."""
    elements = codes.reshape(*codes.shape[:-1], 32, 4)
    return np.ascontiguousarray(elements[..., Q4_K_GROUPED, :]).reshape(codes.shape)


def pack_q4_k(raw: np.ndarray, n: int, k: int) -> PackedWeight:
    b = blocks(raw, n, 144)  # d fp16, dmin fp16, scales[12], qs[128]
    sc, mn = q4_k_scales(b[..., 4:16])
    return PackedWeight(
        "q4k",
        n,
        k,
        (
            torch.from_numpy(q4_k_grouped(b[..., 16:144]).reshape(n, k // 2)),
            torch.from_numpy(np.ascontiguousarray(sc).reshape(n, k // 32)),
            torch.from_numpy(np.ascontiguousarray(mn).reshape(n, k // 32)),
            torch.from_numpy(fp16(b[..., 0:2])),
            torch.from_numpy(fp16(b[..., 2:4])),
        ),
    )


def q6_k_codes(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q6_K's low 4 bits [..., 128] and high 2 bits [..., 64] -> the 6-bit codes [..., 256] in weight order."""
    out = []
    for half in range(2):
        low, high = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
        out += [
            (low[..., :32] & 0xF) | (((high >> 0) & 3) << 4),
            (low[..., 32:] & 0xF) | (((high >> 2) & 3) << 4),
            (low[..., :32] >> 4) | (((high >> 4) & 3) << 4),
            (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4),
        ]
    return np.concatenate(out, axis=-1).astype(np.uint8)


def pack_q6_k(raw: np.ndarray, n: int, k: int) -> PackedWeight:
    b = blocks(raw, n, 210)  # ql[128], qh[64], scales[16] (int8), d fp16
    return PackedWeight(
        "q6k",
        n,
        k,
        (
            torch.from_numpy(np.ascontiguousarray(b[..., 0:128]).reshape(n, k // 2)),
            torch.from_numpy(np.ascontiguousarray(b[..., 128:192]).reshape(n, k // 4)),
            torch.from_numpy(np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, k // 16)),
            torch.from_numpy(fp16(b[..., 208:210])),
        ),
    )


def nibbles_in_order(qs: np.ndarray) -> np.ndarray:
    """16 bytes of a 32-weight block (weights j and 16 + j in byte j) -> 32 codes in weight order."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


# The kernels compute Q4_1, Q8_0 and Q5_0 in tiles of 8 output columns (kernel_columns.h), a column per vector lane,
# so all their operands are stored tile by tile, [tiles, elements, 8] (element [t, e, i] is row 8t + i's element e;
# the last tile repeats the last row where n is not a multiple of 8): the codes as int32 elements of 4 bytes, so
# that 32 bytes hold 4 code bytes of each of 8 rows, as the kernels multiply them, with no transpose at run time;
# the scales (and Q4_1's minimums) as the file's float16, a group's 8 in one 16-byte load.
TILE = 8
TILED = ("q41", "q80")  # the kernels whose operands are stored tile by tile


def tiled(v: np.ndarray) -> np.ndarray:
    """Per-row elements [n, elements] -> [tiles, elements, 8] (the last tile padded with the last row)."""
    n = v.shape[0]
    padded = np.concatenate([v, np.repeat(v[-1:], -n % TILE, axis=0)]) if n % TILE else v
    return np.ascontiguousarray(padded.reshape(-1, TILE, v.shape[1]).transpose(0, 2, 1))


def untiled(t: torch.Tensor, n: int) -> torch.Tensor:
    """[tiles, elements, 8] -> the per-row elements [n, elements]."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n]


def rows_per_index(kernel: str) -> int:
    """How many output rows one leading index of the kernel's operands stands for: a tile's 8, or 1."""
    return TILE if kernel in TILED else 1


def rows_of(weight: PackedWeight, start: int, n: int) -> PackedWeight:
    """Rows start..start + n - 1 of a packed matrix (start a multiple of 8 where the format has tiled operands), as
    views."""
    unit = rows_per_index(weight.kernel)
    if start % unit:
        raise ValueError(f"rows of {weight.kernel} start at a multiple of {unit}, not at {start}")
    tensors = tuple(t[start // unit : -(-(start + n) // unit)] for t in weight.tensors)
    return PackedWeight(weight.kernel, n, weight.in_features, tensors)


def select_rows(weight: PackedWeight, rows: torch.Tensor) -> PackedWeight:
    """Some output rows of a packed matrix, in the given order (a copy)."""
    n = weight.out_features
    if weight.kernel in TILED:
        tensors = tuple(torch.from_numpy(tiled(untiled(t, n)[rows].numpy())) for t in weight.tensors)
    else:
        tensors = tuple(t.reshape(n, -1)[rows].contiguous() for t in weight.tensors)
    return PackedWeight(weight.kernel, len(rows), weight.in_features, tensors)


def fp16_bits(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] as float16 values [...] (kept as the file has them)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def pack_q4_1(raw: np.ndarray, n: int, k: int) -> PackedWeight:
    b = blocks(raw, n, 20)  # d fp16, m fp16, qs[16]
    return pack_q41(nibbles_in_order(b[..., 4:20]).reshape(n, k), fp16_bits(b[..., 0:2]), fp16_bits(b[..., 2:4]), n, k)


def pack_q41(codes: np.ndarray, d: np.ndarray, m: np.ndarray, n: int, k: int) -> PackedWeight:
    """The Q4_1 kernel's operands: codes [n, k] (0-15, weight order), d and m [n, groups] (float16), tile by tile."""
    if k % 64:
        raise UnsupportedFormat(f"Q4_1 rows of {k} values (the kernel needs a multiple of 64)")
    return PackedWeight(
        "q41",
        n,
        k,
        (
            torch.from_numpy(tiled(interleave_nibbles(codes).view(np.int32))),
            torch.from_numpy(tiled(d)),
            torch.from_numpy(tiled(m)),
        ),
    )


def quantize_q4_1(weights: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 weights [n, k] in Q4_1, as gguf's own quantizer computes it (the same float32 operations, so the same
    codes and scales: per 32 weights d = (max - min) / 15, m = min, code = trunc((w - m) / d + 0.5)) but in torch
    over the whole matrix: codes [n, k] (0-15, weight order), d and m [n, groups] (float16), pack_q41's operands."""
    n, k = weights.shape
    groups = weights.reshape(n, k // 32, 32)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    d = (high - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc((groups - low) * inverse + 0.5).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return codes.numpy(), d[..., 0].to(torch.float16).numpy(), low[..., 0].to(torch.float16).numpy()


def pack_q80(codes: np.ndarray, d: np.ndarray, n: int, k: int) -> PackedWeight:
    """The int8 kernel's operands: codes [n, k] (int8) and d's fp16 bytes [n, groups, 2], tile by tile."""
    return PackedWeight("q80", n, k, (torch.from_numpy(tiled(codes.view(np.int32))), torch.from_numpy(tiled(fp16_bits(d)))))


def pack_q8_0(raw: np.ndarray, n: int, k: int) -> PackedWeight:
    b = blocks(raw, n, 34)  # d fp16, qs[32] (int8)
    codes = np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(n, k)
    return pack_q80(codes, b[..., 0:2], n, k)


def q5_0_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0's 4 bytes of fifth bits and 16 bytes of nibbles -> signed codes [..., 32] (weight = d * code)."""
    bits = np.ascontiguousarray(qh).view("<u4")[..., 0:1] >> np.arange(32, dtype=np.uint32)
    return (nibbles_in_order(qs) | ((bits & 1).astype(np.uint8) << 4)).astype(np.int16) - 16


def pack_q5_0(raw: np.ndarray, n: int, k: int) -> PackedWeight:
    b = blocks(raw, n, 22)  # d fp16, qh[4], qs[16]
    codes = q5_0_codes(b[..., 2:6], b[..., 6:22]).astype(np.int8).reshape(n, k)
    return pack_q80(codes, b[..., 0:2], n, k)


PACKERS = {Q.Q4_K: pack_q4_k, Q.Q6_K: pack_q6_k, Q.Q4_1: pack_q4_1, Q.Q8_0: pack_q8_0, Q.Q5_0: pack_q5_0}


def check_kernel_format(qtype: Q) -> None:
    if qtype not in PACKERS:
        supported = ", ".join(t.name for t in KERNEL_FORMATS)
        raise UnsupportedFormat(f"block format {qtype.name} (the gguf engine computes on {supported})")


def pack(raw: np.ndarray, qtype: Q, n: int, k: int) -> PackedWeight:
    """A GGUF tensor's bytes [n, row bytes] of `qtype` in its kernel's layout."""
    check_kernel_format(qtype)
    return PACKERS[qtype](np.ascontiguousarray(raw), n, k)


def dequantize(weight: PackedWeight) -> torch.Tensor:
    """The float64 weights [n, k] a packed matrix stands for."""
    n, k = weight.out_features, weight.in_features
    tensors = weight.tensors
    if weight.kernel in TILED:  # back to a row per row: the codes' int32 elements as their bytes
        codes = untiled(tensors[0], n).contiguous().view(torch.uint8 if weight.kernel == "q41" else torch.int8)
        tensors = (codes, *(untiled(x, n) for x in tensors[1:]))
    t = [x.double() if x.is_floating_point() else x.long() for x in tensors]
    if weight.kernel == "q4k":
        codes, sc, mn, d, dmin = t
        codes = codes.reshape(n, k // 256, 32, 4)[:, :, torch.from_numpy(Q4_K_FILE)]  # back to the file's order
        low, high = codes.reshape(n, k // 64, 32) & 0xF, codes.reshape(n, k // 64, 32) >> 4
        q = torch.stack([low, high], dim=2).reshape(n, k // 32, 32).double()
        groups = d.repeat_interleave(8, dim=1) * sc, dmin.repeat_interleave(8, dim=1) * mn
        return (q * groups[0][..., None] - groups[1][..., None]).reshape(n, k)
    if weight.kernel == "q6k":
        ql, qh, sc, d = weight.tensors[0].numpy(), weight.tensors[1].numpy(), t[2], t[3]
        codes = torch.from_numpy(q6_k_codes(ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64)).astype(np.int64))
        scale = d.repeat_interleave(16, dim=1) * sc
        return ((codes.reshape(n, k // 16, 16) - 32).double() * scale[..., None]).reshape(n, k)
    if weight.kernel == "q41":
        codes, d, m = t
        low, high = codes.reshape(n, k // 64, 32) & 0xF, codes.reshape(n, k // 64, 32) >> 4
        q = torch.stack([low, high], dim=2).reshape(n, k // 32, 32).double()
        return (q * d[..., None] + m[..., None]).reshape(n, k)
    codes, d = t
    return (codes.reshape(n, k // 32, 32).double() * d[..., None]).reshape(n, k)
