"""Kernel throughput of every gradcomp codec against copy_ and the pure-PyTorch references.

For each codec and bucket size this measures, in one run and on one thread (by default):
  encode     c.encode(grad, residual, step=s): error feedback on, residual updated in place
  decode     c.decode_sum(payload, out) of one payload
  decode x4  c.decode_sum(payloads, out, 1/4) of four payloads stacked as [4, bytes]
  copy_      dst.copy_(src) of an fp32 tensor of the same size: the memory-bandwidth limit
  reference  ref_encode / ref_decode_sum from tests/python/reference.py (pure PyTorch);
             topk is also timed against torch.topk(x.abs(), k), both with error feedback and
             without it (no residual: the same work as torch.topk), and powersgd (whose encode
             column is one whole roundtrip step on a matrix view) against a plain torch
             composition of the same steps written below.
The PowerSGD hook step: DDP on one rank (gloo on the CPU, NCCL on a GPU) with ResNet-18's 62
parameter shapes (11.2M elements; the loss is linear in them, so the backward pass costs next to
nothing), 25 MB buckets on a GPU and one bucket on the CPU (see hook_step_bucket_cap_mb), timed
per step with torch's powerSGD_hook and with gradcomp's powersgd at the same rank, warm start and
error feedback, on the same buckets; the step of a hook that communicates nothing is subtracted,
leaving each hook's own time.

Throughputs are GB/s of gradient: fp32 gradient bytes (1 GB = 1e9 bytes) over the median time;
decode x4 counts the four gradients it sums. Sizes are in MB of 2^20 bytes, as DDP's
bucket_cap_mb (25 MB = 6,553,600 fp32 elements).

    python benchmarks/kernels.py                  # 25 MB bucket + sweep 1..256 MB (a few minutes)
    python benchmarks/kernels.py --quick          # 4 MB only, few repetitions (under a minute)
    python benchmarks/kernels.py --device cuda    # the same on a GPU

Writes <out-dir>/<tag>.json, .csv and .png (default benchmarks/results/kernels_<device>.*;
--quick defaults to the tag kernels_<device>_quick so that it never overwrites a full run).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

import gradcomp

REPO = Path(__file__).resolve().parents[1]
REFERENCE_DIR = REPO / "tests" / "python"
DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "results"

MB = 2**20
GB = 1e9
FP32_BYTES = 4
BUCKET_MB = 25.0
SWEEP_MB = (1.0, 4.0, 16.0, 64.0, 256.0)
QUICK_MB = (4.0,)
DECODE_FAN_IN = 4  # payloads stacked for the second decode column
CODEC_SPECS = (
    "none", "fp16", "bf16", "signsgd", "terngrad", "qsgd",
    "topk:ratio=0.01", "topk:ratio=0.01,compact=true", "topk:ratio=0.001", "randomk:ratio=0.01", "powersgd:rank=4",
)
# The reference's keyword arguments that carry a codec's two wire parameters (wire_params).
# None: a wire parameter the codec leaves at 0.
REFERENCE_WIRE_KEYWORDS = {"topk": ("k", "compact"), "randomk": ("k",), "qsgd": ("levels", "block"),
                           "signsgd": (None, "block")}


# --------------------------------------------------------------------------------------- timing

@dataclass(frozen=True)
class Repetitions:
    """How long to time one measurement, after one warm-up call.

    Repeats until there are min_reps samples and min_seconds of them, but stops at max_reps samples
    or max_seconds (with one sample at least). A warm-up longer than warmup_is_sample_above seconds
    is taken as the only sample: for seconds-long calls first-call costs are negligible.
    """

    min_seconds: float
    min_reps: int
    max_reps: int
    max_seconds: float
    warmup_is_sample_above: float | None = None

    def enough(self, samples: list[float]) -> bool:
        total = sum(samples)
        return (len(samples) >= self.max_reps
                or (len(samples) >= self.min_reps and total >= self.min_seconds)
                or (len(samples) >= 1 and total >= self.max_seconds))


@dataclass(frozen=True)
class Timer:
    device: torch.device
    library: Repetitions  # gradcomp and copy_
    reference: Repetitions  # the slow pure-PyTorch references

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self, fn: Callable[[], object]) -> float:
        self.synchronize()
        start = time.perf_counter()
        fn()
        self.synchronize()
        return time.perf_counter() - start

    def median_seconds(self, fn: Callable[[], object], reps: Repetitions) -> float:
        """Median wall time of fn after a warm-up call (which also faults in its memory)."""
        warmup = self.seconds(fn)
        if reps.warmup_is_sample_above is not None and warmup > reps.warmup_is_sample_above:
            return warmup
        samples: list[float] = []
        while not reps.enough(samples):
            samples.append(self.seconds(fn))
        return statistics.median(samples)

    def gbps(self, gradient_bytes: int, fn: Callable[[], object], *, reference: bool = False) -> float:
        """Throughput of fn in GB/s of gradient."""
        seconds = self.median_seconds(fn, self.reference if reference else self.library)
        return gradient_bytes / seconds / GB


# ------------------------------------------------------------------------------------- results

def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def rounded(value):
    """Floats to 4 significant digits (timings are not more precise than that); others unchanged."""
    return float(f"{value:.4g}") if isinstance(value, float) else value


@dataclass
class Row:
    """One codec at one size; throughputs in GB/s of gradient, None where not measured."""

    codec: str  # the spec as asked for, e.g. 'topk:ratio=0.001'
    full_spec: str  # every parameter, defaults included
    size_mb: float
    numel: int
    wire_bytes: int
    encode_gbps: float
    decode_gbps: float | None
    decode4_gbps: float | None
    copy_gbps: float
    ref_encode_gbps: float | None = None
    ref_decode_gbps: float | None = None
    torch_topk_gbps: float | None = None
    encode_no_ef_gbps: float | None = None  # topk: encode without a residual, the work torch.topk does
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        record = asdict(self)
        record["notes"] = "; ".join(self.notes)
        record.update(
            enc_over_copy=ratio(self.encode_gbps, self.copy_gbps),
            dec_over_copy=ratio(self.decode_gbps, self.copy_gbps),
            enc_over_ref=ratio(self.encode_gbps, self.ref_encode_gbps),
            dec_over_ref=ratio(self.decode_gbps, self.ref_decode_gbps),
            enc_over_torch_topk=ratio(self.encode_gbps, self.torch_topk_gbps),
            enc_no_ef_over_torch_topk=ratio(self.encode_no_ef_gbps, self.torch_topk_gbps),
        )
        return {key: rounded(value) for key, value in record.items()}


# ------------------------------------------------------------------------------------ reference

def load_reference(device: torch.device) -> tuple[ModuleType | None, str]:
    """tests/python/reference.py, or None and why not."""
    if device.type != "cpu":  # it builds its tensors (and float64 sums) on the host, as the CPU kernels do
        return None, f"reference not timed on {device}: tests/python/reference.py runs on the CPU only"
    if str(REFERENCE_DIR) not in sys.path:
        sys.path.insert(0, str(REFERENCE_DIR))
    try:
        module = importlib.import_module("reference")
    except ImportError as error:
        return None, f"reference unavailable ({REFERENCE_DIR / 'reference.py'}: {error})"
    missing = [name for name in ("ref_encode", "ref_decode_sum") if not hasattr(module, name)]
    if missing:
        return None, f"reference unavailable ({module.__file__} lacks {', '.join(missing)})"
    return module, f"reference: {module.__file__}"


def reference_keywords(codec: gradcomp.PayloadCodec, numel: int) -> dict:
    """The codec's parameters as ref_encode's keyword arguments."""
    wire = {key: value for key, value in zip(REFERENCE_WIRE_KEYWORDS.get(codec.name, ()), codec.wire_params(numel))
            if key is not None}
    return {**wire, "seed": codec.seed}


def try_reference(row: Row, what: str, measure: Callable[[], float]) -> float | None:
    """A reference throughput, or None with a note when the reference fails (it is still evolving)."""
    try:
        return measure()
    except Exception as error:  # noqa: BLE001 - any failure of the reference is reported, not fatal
        note = f"{what} failed: {type(error).__name__}: {error}".splitlines()[0][:200]
        print(f"  warning: {row.codec} {row.size_mb:g} MB: {note}", file=sys.stderr)
        row.notes.append(note)
        return None


def gram_schmidt(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Orthonormal columns of p, column by column with plain torch ops."""
    columns: list[torch.Tensor] = []
    for j in range(p.shape[1]):
        column = p[:, j]
        for previous in columns:
            column = column - (previous @ column) * previous
        columns.append(column / column.norm().clamp_min(eps))
    return torch.stack(columns, dim=1)


