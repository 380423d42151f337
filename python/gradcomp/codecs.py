"""Codecs by name: spec parsing, parameters and the Python face of the native ops.

A codec turns a flat gradient (plus an optional error-feedback residual, updated in place) into
a payload, and sums decoded payloads into an output tensor. Every codec except powersgd speaks
the wire format of csrc/common/wire.h: one uint8 payload with a 48-byte header.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from . import _ops

HEADER_BYTES = _ops._C.header_bytes
SUPPORTED_DTYPES = tuple(_ops.DTYPE_IDS)

# name -> (class, {parameter: default}, one-line description)
_REGISTRY: dict[str, tuple[type, dict[str, Any], str]] = {}


def _register(name: str, defaults: dict[str, Any], description: str):
    def wrap(cls):
        cls.name = name
        _REGISTRY[name] = (cls, defaults, description)
        return cls

    return wrap


def available() -> dict[str, dict[str, Any]]:
    """Every codec name with its parameters and their defaults."""
    return {name: dict(defaults) for name, (_, defaults, _) in _REGISTRY.items()}


def describe() -> str:
    """A table of the codecs, their defaults and what travels on the wire."""
    lines = []
    for name, (_, defaults, description) in _REGISTRY.items():
        params = ", ".join(f"{k}={v}" for k, v in defaults.items()) or "-"
        lines.append(f"{name:9s} {params:62s} {description}")
    return "\n".join(lines)


def _parse_value(codec: str, key: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        pass
    raise ValueError(f"{codec}: cannot read {key}={text!r} as {type(default).__name__}")


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """'qsgd:levels=16,block=512' -> ('qsgd', {'levels': 16, 'block': 512})."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a codec spec is a non-empty string such as 'topk:ratio=0.01', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in _REGISTRY:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(_REGISTRY)}")
    defaults = _REGISTRY[name][1]
    params: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{name}: expected key=value in the spec, got {item!r}")
        if key not in defaults:
            raise ValueError(f"{name}: unknown parameter {key!r}; valid parameters: {', '.join(defaults) or 'none'}")
        if key in params:
            raise ValueError(f"{name}: parameter {key!r} is given twice in the spec {spec!r}")
        params[key] = _parse_value(name, key, value, defaults[key])
    return name, params


def codec(spec: str, **params: Any) -> "Codec":
    """Builds a codec from a name or spec string; keyword parameters override the spec's."""
    name, parsed = parse_spec(spec)
    parsed.update(params)
    cls, defaults, _ = _REGISTRY[name]
    unknown = set(parsed) - set(defaults)
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter(s) {', '.join(sorted(unknown))}; valid parameters: {', '.join(defaults) or 'none'}"
        )
    return cls(**{**defaults, **parsed})


def _check_range(codec_name: str, key: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    not_a_number = isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and math.isnan(value))  # an int too large for a float still compares
    if not_a_number or (value <= low if low_open else value < low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{codec_name}: {key}={value!r} is outside {bracket}{low}, {high}]")


def _check_seed(codec_name: str, seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{codec_name}: seed={seed!r} must be an integer in [0, 2^63)")
    return seed


def _check_u32(codec_name: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"{codec_name}: {key}={value!r} must be an integer in [0, 2^32)")
    return value


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """(start, end) of each of the W chunks of the two-phase scheme: numel // W elements each, one more for the
    first numel % W (torch.tensor_split's rule, and chunk_range's in csrc/torch/ops.cpp)."""
    base, extra = divmod(numel, world)
    bounds, start = [], 0
    for j in range(world):
        end = start + base + (j < extra)
        bounds.append((start, end))
        start = end
    return bounds


def count_for_ratio(ratio: float, numel: int) -> int:
    """k = ceil(ratio * numel) with ratio read as its shortest decimal, at least 1 when numel > 0."""
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(Fraction(repr(float(ratio))) * numel)))


