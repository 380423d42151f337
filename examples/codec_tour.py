"""A tour of every gradcomp codec on real gradients: bytes on the wire, error, error feedback.

Trains nothing: it takes the gradients of a small 1-D CNN on MNIST-1D (generated offline by the
`mnist1d` package, or random data with --synthetic), simulates N ranks, and for each codec
encodes every rank's gradient with error feedback, decodes the sum of their payloads as a
gradient allreduce would, and reports what travelled and how close the average came.

    python examples/codec_tour.py                     # every codec at its defaults, 2 ranks
    python examples/codec_tour.py --codecs "topk:ratio=0.001" "qsgd:levels=3" --ranks 4
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import gradcomp

DEFAULT_SPECS = ["none", "fp16", "bf16", "signsgd", "terngrad", "qsgd", "topk:ratio=0.01", "randomk:ratio=0.01",
                 "powersgd:rank=2"]


def mnist1d_batches(ranks: int, batch: int, synthetic: bool, seed: int):
    """One batch per rank: MNIST-1D when the package is there (offline generation), else random."""
    if not synthetic:
        try:
            from mnist1d.data import get_dataset_args, make_dataset
        except ImportError:
            print("mnist1d is not installed: using random data (pip install mnist1d for the real thing)")
        else:
            args = get_dataset_args()
            args.seed = seed
            data = make_dataset(args)  # generated locally; never downloads
            x = torch.tensor(data["x"], dtype=torch.float32)
            y = torch.tensor(data["y"], dtype=torch.int64)
            return [(x[r * batch:(r + 1) * batch, None, :], y[r * batch:(r + 1) * batch]) for r in range(ranks)]
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 1, 40, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
            for _ in range(ranks)]


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(1, 32, 5, padding=2), nn.ReLU(),
        nn.Conv1d(32, 32, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(32 * 40, 128), nn.ReLU(), nn.Linear(128, 10))


def rank_gradients(model: nn.Module, batches) -> list[list[torch.Tensor]]:
    gradients = []
    for x, y in batches:
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        gradients.append([p.grad.detach().clone() for p in model.parameters()])
    return gradients


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def run_payload_codec(codec: gradcomp.PayloadCodec, gradients, steps: int):
    """Encodes each rank's flat gradient for a few steps (error feedback carried), decodes the sum."""
    ranks = len(gradients)
    flats = [flat(g) for g in gradients]
    residuals = [torch.zeros_like(f) if codec.error_feedback else None for f in flats]
    out = torch.empty_like(flats[0])
    encode_s = decode_s = 0.0
    for step in range(steps):
        start = time.perf_counter()
        payloads = [codec.encode(f, r, step=step, rank=rank) for rank, (f, r) in enumerate(zip(flats, residuals))]
        encode_s += time.perf_counter() - start
        start = time.perf_counter()
        if codec.collective == "allreduce":  # what an allreduce does to the bodies: sum them
            total = payloads[0].clone()
            view = codec.summable_view(total, out.numel(), out.dtype)
            for p in payloads[1:]:
                view += codec.summable_view(p, out.numel(), out.dtype)
            codec.decode_sum(total, out, alpha=1 / ranks)
        else:  # allgather: every rank decodes the sum of all payloads
            codec.decode_sum(torch.stack(payloads), out, alpha=1 / ranks)
        decode_s += time.perf_counter() - start
    return out, payloads[0].numel(), encode_s / steps, decode_s / steps


def run_powersgd(codec: gradcomp.PowerSGD, gradients, steps: int):
    """PowerSGD per tensor: P and Q summed across ranks, whole tensors averaged for the rest."""
    ranks = len(gradients)
    shapes = [g.shape for g in gradients[0]]
    qs = [codec.initial_q(s, index=i) if codec.compresses(s) else None for i, s in enumerate(shapes)]
    residuals = [[torch.zeros(g.numel()) for g in rank] for rank in gradients]
    start = time.perf_counter()
    for _ in range(steps):
        outs = []
        for i, shape in enumerate(shapes):
            grads = [rank[i] for rank in gradients]
            if qs[i] is None:
                outs.append(sum(grads) / ranks)
                continue
            ms_ps = [codec.compute_p(g, residuals[r][i], qs[i]) for r, g in enumerate(grads)]
            p = codec.orthogonalize(sum(p_r for _, p_r in ms_ps))  # after the allreduce of P
            qs[i] = sum(codec.compute_q(m, p, torch.empty_like(qs[i])) for m, _ in ms_ps)  # allreduce of Q
            out = torch.empty(shape)
            for r, (m, _) in enumerate(ms_ps):
                codec.decompress(p, qs[i], m, out, residuals[r][i], alpha=1 / ranks)
            outs.append(out)
    encode_s = (time.perf_counter() - start) / steps
    nbytes = sum(codec.payload_nbytes(s) for s in shapes)
    return flat(outs), nbytes, encode_s, 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", nargs="+", default=DEFAULT_SPECS, help="codec specs, e.g. 'topk:ratio=0.01'")
    parser.add_argument("--ranks", type=int, default=2, help="simulated ranks (default 2)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="steps per codec (error feedback carries over)")
    parser.add_argument("--synthetic", action="store_true", help="random data instead of MNIST-1D")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.ranks < 1 or args.steps < 1 or args.batch < 1:
        parser.error("--ranks, --steps and --batch must be >= 1")
    codecs = [gradcomp.codec(spec) for spec in args.codecs]  # fails early on a bad spec

    torch.manual_seed(args.seed)
    model = small_cnn()
    gradients = rank_gradients(model, mnist1d_batches(args.ranks, args.batch, args.synthetic, args.seed))
    exact = sum(flat(g) for g in gradients) / args.ranks
    raw_bytes = exact.numel() * exact.element_size()
    print(f"gradcomp {gradcomp.__version__}: {exact.numel():,} gradient elements ({raw_bytes / 1e6:.2f} MB fp32) "
          f"per rank, {args.ranks} ranks, {args.steps} steps per codec\n")
    print(f"{'codec':24s} {'bytes/rank/step':>16s} {'ratio':>8s} {'rel. error':>11s} {'encode ms':>10s} {'combine ms':>11s}")
    for i, (spec, codec) in enumerate(zip(args.codecs, codecs), 1):
        if isinstance(codec, gradcomp.PowerSGD):
            average, nbytes, enc, dec = run_powersgd(codec, gradients, args.steps)
        else:
            average, nbytes, enc, dec = run_payload_codec(codec, gradients, args.steps)
        error = ((average - exact).norm() / exact.norm()).item()
        print(f"{spec:24s} {nbytes:16,d} {raw_bytes / nbytes:7.1f}x {error:11.4f} {enc * 1e3:10.2f} {dec * 1e3:11.2f}"
              f"   [{i}/{len(codecs)}]")
    print("\nrel. error: |decoded average - exact average| / |exact average| at the last step; with error "
          "feedback what is not sent now is sent later, so one step's error overstates the loss.\n"
          "encode ms: all ranks' encodes; combine ms: summing (allreduce codecs, in Python here) or gathering the "
          "payloads and decoding their average. PowerSGD's whole step counts as encode.")


if __name__ == "__main__":
    main()