def powersgd_reference_step(grad: torch.Tensor, residual: torch.Tensor, q: torch.Tensor):
    """One PowerSGD step (world of one) as a plain torch composition: (out, new residual, new Q)."""
    m = grad + residual
    p = gram_schmidt(m @ q)
    q = m.t() @ p
    out = p @ q.t()
    return out, m - out, q


# ------------------------------------------------------------------------------------- measures

def matrix_shape(numel: int) -> tuple[int, int]:
    """The most nearly square rows x cols = numel with rows >= cols, like a layer's weight."""
    cols = next(c for c in range(math.isqrt(numel), 0, -1) if numel % c == 0)
    return numel // cols, cols


def measure_copy(timer: Timer, grad: torch.Tensor) -> float:
    destination = torch.empty_like(grad)
    return timer.gbps(grad.numel() * FP32_BYTES, lambda: destination.copy_(grad))


def measure_payload_codec(timer: Timer, label: str, codec: gradcomp.PayloadCodec, grad: torch.Tensor,
                          copy_gbps: float, size_mb: float, reference: ModuleType | None,
                          with_reference: bool) -> Row:
    nbytes = grad.numel() * FP32_BYTES
    residual = torch.zeros_like(grad)
    out = torch.empty_like(grad)
    steps = itertools.count()
    payloads = torch.stack([codec.encode(grad, step=0, rank=rank) for rank in range(DECODE_FAN_IN)])
    row = Row(
        codec=label, full_spec=codec.spec(), size_mb=size_mb, numel=grad.numel(), wire_bytes=payloads.shape[1],
        encode_gbps=timer.gbps(nbytes, lambda: codec.encode(grad, residual, step=next(steps))),
        decode_gbps=timer.gbps(nbytes, lambda: codec.decode_sum(payloads[0], out)),
        decode4_gbps=timer.gbps(DECODE_FAN_IN * nbytes,
                                lambda: codec.decode_sum(payloads, out, 1.0 / DECODE_FAN_IN)),
        copy_gbps=copy_gbps,
    )
    if with_reference and reference is not None:
        add_payload_reference(timer, row, codec, grad, payloads[0], reference)
    if with_reference and codec.name == "topk":
        k = codec.wire_params(grad.numel())[0]
        row.torch_topk_gbps = timer.gbps(nbytes, lambda: torch.topk(grad.abs(), k), reference=True)
        row.encode_no_ef_gbps = timer.gbps(nbytes, lambda: codec.encode(grad))
    return row


