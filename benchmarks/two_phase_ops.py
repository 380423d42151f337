"""One rank's compute in a step of the two-phase scheme, in its three ops against the same work done one
chunk at a time, the memory-copy bandwidth and the pure-PyTorch reference.

For each codec and world size W, on a bucket of --size MB of fp32 gradient (one thread by default):
  encode   encode_chunks(bucket, residual, W)      against W x encode(chunk) + torch.cat (the scheme
                                                   before the ops), and W x ref_encode (pure PyTorch)
  owner    reencode_sum(W payloads of one chunk)   against decode_sum + encode of that chunk
  decode   decode_chunks(W gathered rows, bucket)  against W x decode_sum(row, chunk), and W x
                                                   ref_decode_sum
  copy_    dst.copy_(src) of the bucket: the memory-bandwidth limit
Throughputs are GB/s of the fp32 gradient each phase decodes or encodes: the bucket, and for the owner
its W payloads of one chunk (W chunks' worth, about the bucket). No communication: the all-to-all and
all-gather are scaling.py's.

    python benchmarks/two_phase_ops.py            # 25 MB, W = 8 and 64, with the reference (a few minutes)
    python benchmarks/two_phase_ops.py --quick    # 1 MB, W = 4, no reference (seconds)
    python benchmarks/two_phase_ops.py --device cuda   # the same on a GPU

Writes <out>/two_phase_ops.{json,csv,png} (--quick: two_phase_ops_quick.*; --device cuda: two_phase_ops_cuda.*).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

import gradcomp
from bench_common import machine, write_results
from gradcomp.codecs import chunk_bounds
from kernels import FP32_BYTES, Repetitions, Timer, load_reference, reference_keywords, resolve_device

CODECS = ["signsgd", "terngrad", "qsgd", "topk:ratio=0.01"]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def gathered_rows(payloads: list[torch.Tensor]) -> torch.Tensor:
    """[W, width] rows holding each chunk's payload first, as the all-gather leaves them."""
    rows = torch.zeros(len(payloads), max(p.numel() for p in payloads), dtype=torch.uint8, device=payloads[0].device)
    for j, payload in enumerate(payloads):
        rows[j, : payload.numel()] = payload
    return rows


def reference_throughput(timer: Timer, nbytes: int, reference, what: str) -> float | None:
    """The pure-PyTorch reference's GB/s, or None where there is none or it fails (said, not fatal)."""
    if reference is None:
        return None
    try:
        return timer.gbps(nbytes, reference, reference=True)
    except Exception as error:  # noqa: BLE001 - a failing reference is reported, the ops' figures still stand
        print(f"  warning: {what}: the reference failed: {type(error).__name__}: {error}"[:300], file=sys.stderr)
        return None


