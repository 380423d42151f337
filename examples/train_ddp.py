"""DDP training of a small 1-D CNN on MNIST-1D with a gradient compressor chosen by name.

MNIST-1D is generated offline by the `mnist1d` package (4000 training and 1000 test sequences of
length 40). Every rank trains on its own shard of each global batch; gradients are exchanged
through gradcomp's DDP communication hook, and rank 0 reports the test accuracy and the bytes one
rank put on the wire against what plain DDP would have sent.

Every codec trains with the same recipe, so runs compare at equal settings: SGD with Nesterov
momentum 0.7, peak learning rate 0.3, linear warm-up over the first 2.5% of the steps (one epoch
of the default 40), then cosine decay to zero, and the averaged gradient clipped to norm 1 (which
bites only in the first epochs; without it terngrad and randomk diverge). The momentum is lower
than the usual 0.9 on purpose: an error-feedback residual already carries gradient from step to
step, and on top of momentum 0.9 signsgd's large residuals make training unstable (10-40% test
accuracy instead of ~94%; measured with signsgd's earlier one scale per bucket). Adam is worse
still: it rescales every coordinate, so the residual's small oscillating entries become full-size
steps; under AdamW, signsgd does better without error feedback (benchmarks/README.md).

    python examples/train_ddp.py                                  # 2 local ranks, topk:ratio=0.01
    python examples/train_ddp.py --compressor none                # the uncompressed baseline
    python examples/train_ddp.py --compressor "powersgd:rank=2" --nprocs 4 --json powersgd.json
    python examples/train_ddp.py --checkpoint ckpt --epochs 10    # then: --checkpoint ckpt --resume
    torchrun --nproc-per-node 2 examples/train_ddp.py --compressor signsgd   # NCCL when CUDA is there
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import gradcomp


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="topk:ratio=0.01", help='codec spec; "none" is plain DDP')
    parser.add_argument("--scheme", default="auto", choices=gradcomp.schemes.SCHEME_OPTIONS,
                        help="how signsgd, terngrad, qsgd and topk travel (auto: the one sending fewer bytes)")
    parser.add_argument("--policy", default="codec", choices=["codec", "time"],
                        help="time: per bucket the fastest of plain allreduce and the codec's schemes, measured on "
                             "this job (its decision is printed after the warm-up)")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=100, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.3,
                        help="peak SGD learning rate (Nesterov momentum 0.7; warm-up, then cosine decay per step)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backend", choices=["gloo", "nccl"],
                        help="default: nccl under torchrun where each local rank has a GPU of its own, else gloo")
    parser.add_argument("--port", type=int, default=0, help="rendezvous port for local ranks (0: a free one)")
    parser.add_argument("--checkpoint", metavar="DIR", help="save DIR/ckpt.rank{r}.pt after every epoch")
    parser.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint DIR (same flags: the lr schedule spans --epochs)")
    parser.add_argument("--json", metavar="PATH", help="write a JSON summary (rank 0)")
    parser.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is no TTY")
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    return args


def load_mnist1d() -> dict[str, torch.Tensor]:
    from mnist1d.data import get_dataset_args, make_dataset
    data = make_dataset(get_dataset_args())  # generated locally from the standard arguments; no download
    return {"x": torch.tensor(data["x"], dtype=torch.float32).unsqueeze(1), "y": torch.tensor(data["y"]),
            "x_test": torch.tensor(data["x_test"], dtype=torch.float32).unsqueeze(1),
            "y_test": torch.tensor(data["y_test"])}


def make_model(channels: int = 96, length: int = 40) -> nn.Module:
    """The MNIST-1D paper's CNN (three strided convolutions, one linear layer), 96 channels wide
    instead of 25: reaches ~94% in 40 epochs instead of ~150."""
    def conv(c_in, kernel):
        return [nn.Conv1d(c_in, channels, kernel, stride=2, padding=1), nn.ReLU()]
    body = nn.Sequential(*conv(1, 5), *conv(channels, 3), *conv(channels, 3), nn.Flatten())
    with torch.no_grad():
        features = body(torch.zeros(1, 1, length)).shape[1]
    return nn.Sequential(body, nn.Linear(features, 10))


def epoch_batches(num_samples: int, batch_size: int, world: int, rank: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's sample indices per step, shape (steps, batch_size // world): a permutation keyed by
    (seed, epoch) alone, so a resumed run sees the data an uninterrupted one would."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    steps = num_samples // batch_size  # the incomplete last batch is dropped: every step has full shards
    order = torch.randperm(num_samples, generator=generator)[:steps * batch_size]
    return order.view(steps, world, batch_size // world)[:, rank]


MOMENTUM = 0.7  # Nesterov; see the module docstring for why not 0.9
CLIP_NORM = 1.0  # on the averaged (decoded) gradient, identical on every rank


def scheduled_lr(peak: float, step: int, total: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at `total`; stateless: nothing to checkpoint."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))


def human_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def progress(epoch: int, done: int, total: int) -> None:
    filled = 30 * done // total
    sys.stderr.write(f"\repoch {epoch:2d} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
    sys.stderr.write("\r\033[K" if done == total else "")
    sys.stderr.flush()


def find_free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def choose_backend(asked: str | None, local_ranks: int, under_torchrun: bool) -> str:
    """The process group's backend: the one asked for, else NCCL under torchrun where every local rank has a GPU of its
    own (rank r on cuda:r), else gloo on the CPUs. NCCL asked for without a GPU per local rank is refused by name."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if asked == "nccl" and gpus < local_ranks:
        raise SystemExit(f"--backend nccl needs a GPU per local rank: {local_ranks} local ranks, {gpus} GPU(s) "
                         f"visible; use --backend gloo, or as many ranks per node as GPUs")
    if asked is not None:
        return asked
    if under_torchrun and gpus >= local_ranks:
        return "nccl"
    if under_torchrun and gpus > 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"{local_ranks} local ranks, {gpus} GPU(s): training on the CPUs over gloo (NCCL takes a GPU per rank)",
              file=sys.stderr)
    return "gloo"