def add_payload_reference(timer: Timer, row: Row, codec: gradcomp.PayloadCodec, grad: torch.Tensor,
                          payload: torch.Tensor, reference: ModuleType) -> None:
    """ref_encode with a residual, and ref_decode_sum of the library's payload (same wire format)."""
    nbytes = grad.numel() * FP32_BYTES
    keywords = reference_keywords(codec, grad.numel())
    residual = torch.zeros_like(grad)
    steps = itertools.count()
    vote = getattr(codec, "vote", False)
    row.ref_encode_gbps = try_reference(row, "ref_encode", lambda: timer.gbps(
        nbytes, lambda: reference.ref_encode(codec.name, grad, residual, step=next(steps), **keywords),
        reference=True))
    row.ref_decode_gbps = try_reference(row, "ref_decode_sum", lambda: timer.gbps(
        nbytes, lambda: reference.ref_decode_sum(payload.unsqueeze(0), grad.dtype, 1.0, vote=vote),
        reference=True))


def measure_powersgd(timer: Timer, label: str, codec: gradcomp.PowerSGD, grad: torch.Tensor, copy_gbps: float,
                     size_mb: float, with_reference: bool) -> Row:
    """One roundtrip step (compress and decompress, error feedback on) timed as the encode column."""
    shape = matrix_shape(grad.numel())
    matrix = grad.view(shape)
    nbytes = grad.numel() * FP32_BYTES
    residual = torch.zeros_like(matrix)
    q = codec.initial_q(shape, device=grad.device)
    out = torch.empty_like(matrix)
    row = Row(
        codec=label, full_spec=codec.spec(), size_mb=size_mb, numel=grad.numel(),
        wire_bytes=codec.payload_nbytes(shape),
        encode_gbps=timer.gbps(nbytes, lambda: codec.roundtrip(matrix, residual, q, out)),
        decode_gbps=None, decode4_gbps=None, copy_gbps=copy_gbps,
        notes=[f"matrix {shape[0]}x{shape[1]}; encode = one roundtrip step, decode not separate"],
    )
    if with_reference:
        reference_residual, reference_q = torch.zeros_like(matrix), q.clone()
        row.ref_encode_gbps = timer.gbps(
            nbytes, lambda: powersgd_reference_step(matrix, reference_residual, reference_q), reference=True)
    return row