class Codec:
    """Base of every codec: a name, its parameters, and how its payloads travel."""

    name = "?"
    collective = "allgather"  # or "allreduce": payload bodies can be summed elementwise
    error_feedback = False

    def __init__(self, error_feedback: bool = False, **params: Any):
        if not isinstance(error_feedback, bool):
            raise ValueError(f"{self.name}: error_feedback must be True or False, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.params = dict(params)
        if "error_feedback" in _REGISTRY[self.name][1]:
            self.params["error_feedback"] = error_feedback

    def spec(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.name}:{params}" if params else self.name

    def __repr__(self) -> str:
        return f"gradcomp.codec({self.spec()!r})"


class PayloadCodec(Codec):
    """A codec that speaks the wire format through torch.ops.gradcomp.encode / decode_sum."""

    seed = 0
    vote = False

    def wire_params(self, numel: int) -> tuple[int, int]:
        return 0, 0

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of one payload (header and padding included) for numel elements of dtype."""
        if dtype not in _ops.DTYPE_IDS:
            raise ValueError(f"{self.name}: unsupported dtype {dtype}; supported: {SUPPORTED_DTYPES}")
        return _ops._C.payload_nbytes(self.name, _ops.DTYPE_IDS[dtype], numel, *self.wire_params(numel))

    def encode(self, grad: torch.Tensor, residual: torch.Tensor | None = None, *, step: int = 0,
               bucket: int = 0, rank: int = 0) -> torch.Tensor:
        """Payload of grad (+ residual); with a residual, leaves grad + residual - decoded in it."""
        for key, value in (("step", step), ("bucket", bucket), ("rank", rank)):
            _check_u32(self.name, key, value)
        p0, p1 = self.wire_params(grad.numel())
        return torch.ops.gradcomp.encode(grad, residual, self.name, p0, p1, self.seed, step, bucket, rank)

    def decode_sum(self, payloads: torch.Tensor, out: torch.Tensor, alpha: float = 1.0, *,
                   status: torch.Tensor | None = None) -> torch.Tensor:
        """out = the sum of alpha times each decoded payload ([count, bytes] or one [bytes]); returns out.

        The payloads must be this codec's, with its parameters. On the CPU a malformed payload
        raises at once. On CUDA the payloads are checked on the device: without status that check is
        read here (one host-device sync) and raises; with status (one int32 on out's device) its
        problem bits are OR-ed into status for the caller to read when it chooses, and out becomes NaN.
        """
        p0, p1 = self.wire_params(out.numel())
        torch.ops.gradcomp.decode_sum(payloads, out, alpha, self.vote, self.name, p0, p1, status)
        return out

    # The two-phase scheme (schemes/two_phase.py) in three ops: a bucket cut into `world` balanced chunks
    # (chunk_bounds), each its own payload.
    def chunk_params(self, numel: int, world: int) -> tuple[list[int], int]:
        """(param0 of each chunk, the param1 they share)."""
        params = [self.wire_params(end - start) for start, end in chunk_bounds(numel, world)]
        return [p0 for p0, _ in params], params[0][1]

    def encode_chunks(self, grad: torch.Tensor, residual: torch.Tensor | None, world: int, *, step: int = 0,
                      bucket: int = 0, first_rank: int = 0) -> torch.Tensor:
        """encode() of each chunk, chunk j with rank key first_rank + j, the payloads back to back."""
        param0s, param1 = self.chunk_params(grad.numel(), world)
        return torch.ops.gradcomp.encode_chunks(grad, residual, self.name, param0s, param1, self.seed, step, bucket,
                                                first_rank)

    def reencode_sum(self, payloads: torch.Tensor, average: torch.Tensor, residual: torch.Tensor | None,
                     alpha: float, *, step: int = 0, bucket: int = 0, rank: int = 0,
                     status: torch.Tensor | None = None) -> torch.Tensor:
        """decode_sum(payloads, average, alpha), then the payload of average (+ residual). signsgd summing
        signs re-encodes with each block's root mean square as its scale, not mean |m| (csrc/cpu/signsgd.cpp)."""
        p0, p1 = self.wire_params(average.numel())
        return torch.ops.gradcomp.reencode_sum(payloads, average, residual, alpha, self.vote, self.name, p0, p1,
                                               self.seed, step, bucket, rank, status)

    def decode_chunks(self, rows: torch.Tensor, out: torch.Tensor, *, status: torch.Tensor | None = None) -> None:
        """Chunk j of out = the payload at the start of rows[j] (decode_sum's checks, per chunk)."""
        param0s, param1 = self.chunk_params(out.numel(), rows.shape[0])
        torch.ops.gradcomp.decode_chunks(rows, out, self.vote, self.name, param0s, param1, status)

    def summable_view(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """For allreduce codecs: the payload's values as a tensor an allreduce can sum in place."""
        if self.collective != "allreduce":
            raise ValueError(f"{self.name} payloads are gathered, not summed")
        wire = self.wire_dtype(dtype)
        return payload[HEADER_BYTES : HEADER_BYTES + self.value_count(numel) * wire.itemsize].view(wire)

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def value_count(self, numel: int) -> int:
        """How many values an allreduce codec's body holds for numel gradient elements."""
        return numel

    # What carries the non-finite verdict. Every payload shows a NaN or Inf of gradient + residual, or of
    # the codec's own arithmetic, in a field that keeps it: allgather codecs in their scales, norms or
    # values (magnitude_fields); allreduce codecs in the summed values themselves, plus flag_count values
    # for a codec whose values do not cover every element (randomk).
    flag_count = 0

    def magnitude_fields(self, payloads: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """For allgather codecs: the fields of [count, bytes] payloads that are non-finite when what a rank
        encoded was (views, no copy)."""
        raise ValueError(f"{self.name} payloads are summed, not gathered")

    def with_flag(self, values: torch.Tensor, compressed: torch.Tensor) -> torch.Tensor:
        """For allreduce codecs: what to allreduce (values, and any flag for what they leave out of
        compressed, the tensor the encode took its values from)."""
        return values

    def apply_flag(self, summed: torch.Tensor, values: torch.Tensor) -> None:
        """After the allreduce: puts the summed values (made NaN by a raised flag) where decode reads them."""


def _float_fields(payloads: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """count values of dtype at byte offset of every payload row, as a [rows, count] view."""
    size = torch.empty((), dtype=dtype).element_size()
    return payloads.view(-1, payloads.shape[-1])[:, offset: offset + count * size].view(dtype)


@_register("none", {}, "n values in the gradient's dtype; allreduce (plain DDP)")
class NoCompression(PayloadCodec):
    collective = "allreduce"


@_register("fp16", {"error_feedback": False}, "n fp16 values (round to nearest even); allreduce")
class Fp16(PayloadCodec):
    collective = "allreduce"

    def wire_dtype(self, dtype):
        return torch.float16


@_register("bf16", {"error_feedback": False}, "n bf16 values (round to nearest even); allreduce")
class Bf16(PayloadCodec):
    collective = "allreduce"

    def wire_dtype(self, dtype):
        return torch.bfloat16


@_register("signsgd", {"vote": False, "block": 256, "error_feedback": True},
           "n sign bits + fp32 mean |g| per block; allgather, sum of scaled signs or majority vote")
class SignSGD(PayloadCodec):
    block = _ops._C.max_block  # a signsgd pickled before the block option: one scale per bucket, as it had

    def __init__(self, vote: bool = False, block: int = 256, error_feedback: bool = True):
        if not isinstance(vote, bool):
            raise ValueError(f"signsgd: vote must be True or False, got {vote!r}")
        if isinstance(block, bool) or not isinstance(block, int):
            raise ValueError(f"signsgd: block must be an integer, got block={block!r}")
        _check_range("signsgd", "block", block, 1, _ops._C.max_block)
        super().__init__(error_feedback, vote=vote, block=block)
        self.vote, self.block = vote, block

    def wire_params(self, numel):
        return 0, self.block

    def magnitude_fields(self, payloads, numel, dtype):
        return _float_fields(payloads, HEADER_BYTES, -(-numel // self.block), torch.float32)  # the block scales


@_register("terngrad", {"seed": 0, "error_feedback": False},
           "2n bits + fp32 max |g|, stochastic and unbiased; allgather")
class TernGrad(PayloadCodec):
    def __init__(self, seed: int = 0, error_feedback: bool = False):
        super().__init__(error_feedback, seed=seed)
        self.seed = _check_seed(self.name, seed)

    def magnitude_fields(self, payloads, numel, dtype):
        return _float_fields(payloads, HEADER_BYTES, 1, torch.float32)  # the scale, max |m|


@_register("qsgd", {"levels": 15, "block": 512, "seed": 0, "error_feedback": False},
           "sign + level per element, fp32 norm per block, stochastic and unbiased; allgather")
class QSGD(PayloadCodec):
    def __init__(self, levels: int = 15, block: int = 512, seed: int = 0, error_feedback: bool = False):
        _check_range("qsgd", "levels", levels, 1, _ops._C.max_levels)
        _check_range("qsgd", "block", block, 1, _ops._C.max_block)
        if not (isinstance(levels, int) and isinstance(block, int)):
            raise ValueError(f"qsgd: levels and block must be integers, got levels={levels!r}, block={block!r}")
        super().__init__(error_feedback, levels=levels, block=block, seed=seed)
        self.levels, self.block, self.seed = levels, block, _check_seed(self.name, seed)

    def wire_params(self, numel):
        return self.levels, self.block

    def magnitude_fields(self, payloads, numel, dtype):
        return _float_fields(payloads, HEADER_BYTES, -(-numel // self.block), torch.float32)  # the block norms


@_register("topk", {"ratio": 0.01, "error_feedback": True, "compact": False},
           "k = ceil(ratio*n) largest |g|: k int32 indices + k values, or compact: 16-bit indices within spans "
           "of 65536 + 16-bit values (bf16 for fp32), half the bytes; allgather")
class TopK(PayloadCodec):
    compact = False  # a topk pickled before the compact option sends the wide layout, as it did

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, compact: bool = False):
        _check_range("topk", "ratio", ratio, 0, 1, low_open=True)
        if not isinstance(compact, bool):
            raise ValueError(f"topk: compact must be True or False, got {compact!r}")
        # compact named only when on: the spec (and the configuration checkpoints hold) of a wide topk is as it was
        super().__init__(error_feedback, ratio=float(ratio), **({"compact": True} if compact else {}))
        self.ratio, self.compact = float(ratio), compact

    def wire_params(self, numel):
        return count_for_ratio(self.ratio, numel), _ops._C.topk_compact if self.compact else _ops._C.topk_wide

    def magnitude_fields(self, payloads, numel, dtype):
        k = count_for_ratio(self.ratio, numel)  # NaN and Inf rank above every finite |m|: they are sent
        if not self.compact:
            return _float_fields(payloads, HEADER_BYTES + 4 * k, k, dtype)  # the values, after k int32 indices
        spans = -(-numel // _ops._C.topk_compact_span)  # after the counts and k 16-bit indices
        value_dtype = torch.bfloat16 if dtype == torch.float32 else dtype
        return _float_fields(payloads, HEADER_BYTES + 4 * spans + 2 * k, k, value_dtype)


@_register("randomk", {"ratio": 0.01, "seed": 0, "error_feedback": True},
           "k = ceil(ratio*n) values at indices shared by all ranks (seeded); allreduce")
class RandomK(PayloadCodec):
    collective = "allreduce"

    def __init__(self, ratio: float = 0.01, seed: int = 0, error_feedback: bool = True):
        _check_range("randomk", "ratio", ratio, 0, 1, low_open=True)
        super().__init__(error_feedback, ratio=float(ratio), seed=seed)
        self.ratio, self.seed = float(ratio), _check_seed(self.name, seed)

    def wire_params(self, numel):
        return count_for_ratio(self.ratio, numel), 0

    def value_count(self, numel):
        return count_for_ratio(self.ratio, numel)

    flag_count = 1  # the unsent elements' verdict: 0, or NaN when one of them is not finite

    def with_flag(self, values, compressed):
        summed = torch.empty(values.numel() + 1, dtype=values.dtype, device=values.device)
        summed[:-1].copy_(values)
        summed[-1:].copy_(torch.where(torch.isfinite(compressed).all(), 0.0, float("nan")).reshape(1))
        return summed

    def apply_flag(self, summed, values):
        torch.mul(summed[:-1], summed[-1:] + 1, out=values)  # times exactly 1, or NaN