def finish_spawned_rank(rank: int, rank_fn, *args) -> None:
    """An mp.spawn rank: rank_fn(rank, *args), then, once it has returned, the process ends at once with
    exit code 0. A gloo thread can abort the interpreter's shutdown after the process group is destroyed
    ("terminate called without an active exception", an upstream torch issue seen also without
    gradcomp), which spawn would report as a failed rank; a finished rank has nothing left to tear down."""
    rank_fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_checkpoint(path: str, checkpoint: dict) -> None:
    """Writes path atomically and keeps the epoch before as path.prev: the ranks save at different
    moments, so a run killed meanwhile leaves them one epoch apart, and resume_point meets there."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save(checkpoint, path + ".tmp")
    if os.path.exists(path):
        os.replace(path, path + ".prev")
    os.replace(path + ".tmp", path)


def resume_point(path: str, device: torch.device) -> dict:
    """This rank's checkpoint of the latest epoch that every rank has saved; an error saying what is wrong
    when there is none (every rank raises alike, so no rank trains on alone)."""
    saved = {c["epoch"]: c for c in (torch.load(p, map_location=device)
                                     for p in (path, path + ".prev") if os.path.exists(p))}
    latest = max(saved, default=-1)
    bounds = torch.tensor([latest, -latest], device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN)  # [earliest latest epoch, -(latest latest epoch)]
    common, newest = bounds.tolist()[0], -bounds.tolist()[1]
    folder = os.path.dirname(path)
    if newest < 0:
        raise RuntimeError(f"--resume: no rank found a checkpoint in {folder} (ckpt.rank{{r}}.pt, written by a run "
                           f"with --checkpoint {folder}); run without --resume to start afresh")
    if common < 0:
        raise RuntimeError(f"--resume: some ranks found no checkpoint in {folder} (this rank, {dist.get_rank()}: "
                           f"{'none' if not saved else f'epochs {sorted(saved)}'}). Every rank reads "
                           f"ckpt.rank{{its rank}}.pt, and torchrun hands out ranks by arrival, so across nodes "
                           f"--checkpoint must name storage that every node shares")
    if newest - common > 1 or common not in saved:  # not what an interrupted run leaves
        raise RuntimeError(f"rank {dist.get_rank()}: checkpoints in {folder} cannot be matched "
                           f"(epochs {sorted(saved)} here, latest epochs {common}..{newest} over the ranks)")
    return saved[common]


def train(rank: int, world: int, backend: str, args: argparse.Namespace, data=None, local_rank=None) -> None:
    """One rank, from joining the process group to leaving it (also when training fails)."""
    local_rank = rank if local_rank is None else local_rank  # spawned ranks all live on this host
    torch.set_num_threads(args.threads)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        run(rank, world, local_rank, backend, args, data)
        # No rank tears its group down while another is still in a collective: gloo's worker threads would
        # otherwise still hold that work when the interpreter shuts down (see end_process_group).
        dist.barrier()
    finally:
        end_process_group()


def end_process_group() -> None:
    """Destroys the process group while the interpreter is whole: the objects that hold it (DDP's reducer,
    gradcomp's state, their futures) are collected first, so its worker threads are joined now rather than
    torn down with the interpreter, where releasing the tensors they hold takes the GIL and aborts."""
    gc.collect()
    dist.destroy_process_group()


def run(rank: int, world: int, local_rank: int, backend: str, args: argparse.Namespace, data) -> None:
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
    device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    data = {k: v.to(device) for k, v in (data or load_mnist1d()).items()}
    torch.manual_seed(args.seed)  # identical init on every rank (DDP broadcasts rank 0's anyway)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM, nesterov=True)
    path = os.path.join(args.checkpoint, f"ckpt.rank{rank}.pt") if args.checkpoint else None
    saved = resume_point(path, device) if args.resume else None
    if saved:  # loaded before DDP wraps the model, so its broadcast carries the checkpoint
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    ddp_model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    state = gradcomp.register(ddp_model, args.compressor, scheme=args.scheme, policy=args.policy)
    if saved:
        state.load_state_dict(saved["compressor"])
    first_epoch = saved["epoch"] + 1 if saved else 0

    is_main = rank == 0
    show_bar = is_main and (args.progress or sys.stderr.isatty())
    steps = len(data["x"]) // args.batch_size
    total_steps = args.epochs * steps
    warmup = max(total_steps // 40, 1)  # 2.5% of the run: one epoch of the default 40
    if is_main:
        params = sum(p.numel() for p in model.parameters())
        print(f"world size {world}, backend {backend}, compressor {state.spec}, {params:,} parameters, "
              f"{args.epochs} epochs of {steps} steps, global batch {args.batch_size}", flush=True)
    history = saved["history"] if saved else []
    previous = state.stats()["total"]
    explained = args.policy != "time"
    for epoch in range(first_epoch, args.epochs):
        started = time.perf_counter()
        ddp_model.train()
        loss_sum = torch.zeros((), device=device)
        for step, indices in enumerate(epoch_batches(len(data["x"]), args.batch_size, world, rank, args.seed,
                                                     epoch).to(device)):
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(args.lr, epoch * steps + step, total_steps, warmup)
            loss = nn.functional.cross_entropy(ddp_model(data["x"][indices]), data["y"][indices])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            optimizer.step()
            loss_sum += loss.detach()
            if not explained and not state.deciding:  # policy="time": once its decision stands
                explained = True
                if is_main:
                    print(("\r" if show_bar else "") + state.explain(), flush=True)
            if show_bar:
                progress(epoch, step + 1, steps)

        # Every rank scores its share of the test set; one all_reduce sums correct counts and losses.
        model.eval()
        with torch.no_grad():
            share = slice(rank, None, world)
            correct = (model(data["x_test"][share]).argmax(1) == data["y_test"][share]).sum()
        totals = torch.stack([loss_sum / steps, correct.to(loss_sum.dtype)])
        dist.all_reduce(totals)
        now = state.stats()["total"]
        wire, raw = now["wire_bytes"] - previous["wire_bytes"], now["raw_bytes"] - previous["raw_bytes"]
        previous = now
        record = {"epoch": epoch, "loss": totals[0].item() / world,
                  "test_acc": 100 * totals[1].item() / len(data["x_test"]), "wire_bytes": wire, "raw_bytes": raw,
                  "seconds": time.perf_counter() - started}
        history.append(record)
        if is_main:
            print(f"epoch {epoch:2d}  loss {record['loss']:.3f}  test acc {record['test_acc']:.1f}%  "
                  f"sent {human_bytes(wire)} vs plain DDP's {human_bytes(raw)} ({raw / max(wire, 1):.1f}x)",
                  flush=True)
        if path:
            save_checkpoint(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                                   "compressor": state.state_dict(), "history": history})

    if is_main and not explained:  # policy="time" whose trial outlasted the run: the decision and the trial so far
        print(state.explain(), flush=True)
    if is_main:
        total = state.stats()["total"]
        seconds = time.time() - args.started
        accuracy = history[-1]["test_acc"] if history else float("nan")
        ratio = total["raw_bytes"] / max(total["wire_bytes"], 1)
        schemes = ", ".join(f"{n} {name}" for name, n in state.stats()["schemes"].items()) or "none compressed"
        print(f"final test acc {accuracy:.1f}%  each rank sent {human_bytes(total['wire_bytes'])} vs plain DDP's "
              f"{human_bytes(total['raw_bytes'])} at {world} ranks ({ratio:.1f}x; buckets: {schemes})  "
              f"wall {seconds:.1f} s", flush=True)
        if args.json:
            summary = {"final_test_acc": accuracy, "epochs": history, "wire_bytes": total["wire_bytes"],
                       "raw_bytes": total["raw_bytes"], "received_bytes": total["received_bytes"], "ratio": ratio,
                       "compressor": state.spec, "schemes": state.stats()["schemes"],
                       "world_size": world, "backend": backend, "seconds": seconds, "args": vars(args)}
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)


def main() -> None:
    args = parse_args()
    args.started = time.time()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun: join its process group
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        backend = choose_backend(args.backend, local_ranks, under_torchrun=True)
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), backend, args,
              local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return
    backend = choose_backend(args.backend, args.nprocs, under_torchrun=False)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port or find_free_port())
    data = load_mnist1d()  # once here rather than in every rank: generating it takes seconds
    # An exception in any rank makes spawn terminate the others and raise here: a non-zero exit.
    mp.spawn(finish_spawned_rank, args=(train, args.nprocs, backend, args, data), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