def measure_size(timer: Timer, codecs: dict[str, gradcomp.Codec], size_mb: float,
                 reference: ModuleType | None, with_reference: bool) -> list[Row]:
    numel = int(size_mb * MB) // FP32_BYTES
    generator = torch.Generator().manual_seed(numel)
    grad = torch.randn(numel, generator=generator).to(timer.device)
    copy_gbps = measure_copy(timer, grad)
    rows = []
    for label, codec in codecs.items():
        if isinstance(codec, gradcomp.PowerSGD):
            row = measure_powersgd(timer, label, codec, grad, copy_gbps, size_mb, with_reference)
        else:
            row = measure_payload_codec(timer, label, codec, grad, copy_gbps, size_mb, reference, with_reference)
        if not with_reference:
            row.notes.append("reference skipped (--skip-reference-above)")
        print(format_row(row), flush=True)
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------- output

def text_cell(value) -> str:
    return str(value)


def size_cell(value: float) -> str:
    return f"{value:g}"


def number_cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


TABLE_COLUMNS = (  # heading, key of Row.to_dict(), width, formatter; the first column is left-aligned
    ("codec", "codec", 28, text_cell),
    ("MB", "size_mb", 5, size_cell),
    ("enc GB/s", "encode_gbps", 9, number_cell),
    ("dec GB/s", "decode_gbps", 9, number_cell),
    ("dec4 GB/s", "decode4_gbps", 9, number_cell),
    ("copy_ GB/s", "copy_gbps", 10, number_cell),
    ("enc/copy", "enc_over_copy", 8, number_cell),
    ("dec/copy", "dec_over_copy", 8, number_cell),
    ("enc/ref", "enc_over_ref", 8, number_cell),
    ("dec/ref", "dec_over_ref", 8, number_cell),
    ("enc/torch.topk", "enc_over_torch_topk", 14, number_cell),
    ("no-EF/torch.topk", "enc_no_ef_over_torch_topk", 16, number_cell),
)


def table_line(cells: list[str]) -> str:
    widths = [width for _, _, width, _ in TABLE_COLUMNS]
    return "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                     for i, (cell, width) in enumerate(zip(cells, widths)))


def format_header() -> str:
    return table_line([heading for heading, _, _, _ in TABLE_COLUMNS])


def format_row(row: Row) -> str:
    record = row.to_dict()
    return table_line([formatter(record[key]) for _, key, _, formatter in TABLE_COLUMNS])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews the timings."""
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except OSError:
        return None


def machine_description(device: torch.device) -> dict:
    description = {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "gradcomp_version": gradcomp.__version__,
        "gradcomp_cpu_variant": gradcomp.cpu_isa(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "git_commit": git_commit(),
        "load_average_at_start": load_average(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        description["gpu_model"] = torch.cuda.get_device_name(device)
        description["cuda_version"] = torch.version.cuda
    return description


def write_json(path: Path, machine: dict, settings: dict, rows: list[Row], hook_step: dict | None) -> None:
    document = {
        "machine": machine,
        "settings": settings,
        "units": {
            "size_mb": "2^20 bytes of fp32 gradient",
            "*_gbps": "GB/s of fp32 gradient (1e9 bytes); decode4 counts the 4 gradients it sums",
            "wire_bytes": "bytes of one payload (header included); powersgd: P and Q",
        },
        "results": [row.to_dict() for row in rows],
        "powersgd_hook_step": hook_step,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_csv(path: Path, rows: list[Row]) -> None:
    records = [row.to_dict() for row in rows]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in record.items()} for record in records)


def write_plot(path: Path, rows: list[Row], machine: dict) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("warning: matplotlib is not installed (pip install matplotlib); no plot written", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(9, 6))
    copy_by_size = sorted({(row.size_mb, row.copy_gbps) for row in rows})
    axes.plot(*zip(*copy_by_size), "k--", linewidth=2.5, label="copy_ (memory bandwidth)")
    for codec in dict.fromkeys(row.codec for row in rows):
        points = sorted((row.size_mb, row.encode_gbps) for row in rows if row.codec == codec)
        axes.plot(*zip(*points), marker="o", label=codec)
    axes.set_xscale("log", base=2)
    sizes = [size for size, _ in copy_by_size]
    axes.set_xticks(sizes, [f"{size:g}" for size in sizes])
    axes.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes.set_yscale("log")
    axes.set_xlabel("bucket size (MB of fp32 gradient, 1 MB = 2^20 bytes)")
    axes.set_ylabel("encode throughput with error feedback (GB/s of gradient)")
    axes.set_title(f"gradcomp encode throughput, {machine['device']}, {machine['torch_threads']} thread(s)\n"
                   f"{machine.get('gpu_model', machine['cpu_model'])}", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# ----------------------------------------------------------------------------- PowerSGD hook step

HOOK_STEP_RANK = 4  # as the codec row "powersgd:rank=4"
HOOK_STEP_WARMUP, HOOK_STEP_STEPS = 4, 12


def network_benchmark() -> ModuleType:
    """benchmarks/network.py: its ResNet-18 and its no-communication hook."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module("network")