def measure(timer: Timer, spec: str, grad: torch.Tensor, world: int, reference, copy_gbps: float) -> list[dict]:
    codec = gradcomp.codec(spec)
    numel = grad.numel()
    residual = torch.zeros_like(grad) if codec.error_feedback else None
    bounds = chunk_bounds(numel, world)
    chunks = [grad[a:b] for a, b in bounds]
    residual_chunks = [None if residual is None else residual[a:b] for a, b in bounds]
    payloads = [codec.encode(c, rank=j) for j, c in enumerate(chunks)]
    owner_payloads = torch.stack([payloads[0]] * world)  # W ranks' payloads of chunk 0: one header, one size
    owner_numel = chunks[0].numel()
    owner_residual = torch.zeros_like(grad[:owner_numel]) if codec.error_feedback else None
    average = torch.empty_like(grad[:owner_numel])
    rows, out = gathered_rows(payloads), torch.empty_like(grad)
    steps = itertools.count()
    bucket_bytes, chunk_bytes = numel * FP32_BYTES, owner_numel * FP32_BYTES

    def encode_per_chunk():
        step = next(steps)
        torch.cat([codec.encode(c, r, step=step, rank=j) for j, (c, r) in enumerate(zip(chunks, residual_chunks))])

    def owner_per_chunk():
        codec.decode_sum(owner_payloads, average, 1.0 / world)
        codec.encode(average, owner_residual, rank=world * world)

    def decode_per_chunk():
        for j, (a, b) in enumerate(bounds):
            codec.decode_sum(rows[j, : payloads[j].numel()], out[a:b])

    phases = {
        "encode": (bucket_bytes, encode_per_chunk,
                   lambda: codec.encode_chunks(grad, residual, world, step=next(steps))),
        "owner": (world * chunk_bytes, owner_per_chunk,
                  lambda: codec.reencode_sum(owner_payloads, average, owner_residual, 1.0 / world, rank=world * world)),
        "decode": (bucket_bytes, decode_per_chunk, lambda: codec.decode_chunks(rows, out)),
    }
    references = {}
    if reference is not None:
        keywords = [reference_keywords(codec, c.numel()) for c in chunks]
        ref_residuals = [torch.zeros_like(c) for c in chunks]
        references["encode"] = lambda: [reference.ref_encode(codec.name, c, r, rank=j, **k) for j, (c, r, k) in
                                        enumerate(zip(chunks, ref_residuals, keywords))]
        references["decode"] = lambda: [reference.ref_decode_sum(p.unsqueeze(0), torch.float32, 1.0, vote=codec.vote)
                                        for p in payloads]
    rows_out = []
    for phase, (nbytes, per_chunk, fused) in phases.items():
        per_chunk_gbps = timer.gbps(nbytes, per_chunk)
        fused_gbps = timer.gbps(nbytes, fused)
        reference_gbps = reference_throughput(timer, nbytes, references.get(phase), f"{spec} W={world} {phase}")
        rows_out.append({
            "codec": spec, "world": world, "phase": phase, "numel": numel,
            "fused_gbps": round(fused_gbps, 3), "per_chunk_gbps": round(per_chunk_gbps, 3),
            "reference_gbps": None if reference_gbps is None else round(reference_gbps, 4),
            "copy_gbps": round(copy_gbps, 3),
            "fused_vs_per_chunk": round(fused_gbps / per_chunk_gbps, 3),
            "fused_vs_copy": round(fused_gbps / copy_gbps, 4),
            "fused_vs_reference": None if reference_gbps is None else round(fused_gbps / reference_gbps, 1),
        })
        print(f"{spec:16s} W={world:<4d} {phase:7s} ops {fused_gbps:7.2f} GB/s  per chunk {per_chunk_gbps:7.2f}  "
              f"x{fused_gbps / per_chunk_gbps:5.2f}  of copy_ {fused_gbps / copy_gbps:6.1%}"
              + ("" if reference_gbps is None else f"  reference {reference_gbps:7.3f}"), flush=True)
    return rows_out


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in rows})
    phases = ["encode", "owner", "decode"]
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        for offset, spec in enumerate(CODECS):
            ratios = [next((r["fused_vs_per_chunk"] for r in rows if (r["world"], r["codec"], r["phase"]) ==
                            (world, spec, phase)), 0) for phase in phases]
            ax.bar([p + 0.2 * offset - 0.3 for p in range(len(phases))], ratios, width=0.2, label=spec)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(phases)), phases)
        ax.set_ylabel("throughput: ops / one chunk at a time")
        ax.set_title(f"W = {world}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="1 MB, W = 4, no reference")
    parser.add_argument("--size", type=float, default=25.0, help="bucket MB of fp32 gradient (MB = 2^20 bytes)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.worlds = 1.0, [4]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    numel = int(args.size * 2**20) // FP32_BYTES
    device = resolve_device(args.device)
    timer = Timer(device, Repetitions(0.2 if args.quick else 1.0, 3 if args.quick else 5, 50, 5.0),
                  Repetitions(0.0, 1, 3, 10.0, warmup_is_sample_above=2.0))
    reference = None
    if not args.quick:
        reference, note = load_reference(device)
        print(note)
    grad = torch.randn(numel).to(device)
    destination = torch.empty_like(grad)
    copy_gbps = timer.gbps(numel * FP32_BYTES, lambda: destination.copy_(grad))
    print(f"bucket {args.size:g} MB ({numel} fp32), {device}, {args.threads} thread(s), copy_ {copy_gbps:.2f} GB/s")
    rows = [row for world in args.worlds for spec in CODECS
            for row in measure(timer, spec, grad, world, reference, copy_gbps)]
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "two_phase_ops" + ("_cuda" if device.type == "cuda" else "")
                        + ("_quick" if args.quick else ""))
    report = {"machine": machine(), "device": str(device), "threads": args.threads, "size_mb": args.size,
              "numel": numel, "worlds": args.worlds, "copy_gbps": copy_gbps, "rows": rows}
    if device.type == "cuda":
        report["machine"]["gpu"] = torch.cuda.get_device_name(device)
    write_results(stem, report, rows)
    where = report["machine"].get("gpu", report["machine"]["cpu"])
    plot(rows, stem + ".png", f"two-phase ops, {args.size:g} MB bucket, {device}, {args.threads} thread(s), {where}")
    print(f"wrote {stem}.json, .csv, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
