"""Pure-PyTorch reference of the gradcomp wire format, written from the spec comments.

Sources of truth (the comment blocks at the top of each file):
  csrc/common/wire.h    header layout, body layout, zero padding to a multiple of 16 bytes
  csrc/common/random.h  Philox4x32-10 keying of the stochastic rounding, Feistel index permutation
  csrc/common/reduce.h  canonical summation order of scales and norms
  csrc/common/half.h    fp16 / bf16 round-to-nearest-even, canonical NaNs
  csrc/cpu/{dense,signsgd,terngrad,qsgd,topk,randomk}.cpp   per-codec math and body

Nothing here calls gradcomp: every value is computed with vectorized torch ops (the only Python
loops run over payloads, blocks of 32 summation lanes, Philox rounds or Feistel rounds). Unsigned
32-bit arithmetic is done in int64 tensors masked with 0xFFFFFFFF; 32x32-bit products are split
into 16-bit halves so that nothing overflows int64.

Two torch behaviours the reference works around (seen with torch 2.13 on an AVX-512 CPU):
  * torch.sqrt is not correctly rounded (about 0.6% of fp32 inputs are one ulp off, and about
    0.8% of float64 ones); sqrt_rn corrects the fp32 one with exact midpoint tests, as
    std::sqrt(float) is correctly rounded, and qsgd's float64 norms use math.sqrt (IEEE correctly
    rounded, as std::sqrt(double) and CUDA's sqrt(double)) per block.
  * torch's fp16/bf16 -> fp32 conversions may drop a NaN's sign; to_float widens bit-exactly.

Public names (imported by tests and benchmarks):
  ref_encode, ref_decode_sum, ref_payload_nbytes, philox4x32_10, ref_randomk_indices
"""

from __future__ import annotations

import math
import struct

import torch

__all__ = [
    "CODEC_IDS", "DTYPE_IDS", "HEADER_BYTES", "PAYLOAD_ALIGN", "MAGIC", "FORMAT_VERSION",
    "philox4x32_10", "mix32", "ref_uniforms", "ref_randomk_indices", "canonical_sum", "round_to", "to_float",
    "ref_encode", "ref_decode_sum", "ref_payload_nbytes", "ref_validate", "parse_header", "qsgd_code_bits", "sqrt_rn",
    "round_to_saturating", "add_saturating", "sub_saturating", "mul_saturating", "saturated_norm", "FLT_MAX",
]

MASK32 = 0xFFFFFFFF
MAGIC = 0x504D4347  # "GCMP" read as a little-endian uint32
FORMAT_VERSION = 1
HEADER_BYTES = 48
PAYLOAD_ALIGN = 16
MAX_LEVELS = 32767
# topk's param1 for its compact layout: a uint32 count per span of COMPACT_SPAN elements, each index's low
# 16 bits, then 16-bit values (bf16 for an fp32 gradient)
TOPK_COMPACT = 1
COMPACT_SPAN = 1 << 16
MAX_INDEXED_NUMEL = 0x7FFFFFFF
MAX_STOCHASTIC_NUMEL = 1 << 34
SHARED_STREAM = 0xFFFFFFFF
REDUCE_LANES = 32
REDUCE_CHUNK = 4096
FLT_MAX = 3.4028234663852886e38

CODEC_IDS = {"none": 0, "fp16": 1, "bf16": 2, "signsgd": 3, "terngrad": 4, "qsgd": 5, "topk": 6, "randomk": 7}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPES = {v: k for k, v in DTYPE_IDS.items()}

# <  magic u32, version u8, codec u8, dtype u8, reserved u8, numel i64, param0 i64, param1 i64,
#    seed u64, step u32, bucket u32
_HEADER = struct.Struct("<IBBBBqqqQII")
assert _HEADER.size == HEADER_BYTES


# ----------------------------------------------------------------------------------------------
# 32-bit unsigned arithmetic on int64 tensors
# ----------------------------------------------------------------------------------------------