class LinearInParameters(torch.nn.Module):
    """Parameters of the given shapes and a loss linear in them: the backward pass is nearly free,
    so a step's time is DDP's and its hook's."""

    def __init__(self, shapes):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.01) for s in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w * x).sum() for w in self.weights)


def hook_step_bucket_cap_mb(device: torch.device) -> float:
    """DDP's default 25 MB buckets on a GPU; one bucket on the CPU, where torch's powerSGD_hook can
    hang or abort gloo with several (it starts Q's allreduce from P's callback, in no fixed order)."""
    return 25.0 if device.type == "cuda" else 1024.0


def hook_step_seconds(device: torch.device, timer: Timer, shapes, attach: Callable, steps: int) -> float:
    """Median step time (zero_grad, backward with the hook, the wait for it) of a fresh DDP model."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = LinearInParameters(shapes).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index or 0] if device.type == "cuda" else None,
                                  bucket_cap_mb=hook_step_bucket_cap_mb(device))
    attach(ddp)
    x = torch.ones((), device=device)

    def step():
        ddp.zero_grad(set_to_none=False)
        ddp(x).backward()

    for _ in range(HOOK_STEP_WARMUP):  # past DDP's bucket rebuild and the hooks' plain first steps
        timer.seconds(step)
    return statistics.median(timer.seconds(step) for _ in range(steps))


def measure_powersgd_hooks(device: torch.device, timer: Timer, quick: bool) -> dict:
    """Hook time per step of torch's powerSGD_hook and gradcomp's powersgd on the same buckets."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    rank, steps = HOOK_STEP_RANK, 3 if quick else HOOK_STEP_STEPS
    network = network_benchmark()
    shapes = [p.shape for p in network.resnet18().parameters()]

    def nothing(ddp):
        ddp.register_comm_hook(None, network.no_communication)

    def torch_powersgd(ddp):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=2, min_compression_rate=2, warm_start=True,
                                            use_error_feedback=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def gradcomp_powersgd(ddp):
        gradcomp.register(ddp, f"powersgd:rank={rank}", start_iter=2)

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}/store",
                                rank=0, world_size=1)
        try:
            base = hook_step_seconds(device, timer, shapes, nothing, steps)
            torch_s = hook_step_seconds(device, timer, shapes, torch_powersgd, steps) - base
            gradcomp_s = hook_step_seconds(device, timer, shapes, gradcomp_powersgd, steps) - base
        finally:
            dist.destroy_process_group()
    return {"rank": rank, "parameters": "ResNet-18 shapes", "steps": steps,
            "bucket_cap_mb": hook_step_bucket_cap_mb(device), "no_hook_step_ms": base * 1e3,
            "torch_powerSGD_hook_ms": torch_s * 1e3, "gradcomp_powersgd_ms": gradcomp_s * 1e3,
            "gradcomp_over_torch": ratio(gradcomp_s, torch_s)}


# ----------------------------------------------------------------------------------------- main

def resolve_device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda: CUDA is not available to this torch ({torch.__version__}, "
                             f"CUDA build {torch.version.cuda}); run on a GPU machine or use --device cpu")
        if not gradcomp.cuda_built:
            raise SystemExit("--device cuda: this gradcomp was built without CUDA kernels; rebuild with "
                             "GRADCOMP_CUDA=ON against a CUDA build of torch")
    return torch.device(name)


def codec_argument(spec: str) -> tuple[str, gradcomp.Codec]:
    """--codecs SPEC: the spec as written and its codec."""
    try:
        return spec, gradcomp.codec(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", type=float, nargs="+", metavar="MB",
                        help=f"bucket sizes in MB (default: {BUCKET_MB:g} and the sweep "
                             f"{' '.join(f'{s:g}' for s in SWEEP_MB)}; --quick: {QUICK_MB[0]:g})")
    parser.add_argument("--codecs", nargs="+", metavar="SPEC", type=codec_argument,
                        help=f"codec specs to measure (default: {' '.join(CODEC_SPECS)})")
    parser.add_argument("--quick", action="store_true", help="4 MB only and few repetitions (a smoke test)")
    parser.add_argument("--skip-reference-above", type=float, default=64.0, metavar="MB",
                        help="time the slow pure-PyTorch references only up to this size (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--no-hook-step", action="store_true",
                        help="skip the PowerSGD hook step comparison with torch's powerSGD_hook")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--tag", help="output file stem (default kernels_<device>, kernels_<device>_quick)")
    args = parser.parse_args(argv)
    if args.sizes is not None and min(args.sizes) * MB < FP32_BYTES:
        parser.error(f"--sizes must be positive, got {args.sizes}")
    if args.codecs is None:
        args.codecs = [codec_argument(spec) for spec in CODEC_SPECS]
    if args.sizes is None:
        args.sizes = list(QUICK_MB) if args.quick else sorted((BUCKET_MB, *SWEEP_MB))
    if args.tag is None:
        args.tag = f"kernels_{args.device}" + ("_quick" if args.quick else "")
    return args


def make_timer(device: torch.device, quick: bool) -> Timer:
    if quick:
        return Timer(device, library=Repetitions(0.05, 3, 50, max_seconds=1.0),
                     reference=Repetitions(0.0, 1, 1, max_seconds=0.0, warmup_is_sample_above=0.5))
    return Timer(device, library=Repetitions(0.2, 3, 200, max_seconds=3.0),
                 reference=Repetitions(0.1, 2, 10, max_seconds=2.0, warmup_is_sample_above=2.0))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Hide any GPU from a CPU run (before anything asks CUDA): torch's powerSGD_hook, in the hook step, synchronizes
        # CUDA wherever it is available, CPU tensors or not ("Expected a cuda device, but got: cpu").
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    timer = make_timer(device, args.quick)
    codecs = dict(args.codecs)
    reference, reference_status = load_reference(device)
    machine = machine_description(device)
    print(f"{machine['cpu_model']}, {machine['logical_cores']} cores, torch {machine['torch_version']}, "
          f"{machine['torch_threads']} thread(s), {device}; {reference_status}")
    print(format_header())

    started = time.perf_counter()
    rows: list[Row] = []
    for size_mb in args.sizes:
        rows += measure_size(timer, codecs, size_mb, reference, size_mb <= args.skip_reference_above)
    hooks = None if args.no_hook_step else measure_powersgd_hooks(device, timer, args.quick)
    if hooks:
        print(f"PowerSGD hook step, rank {hooks['rank']}, ResNet-18 shapes, one rank: torch powerSGD_hook "
              f"{hooks['torch_powerSGD_hook_ms']:.1f} ms, gradcomp powersgd {hooks['gradcomp_powersgd_ms']:.1f} ms "
              f"(ratio {hooks['gradcomp_over_torch']:.2f}); the step without a hook {hooks['no_hook_step_ms']:.1f} ms")
    elapsed = time.perf_counter() - started

    settings = {
        "sizes_mb": args.sizes, "codecs": list(codecs), "quick": args.quick,
        "skip_reference_above_mb": args.skip_reference_above, "reference": reference_status,
        "library_repetitions": asdict(timer.library), "reference_repetitions": asdict(timer.reference),
        "decode_fan_in": DECODE_FAN_IN, "elapsed_s": round(elapsed, 1), "load_average_at_end": load_average(),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / args.tag
    write_json(stem.parent / f"{stem.name}.json", machine, settings, rows, hooks)
    write_csv(stem.parent / f"{stem.name}.csv", rows)
    plotted = write_plot(stem.parent / f"{stem.name}.png", rows, machine)
    print(f"measured in {elapsed:.0f} s; wrote {stem}.json, .csv" + (", .png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