def _u32(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(torch.int64) & MASK32
    return torch.tensor(int(x) & MASK32, dtype=torch.int64)


def _mul_hilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product a * b, a an int64 tensor in [0, 2^32)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    middle = a_hi * b_lo + a_lo * b_hi  # < 2^33
    low_sum = a_lo * b_lo + ((middle & 0xFFFF) << 16)  # < 2^33
    low = low_sum & MASK32
    high = (a_hi * b_hi + (middle >> 16) + (low_sum >> 32)) & MASK32
    return high, low


def _mul_lo(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for an int64 tensor a in [0, 2^32) and a constant b < 2^32."""
    return _mul_hilo(a, b)[1]


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (Salmon et al., SC'11; Random123): four uint32 words as int64 tensors.

    Every argument is an int, or an integer tensor; they broadcast together.
    """
    c = [_u32(v) for v in (c0, c1, c2, c3)]
    k = [_u32(v) for v in (k0, k1)]
    c = list(torch.broadcast_tensors(*c, *k))
    c, k = c[:4], c[4:]
    for _ in range(10):
        hi0, lo0 = _mul_hilo(c[0], 0xD2511F53)
        hi1, lo1 = _mul_hilo(c[2], 0xCD9E8D57)
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
        k = [(k[0] + 0x9E3779B9) & MASK32, (k[1] + 0xBB67AE85) & MASK32]
    return tuple(c)


def _seed_words(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & MASK32, seed >> 32


def ref_uniforms(n: int, seed: int, step: int, bucket: int, rank: int) -> torch.Tensor:
    """The rounding coin u in [0, 1) (fp32) of elements 0..n-1 for one (seed, step, bucket, rank).

    Philox4x32-10 with key = (seed lo, seed hi) and counter = (group, step, bucket, rank). Elements
    go in tiles of 64: element e takes word (e >> 4) & 3 of the block of group
    (e >> 6) * 16 + (e & 15), as u = (word >> 8) * 2^-24.
    """
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    k0, k1 = _seed_words(seed)
    groups = ((n - 1) >> 6) * 16 + 16  # every group that a tile touched by [0, n) uses
    blocks = torch.stack(philox4x32_10(torch.arange(groups, dtype=torch.int64), step, bucket, rank, k0, k1), dim=1)
    e = torch.arange(n, dtype=torch.int64)
    words = blocks[(e >> 6) * 16 + (e & 15), (e >> 4) & 3]
    return (words >> 8).to(torch.float32) * (2.0 ** -24)


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul_lo(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul_lo(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def ref_randomk_indices(n: int, k: int, seed: int, step: int, bucket: int) -> torch.Tensor:
    """pi(0), ..., pi(k - 1): the keyed Feistel permutation of [0, n) with cycle walking."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    half = 1
    while (1 << (2 * half)) < n:  # the smallest h >= 1 with 2^(2h) >= n
        half += 1
    mask = (1 << half) - 1
    k0, k1 = _seed_words(seed)
    round_keys = [int(w) for w in philox4x32_10(0, step, bucket, SHARED_STREAM, k0, k1)]

    def feistel(x: torch.Tensor) -> torch.Tensor:
        left, right = x >> half, x & mask
        for key in round_keys:
            left, right = right, left ^ (mix32(right ^ key) & mask)
        return (left << half) | right

    x = feistel(torch.arange(k, dtype=torch.int64))
    walking = (x >= n).nonzero().flatten()
    while walking.numel():  # cycle walking: re-apply the bijection until back in [0, n)
        x[walking] = feistel(x[walking])
        walking = walking[x[walking] >= n]
    return x


# ----------------------------------------------------------------------------------------------
# Floating point helpers
# ----------------------------------------------------------------------------------------------

def _bits32(x: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of an fp32 tensor as int64 in [0, 2^32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & MASK32


def _from_bits32(bits: torch.Tensor) -> torch.Tensor:
    b = bits & MASK32
    b = torch.where(b >= (1 << 31), b - (1 << 32), b)
    return b.to(torch.int32).view(torch.float32)


def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """|x| as an integer whose order is the magnitude order, NaN above Inf, -0 == +0."""
    return _bits32(to_float(x)) & 0x7FFFFFFF


def to_float(x: torch.Tensor) -> torch.Tensor:
    """to_float: the exact widening of fp32 / fp16 / bf16 to fp32, NaN sign and payload included
    (bf16 bits << 16; an fp16 NaN keeps its sign and its mantissa shifted up by 13). torch's own
    conversions are used for the numbers only: on some builds they drop a NaN's sign."""
    if x.dtype == torch.float32:
        return x
    if x.dtype == torch.bfloat16:
        return ((x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16).to(torch.int32).view(torch.float32)
    y = x.to(torch.float32)
    nan = torch.isnan(x)
    if bool(nan.any()):
        h = x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        bits = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13)
        y = torch.where(nan, _from_bits32(bits), y)
    return y


def round_to_saturating(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """from_float_saturating<T>: round_to, except that a finite x that rounds to +-Inf becomes the
    dtype's largest finite value with x's sign (fp16 65504, bf16 3.3895314e38 = 0x7F7F; no finite
    fp32 overflows fp32). NaN and Inf stay NaN and Inf."""
    y = round_to(x, dtype)
    if dtype == torch.float32:
        return y
    x = x.to(torch.float32)
    overflow = torch.isinf(y) & torch.isfinite(x)
    if bool(overflow.any()):
        top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
        y = torch.where(overflow, torch.where(x < 0, -top, top), y)
    return y


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """from_float<T>: fp32 -> dtype, round to nearest even; NaN becomes the canonical quiet NaN
    (fp16: sign | 0x7E00, as c10::Half; bf16: 0x7FC0 whatever the sign, as c10::BFloat16)."""
    x = x.to(torch.float32)
    if dtype == torch.float32:
        return x.clone()
    y = x.to(dtype)
    nan = torch.isnan(x)
    if bool(nan.any()):
        if dtype == torch.float16:
            canonical = torch.where(torch.signbit(x), torch.tensor(-512, dtype=torch.int16),  # 0xFE00
                                    torch.tensor(0x7E00, dtype=torch.int16))
        else:
            canonical = torch.full_like(x, 0x7FC0, dtype=torch.int16)
        y = torch.where(nan, canonical, y.view(torch.int16)).view(dtype)
    return y


def canonical_sum(values: torch.Tensor) -> torch.Tensor:
    """Canonical sums of the rows of a [rows, length] float64 tensor, as float64 [rows].

    Rows are cut into chunks of 4096; in a chunk, 32 float64 lanes, lane j adding elements j,
    j + 32, ... (chunk-relative) in index order starting from +0, then the halving tree lane i +=
    lane i + 16, + 8, + 4, + 2, + 1; chunk results are added in chunk order in double precision.
    Zero padding leaves every lane unchanged (lanes start at +0 and x + 0 == x).
    """
    values = values.to(torch.float64)
    rows, length = values.shape
    total = torch.zeros(rows, dtype=torch.float64)
    if length == 0:
        return total
    chunk = min(REDUCE_CHUNK, -(-length // REDUCE_LANES) * REDUCE_LANES)
    chunks = -(-length // chunk)
    padded = torch.zeros(rows, chunks * chunk, dtype=torch.float64)
    padded[:, :length] = values
    padded = padded.view(rows, chunks, chunk // REDUCE_LANES, REDUCE_LANES)
    lanes = torch.zeros(rows, chunks, REDUCE_LANES, dtype=torch.float64)
    for r in range(padded.shape[2]):
        lanes = lanes + padded[:, :, r, :]
    width = REDUCE_LANES // 2
    while width >= 1:
        lanes = lanes[..., :width] + lanes[..., width:2 * width]
        width //= 2
    per_chunk = lanes[..., 0]
    for c in range(chunks):
        total = total + per_chunk[:, c]
    return total


def _saturate_overflow(a: torch.Tensor, b: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """result, except +-FLT_MAX (result's sign) where finite a and b gave a non-finite result."""
    overflow = torch.isfinite(a) & torch.isfinite(b) & ~torch.isfinite(result)
    return torch.where(overflow, torch.copysign(torch.tensor(FLT_MAX, dtype=torch.float32), result), result)


def add_saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """add_saturating (hd.h): fp32 a + b; finite operands whose sum overflows give +-FLT_MAX,
    NaN or Inf operands the IEEE sum."""
    a, b = torch.broadcast_tensors(a.to(torch.float32), b.to(torch.float32))
    return _saturate_overflow(a, b, a + b)


def sub_saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = torch.broadcast_tensors(a.to(torch.float32), b.to(torch.float32))
    return _saturate_overflow(a, b, a - b)


def mul_saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = torch.broadcast_tensors(a.to(torch.float32), b.to(torch.float32))
    return _saturate_overflow(a, b, a * b)


def sqrt_rn64(values: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float64 square root of each value (math.sqrt, one call per value: torch.sqrt
    on float64 is not correctly rounded, std::sqrt(double) and CUDA's sqrt(double) are); NaN below 0."""
    return torch.tensor([math.sqrt(v) if v >= 0 else float("nan") for v in values.tolist()], dtype=torch.float64)


def saturated_norm(sum_of_squares: torch.Tensor) -> torch.Tensor:
    """saturated_norm (reduce.h): the correctly rounded float64 square root (sqrt_rn64), rounded to
    fp32; a finite root beyond FLT_MAX gives FLT_MAX, NaN and Inf stay."""
    roots = sqrt_rn64(sum_of_squares)
    beyond = (roots > FLT_MAX) & torch.isfinite(roots)
    return torch.where(beyond, torch.tensor(FLT_MAX, dtype=torch.float64), roots).to(torch.float32)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (what std::sqrt(float) and IEEE 754 give).

    torch.sqrt is not correctly rounded on every CPU build (torch 2.13's AVX-512 kernel is off by
    one ulp for about 0.6% of fp32 inputs), so its result is only a first guess: y moves to a
    neighbour while x lies beyond the midpoint between them. Midpoints of two fp32 values have 25
    significant bits, so they and their squares are exact in float64 and the tests are exact.
    """
    x = x.to(torch.float32)
    y = torch.sqrt(x.double()).to(torch.float32)
    regular = torch.isfinite(y) & (y > 0)
    xd = x.double()
    inf = torch.tensor(float("inf"))
    for _ in range(2):
        up = torch.nextafter(y, inf)
        down = torch.nextafter(y, -inf)
        mid_up = (y.double() + up.double()) / 2
        mid_down = (y.double() + down.double()) / 2
        y = torch.where(regular & (xd > mid_up * mid_up), up, y)
        y = torch.where(regular & (xd < mid_down * mid_down), down, y)
    return y


def qsgd_code_bits(levels: int) -> int:
    """1 sign bit + ceil(log2(levels + 1)) level bits."""
    return 1 + int(levels).bit_length()


# ----------------------------------------------------------------------------------------------
# Bit packing (little-endian bit streams: stream bit j is bit j % 8 of byte j / 8)
# ----------------------------------------------------------------------------------------------

_BIT_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.int64)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    bits = bits.reshape(-1).to(torch.int64)
    nbytes = -(-bits.numel() // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.int64)
    padded[: bits.numel()] = bits
    return (padded.view(nbytes, 8) * _BIT_WEIGHTS).sum(1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor, nbits: int) -> torch.Tensor:
    bits = (data.to(torch.int64).unsqueeze(1) >> torch.arange(8)) & 1
    return bits.reshape(-1)[:nbits]


def _codes_to_stream(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Concatenates width-bit codes LSB first into a byte stream."""
    bits = (codes.to(torch.int64).unsqueeze(1) >> torch.arange(width)) & 1
    return _pack_bits(bits)


def _stream_to_codes(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    bits = _unpack_bits(data, count * width).view(count, width)
    return (bits << torch.arange(width)).sum(1)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _field(payload: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return payload[offset: offset + count * size].clone().view(dtype)


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------

def _dtype_bytes(dtype_id: int) -> int:
    return 4 if dtype_id == 0 else 2


def _layout(codec_id: int, dtype_id: int, n: int, p0: int, p1: int) -> dict[str, int]:
    """Byte offsets of scales, codes, values, body end, and the padded total."""
    b = HEADER_BYTES
    vb = _dtype_bytes(dtype_id)
    name = CODEC_NAMES[codec_id]
    lay = {"scales": b, "codes": b, "values": b}
    if name == "none":
        end = b + n * vb
    elif name in ("fp16", "bf16"):
        end = b + n * 2
    elif name == "signsgd":
        lay["codes"] = b + 4 * -(-n // p1)
        end = lay["codes"] + -(-n // 8)
    elif name == "terngrad":
        lay["codes"] = b + 4
        end = lay["codes"] + -(-n // 4)
    elif name == "qsgd":
        lay["codes"] = b + 4 * -(-n // p1)
        end = lay["codes"] + -(-(n * qsgd_code_bits(p0)) // 8)
    elif name == "topk" and p1 == TOPK_COMPACT:  # counts per span, 16-bit low index bits, 16-bit values
        lay["codes"] = b + 4 * -(-n // COMPACT_SPAN)
        lay["values"] = lay["codes"] + 2 * p0
        end = lay["values"] + 2 * p0
    elif name == "topk":
        lay["values"] = b + 4 * p0
        end = lay["values"] + p0 * vb
    else:  # randomk
        end = b + p0 * vb
    lay["end"] = end
    lay["total"] = -(-end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    return lay


def _params(codec: str, n: int, k: int, levels: int, block: int, compact: bool = False) -> tuple[int, int]:
    if codec == "topk":
        return int(k), TOPK_COMPACT if compact else 0
    if codec == "randomk":
        return int(k), 0
    if codec == "qsgd":
        return int(levels), int(block)
    if codec == "signsgd":
        return 0, int(block)
    return 0, 0


def _header_problem(h: dict) -> str | None:
    """Why a header is not well formed (the checks listed in wire.h), or None."""
    if h["magic"] != MAGIC:
        return "bad magic"
    if h["version"] != FORMAT_VERSION:
        return "unsupported wire format version"
    if h["codec"] >= len(CODEC_IDS):
        return "unknown codec id"
    if h["dtype"] >= len(DTYPE_IDS):
        return "unknown dtype id"
    if h["reserved"] != 0:
        return "reserved header byte is not zero"
    n, p0, p1 = h["numel"], h["param0"], h["param1"]
    name = CODEC_NAMES[h["codec"]]
    if n < 0:
        return "negative element count"
    if name in ("topk", "randomk"):
        if n > MAX_INDEXED_NUMEL:
            return "element count above 2^31 - 1 for an indexed codec"
        if p0 < 0 or p0 > n or (n > 0 and p0 == 0):
            return "k outside [1, numel]"
    elif name == "qsgd":
        if not 1 <= p0 <= MAX_LEVELS:
            return "qsgd levels outside [1, 32767]"
        if p1 < 1:
            return "qsgd block < 1"
    elif p0 != 0:
        return "unexpected parameter for this codec"
    if name == "signsgd" and not 1 <= p1 <= (1 << 40):
        return "signsgd block outside [1, 2^40]"
    if name == "topk" and p1 not in (0, TOPK_COMPACT):
        return "topk index layout is neither wide nor compact"
    if name not in ("qsgd", "signsgd", "topk") and p1 != 0:
        return "unexpected parameter for this codec"
    if name in ("terngrad", "qsgd") and n > MAX_STOCHASTIC_NUMEL:
        return "element count above 2^34 for a stochastic codec"
    if n > (1 << 40):
        return "element count too large"
    return None


def ref_payload_nbytes(codec: str, numel: int, dtype: torch.dtype, *, k: int = 0, levels: int = 0,
                       block: int = 0, compact: bool = False) -> int:
    """Exact bytes of one payload, header and padding included."""
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}")
    if dtype not in DTYPE_IDS:
        raise ValueError(f"unsupported dtype {dtype}")
    p0, p1 = _params(codec, numel, k, levels, block, compact)
    h = dict(magic=MAGIC, version=FORMAT_VERSION, codec=CODEC_IDS[codec], dtype=DTYPE_IDS[dtype],
             reserved=0, numel=numel, param0=p0, param1=p1)
    problem = _header_problem(h)
    if problem:
        raise ValueError(f"invalid {codec} parameters: {problem}")
    return _layout(CODEC_IDS[codec], DTYPE_IDS[dtype], numel, p0, p1)["total"]


def parse_header(payload: torch.Tensor) -> dict:
    raw = bytes(payload[:HEADER_BYTES].tolist())
    keys = ("magic", "version", "codec", "dtype", "reserved", "numel", "param0", "param1", "seed", "step", "bucket")
    return dict(zip(keys, _HEADER.unpack(raw)))


def _header_bytes(codec_id, dtype_id, n, p0, p1, seed, step, bucket) -> torch.Tensor:
    raw = _HEADER.pack(MAGIC, FORMAT_VERSION, codec_id, dtype_id, 0, n, p0, p1, seed & ((1 << 64) - 1),
                       step & MASK32, bucket & MASK32)
    return torch.tensor(list(raw), dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------
# Encode
# ----------------------------------------------------------------------------------------------

def _blocks(m: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m cut into rows of `block` elements (the last zero-padded), and each row's element count."""
    n = m.numel()
    nblocks = -(-n // block)
    width = min(block, n)
    padded = torch.zeros(nblocks * width, dtype=m.dtype)
    padded[:n] = m
    lengths = torch.clamp(n - torch.arange(nblocks) * block, max=block)
    return (padded.view(nblocks, width) if n else padded.view(0, 0)), lengths


def _signsgd_body(m: torch.Tensor, block: int, norm_scale: bool = False):
    rows, lengths = _blocks(m, block)
    # per block: (double)|m| (or (double)m * m with norm_scale) summed in double lanes, divided by the
    # block's length in double (then the double square root), rounded to fp32
    rows64 = rows.double()
    totals = canonical_sum(rows64 * rows64 if norm_scale else rows64.abs())
    means = totals / lengths.double()
    scales = (sqrt_rn64(means) if norm_scale else means).to(torch.float32)
    positive = ~(m < 0)  # m >= 0, -0 and NaN all count as "+"
    elem_scale = scales[torch.arange(m.numel()) // block]
    decoded = torch.where(positive, elem_scale, -elem_scale)
    body = torch.cat([_as_bytes(scales), _pack_bits(positive)])
    return body, decoded


def _terngrad_body(m: torch.Tensor, seed, step, bucket, rank):
    n = m.numel()
    scale = _from_bits32(magnitude_key(m).max()) if n else torch.tensor(0.0)
    finite_positive = bool(scale > 0) and bool(torch.isfinite(scale))
    inverse = (torch.tensor(1.0) / scale) if finite_positive else torch.tensor(0.0)
    u = ref_uniforms(n, seed, step, bucket, rank)
    nonzero = u < m.abs() * inverse
    negative = m < 0
    q = torch.where(nonzero, torch.where(negative, -1.0, 1.0), 0.0).to(torch.float32)
    decoded = q * scale
    codes = torch.stack([nonzero, nonzero & negative], dim=1)  # bit 0 non-zero, bit 1 negative
    body = torch.cat([_as_bytes(scale.reshape(1)), _pack_bits(codes)])
    return body, decoded


def _qsgd_body(m: torch.Tensor, levels: int, block: int, seed, step, bucket, rank):
    n = m.numel()
    rows, _ = _blocks(m, block)
    rows64 = rows.double()
    norms = saturated_norm(canonical_sum(rows64 * rows64))  # exact double squares, double sum and sqrt
    s = torch.tensor(float(levels), dtype=torch.float32)
    usable = (norms > 0) & torch.isfinite(norms)
    inverse = torch.where(usable, s / torch.where(usable, norms, 1.0), 0.0)
    step_size = norms / s
    elem_block = torch.arange(n) // block
    r = m.abs() * inverse[elem_block]
    r = torch.where(r >= 0, r, 0.0)  # NaN -> 0
    r = torch.minimum(r, s)
    floor_r = torch.floor(r)
    u = ref_uniforms(n, seed, step, bucket, rank)
    level = floor_r.to(torch.int64) + (u < r - floor_r).to(torch.int64)
    negative = m < 0
    magnitude = mul_saturating(level.to(torch.float32), step_size[elem_block])
    decoded = torch.where(negative, -magnitude, magnitude)
    codes = (level << 1) | negative.to(torch.int64)
    body = torch.cat([_as_bytes(norms), _codes_to_stream(codes, qsgd_code_bits(levels))])
    return body, decoded


def _topk_select(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest magnitude keys, lower index first among equal keys, ascending."""
    order = torch.sort(magnitude_key(values), descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def _sent_values(g: torch.Tensor, m: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """M in the gradient's dtype, for topk / randomk: the fp32 sum rounded to the gradient's dtype,
    or, without a residual, the gradient itself (no arithmetic, so a NaN keeps its own bits).
    The sum m is already saturated (add_saturating); its rounding saturates too."""
    return g.clone() if residual is None else round_to_saturating(m, g.dtype)


def ref_encode(codec: str, grad: torch.Tensor, residual: torch.Tensor | None = None, *, k: int = 0,
               levels: int = 0, block: int = 0, seed: int = 0, step: int = 0, bucket: int = 0,
               rank: int = 0, norm_scale: bool = False, compact: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(payload bytes, new residual or None). Inputs are left untouched. norm_scale (signsgd): each
    block's scale is the root mean square of m instead of the mean |m| (the two-phase owner's re-encode).
    compact (topk): the compact layout; an fp32 gradient's values go as bf16, error feedback keeps what they lose."""
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}")
    dtype = grad.dtype
    if dtype not in DTYPE_IDS:
        raise ValueError(f"unsupported dtype {dtype}")
    n = grad.numel()
    p0, p1 = _params(codec, n, k, levels, block, compact)
    codec_id, dtype_id = CODEC_IDS[codec], DTYPE_IDS[dtype]
    problem = _header_problem(dict(magic=MAGIC, version=FORMAT_VERSION, codec=codec_id, dtype=dtype_id,
                                   reserved=0, numel=n, param0=p0, param1=p1))
    if problem:
        raise ValueError(f"invalid {codec} parameters: {problem}")
    g = grad.detach().reshape(-1)
    if residual is not None:
        if residual.dtype != dtype or residual.numel() != n:
            raise ValueError("residual must match the gradient's dtype and element count")
        res = residual.detach().reshape(-1)
        m = add_saturating(to_float(g), to_float(res))
    else:
        m = to_float(g).clone()

    new_residual = None
    if codec in ("none", "fp16", "bf16"):
        wire_dtype = {"none": dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[codec]
        wire = round_to_saturating(m, wire_dtype)
        body = _as_bytes(wire)
        decoded = to_float(wire)
    elif codec == "signsgd":
        body, decoded = _signsgd_body(m, p1, norm_scale)
    elif codec == "terngrad":
        body, decoded = _terngrad_body(m, seed, step, bucket, rank)
    elif codec == "qsgd":
        body, decoded = _qsgd_body(m, p0, p1, seed, step, bucket, rank)
    elif codec == "topk":
        mt = _sent_values(g, m, residual)
        idx = _topk_select(mt, p0)
        if compact:
            sent = round_to_saturating(mt[idx], torch.bfloat16) if dtype == torch.float32 else mt[idx]
            counts = torch.bincount(idx // COMPACT_SPAN, minlength=-(-n // COMPACT_SPAN)).to(torch.int32)
            low_bits = _as_bytes((idx % COMPACT_SPAN).to(torch.int32)).view(-1, 4)[:, :2]  # little-endian
            body = torch.cat([_as_bytes(counts), low_bits.reshape(-1), _as_bytes(sent)])
        else:
            sent = mt[idx]
            body = torch.cat([_as_bytes(idx.to(torch.int32)), _as_bytes(sent)])
        if residual is not None:
            lost = to_float(mt[idx]) - to_float(sent)  # exact: sent is m rounded to 16 bits, or m itself
            mt[idx] = torch.where(torch.isfinite(to_float(mt[idx])), lost, 0.0).to(dtype)
            new_residual = mt
        decoded = None
    else:  # randomk
        mt = _sent_values(g, m, residual)
        idx = ref_randomk_indices(n, p0, seed, step, bucket)
        body = _as_bytes(mt[idx])
        if residual is not None:
            mt[idx] = 0
            new_residual = mt
        decoded = None

    if residual is not None and decoded is not None:
        new_residual = round_to_saturating(sub_saturating(m, decoded), dtype)
    if new_residual is not None:
        new_residual = new_residual.view(residual.shape)

    lay = _layout(codec_id, dtype_id, n, p0, p1)
    payload = torch.zeros(lay["total"], dtype=torch.uint8)
    payload[:HEADER_BYTES] = _header_bytes(codec_id, dtype_id, n, p0, p1, seed, step, bucket)
    assert HEADER_BYTES + body.numel() == lay["end"], (codec, body.numel(), lay)
    payload[HEADER_BYTES: lay["end"]] = body
    return payload, new_residual


# ----------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------

def ref_topk_indices(payload: torch.Tensor) -> torch.Tensor | None:
    """A topk payload's k indices (int64) from either layout; None when compact counts do not add up to k."""
    h = parse_header(payload)
    lay = _layout(h["codec"], h["dtype"], h["numel"], h["param0"], h["param1"])
    k = h["param0"]
    if h["param1"] != TOPK_COMPACT:
        return _field(payload, lay["codes"], k, torch.int32).to(torch.int64)
    counts = _field(payload, HEADER_BYTES, -(-h["numel"] // COMPACT_SPAN), torch.int32).to(torch.int64) & 0xFFFFFFFF
    if int(counts.sum()) != k:
        return None
    low_bits = _field(payload, lay["codes"], k, torch.int16).to(torch.int64) & 0xFFFF
    spans = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return spans * COMPACT_SPAN + low_bits


def ref_validate(payloads: torch.Tensor) -> str | None:
    """Why a [count, bytes] stack cannot be decoded, or None."""
    if payloads.dim() == 1:
        payloads = payloads.unsqueeze(0)
    count, stride = payloads.shape
    if count < 1:
        return "no payloads to decode"
    if stride < HEADER_BYTES:
        return "payload shorter than the header (truncated)"
    h = parse_header(payloads[0])
    problem = _header_problem(h)
    if problem:
        return problem
    lay = _layout(h["codec"], h["dtype"], h["numel"], h["param0"], h["param1"])
    if stride != lay["total"]:
        return "payload size differs from its header's (truncated)"
    if not bool((payloads[:, :HEADER_BYTES] == payloads[:1, :HEADER_BYTES]).all()):
        return "headers differ"
    if CODEC_NAMES[h["codec"]] == "topk":
        k = h["param0"]
        for p in range(count):
            idx = ref_topk_indices(payloads[p])
            if idx is None:
                return f"payload {p}: the counts per span do not add up to k"
            if bool(((idx < 0) | (idx >= h["numel"])).any()):
                return f"payload {p}: index outside [0, {h['numel']})"
            if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
                return f"payload {p}: indices not strictly ascending"
    return None


def _decoded_one(payload: torch.Tensor, h: dict, lay: dict, randomk_idx: torch.Tensor | None = None,
                 alpha32: torch.Tensor | None = None) -> torch.Tensor:
    """One payload's decoded values times alpha, as a dense fp32 vector of numel elements (+0 where
    unsent). alpha is folded in first: alpha * scale (signsgd, terngrad), alpha * (norm / s)
    (qsgd's step), alpha * value (none, fp16, bf16, topk, randomk)."""
    if alpha32 is None:
        alpha32 = torch.tensor(1.0, dtype=torch.float32)
    name = CODEC_NAMES[h["codec"]]
    n, p0, p1 = h["numel"], h["param0"], h["param1"]
    dtype = DTYPES[h["dtype"]]
    if name in ("none", "fp16", "bf16"):
        wire_dtype = {"none": dtype, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
        return alpha32 * to_float(_field(payload, HEADER_BYTES, n, wire_dtype))
    if name == "signsgd":
        scales = alpha32 * _field(payload, HEADER_BYTES, -(-n // p1), torch.float32)
        scale = scales[torch.arange(n) // p1]
        positive = _unpack_bits(payload[lay["codes"]: lay["end"]], n).bool()
        return torch.where(positive, scale, -scale)
    if name == "terngrad":
        scale = alpha32 * _field(payload, HEADER_BYTES, 1, torch.float32)[0]
        codes = _stream_to_codes(payload[lay["codes"]: lay["end"]], n, 2)
        q = torch.where((codes & 1) == 1, torch.where((codes & 2) == 2, -1.0, 1.0), 0.0).to(torch.float32)
        return q * scale
    if name == "qsgd":
        nblocks = -(-n // p1)
        norms = _field(payload, HEADER_BYTES, nblocks, torch.float32)
        step_size = alpha32 * (norms / torch.tensor(float(p0), dtype=torch.float32))
        codes = _stream_to_codes(payload[lay["codes"]: lay["end"]], n, qsgd_code_bits(p0))
        magnitude = mul_saturating((codes >> 1).to(torch.float32), step_size[torch.arange(n) // p1])
        return torch.where((codes & 1) == 1, -magnitude, magnitude)
    out = torch.zeros(n, dtype=torch.float32)
    if name == "topk":
        idx = ref_topk_indices(payload)
        compact_fp32 = p1 == TOPK_COMPACT and dtype == torch.float32
        values = to_float(_field(payload, lay["values"], p0, torch.bfloat16 if compact_fp32 else dtype))
    else:
        idx = randomk_idx if randomk_idx is not None else ref_randomk_indices(n, p0, h["seed"], h["step"], h["bucket"])
        values = to_float(_field(payload, HEADER_BYTES, p0, dtype))
    out[idx] = alpha32 * values
    return out


def ref_decode_sum(payloads: torch.Tensor, out_dtype: torch.dtype, alpha: float = 1.0,
                   vote: bool = False) -> torch.Tensor:
    """Sum over the payloads, in order, of alpha * decoded payload (alpha applied to each payload
    first), accumulated in fp32 from +0 with add_saturating, then rounded to out_dtype saturating.
    With vote (signsgd): magnitude = sum over payloads of alpha * scale (fp32 add_saturating, from
    +0), and each element is
    +magnitude, -magnitude or, on a tie, 0 * magnitude."""
    if payloads.dim() == 1:
        payloads = payloads.unsqueeze(0)
    problem = ref_validate(payloads)
    if problem:
        raise ValueError(f"cannot decode: {problem}")
    h = parse_header(payloads[0])
    if DTYPES[h["dtype"]] != out_dtype:
        raise ValueError(f"out dtype {out_dtype} differs from the payload's {DTYPES[h['dtype']]}")
    name = CODEC_NAMES[h["codec"]]
    if vote and name != "signsgd":
        raise ValueError("vote applies to signsgd payloads only")
    lay = _layout(h["codec"], h["dtype"], h["numel"], h["param0"], h["param1"])
    n = h["numel"]
    alpha32 = torch.tensor(alpha, dtype=torch.float32)
    if vote:
        block = h["param1"]
        magnitude = torch.zeros(-(-n // block), dtype=torch.float32)  # per block
        votes = torch.zeros(n, dtype=torch.int64)
        for p in range(payloads.shape[0]):
            magnitude = add_saturating(magnitude, alpha32 * _field(payloads[p], HEADER_BYTES, magnitude.numel(),
                                                                   torch.float32))
            votes += _unpack_bits(payloads[p, lay["codes"]: lay["end"]], n) * 2 - 1
        magnitude = magnitude[torch.arange(n) // block]
        tie = torch.tensor(0.0, dtype=torch.float32) * magnitude
        result = torch.where(votes > 0, magnitude, torch.where(votes < 0, -magnitude, tie))
        return round_to_saturating(result.to(torch.float32), out_dtype)
    idx = ref_randomk_indices(n, h["param0"], h["seed"], h["step"], h["bucket"]) if name == "randomk" else None
    acc = torch.zeros(n, dtype=torch.float32)
    for p in range(payloads.shape[0]):
        acc = add_saturating(acc, _decoded_one(payloads[p], h, lay, idx, alpha32))
    return round_to_saturating(acc, out_dtype)
