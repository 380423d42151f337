"""What each rank runs in the multi-process DDP tests (see ddp_harness.run_ranks and test_ddp.py).

Every scenario builds the same small model on every rank (seeded), feeds each rank its own batch
(a function of seed, step, micro-step and rank only, so runs can be repeated and resumed), and
returns tensors for the test process to compare.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from benchmark_modules import load_benchmark

FEATURES, CLASSES, BATCH = 24, 5, 32
BUCKET_CAP_MB = 0.004  # a few KB: several buckets, and DDP lays them out anew after step 0


def make_model(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(1234)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(FEATURES, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, CLASSES))
    if kind == "vectors":  # only 1-D parameters: every bucket holds 1-D tensors only
        return ScaleShift()
    if kind == "sparse":
        return SparseBag()
    if kind == "tiny":  # one bucket of 3 elements: fewer than the ranks of a 4-rank run
        return Tiny()
    if kind == "double_head":  # the MLP under a float64 layer, whose bucket (no codec takes float64) DDP launches first
        return DoubleHead()
    raise ValueError(kind)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor([1.0, 0.1, 0.5]))

    def forward(self, x):
        return (x[:, :CLASSES] * self.gain[0] + self.gain[1]) * self.gain[2]


class DoubleHead(nn.Module):
    """Each float64 parameter over BUCKET_CAP_MB: DDP closes its bucket at once, ahead of the float32 ones, also
    when it lays the buckets out anew (in the order the gradients came, the head's first)."""

    def __init__(self):
        super().__init__()
        self.body = make_model("mlp")
        self.head = nn.Linear(CLASSES, 600).double()

    def forward(self, x):
        return self.head(self.body(x).double())[:, :CLASSES].float()


class ScaleShift(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(FEATURES))
        self.shift = nn.Parameter(torch.zeros(FEATURES))
        self.head = nn.Parameter(torch.randn(CLASSES) * 0.1)

    def forward(self, x):
        return (x * self.scale + self.shift)[:, :CLASSES] + self.head


class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(100, CLASSES, sparse=True)

    def forward(self, x):
        return self.embedding((x.abs() * 10).long().clamp(max=99)).sum(1)


def batch(step: int, micro: int, rank: int, seed: int = 0):
    generator = torch.Generator().manual_seed(((seed * 1000 + step) * 10 + micro) * 100 + rank)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    teacher = torch.Generator().manual_seed(99)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=teacher)).argmax(1)
    return x, y


def wrap(model: nn.Module, **ddp_kwargs) -> DDP:
    return DDP(model, bucket_cap_mb=ddp_kwargs.pop("bucket_cap_mb", BUCKET_CAP_MB), **ddp_kwargs)


def train(ddp: DDP, optimizer, steps, rank, *, first_step=0, accumulate=1, record=None, seed=0, dtype=None,
          device=None):
    """Runs steps; record(step) is called after each backward (gradients synchronized)."""
    losses = []
    for step in range(first_step, first_step + steps):
        for micro in range(accumulate):
            x, y = batch(step, micro, rank, seed)
            if device is not None:
                x, y = x.to(device), y.to(device)
            if dtype is not None:
                x = x.to(dtype)
            sync = contextlib.nullcontext() if micro == accumulate - 1 else ddp.no_sync()
            with sync:
                loss = nn.functional.cross_entropy(ddp(x).float(), y)
                loss.backward()
        losses.append(loss.item())
        if record is not None:
            record(step)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def gradients(model: nn.Module):
    return [p.grad.detach().clone() for p in model.parameters()]


# -- scenarios ---------------------------------------------------------------------------------------------------------


def lossless(rank, world, configs, steps, ddp_kwargs, accumulate=1):
    """configs: {name: None (plain DDP) or (spec, register kwargs)} -> {name: [per-step gradients]}.
    With accumulate > 1, rank 0 also returns "single": one process on every rank's batches."""
    results = {}
    for name, config in configs.items():
        model = make_model()
        ddp = wrap(model, **dict(ddp_kwargs))
        if config is not None:
            spec, kwargs = config
            gradcomp.register(ddp, spec, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps_grads = []
        train(ddp, optimizer, steps, rank, accumulate=accumulate, record=lambda _: steps_grads.append(gradients(model)))
        results[name] = steps_grads
    if accumulate > 1 and rank == 0:
        results["single"] = single_process(steps, world, accumulate)
    return results


def single_process(steps, world, accumulate):
    """The reference for no_sync: one process, every rank's micro-batches together, no DDP."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps_grads = []
    for step in range(steps):
        for micro in range(accumulate):
            parts = [batch(step, micro, r) for r in range(world)]
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            nn.functional.cross_entropy(model(x), y).backward()
        steps_grads.append(gradients(model))
        optimizer.step()
        optimizer.zero_grad()
    return steps_grads


def training(rank, world, specs, steps):
    """Trains with each spec; records the loss and, for every compressed bucket of the first compressed
    steps, what the error-feedback invariant needs: the bucket's gradient, residual before and after.
    The gathered codecs take the allgather scheme at any world size (test_two_phase.py checks the other)."""
    results = {}
    for spec in specs:
        model = make_model()
        ddp = wrap(model)
        gathered = gradcomp.schemes.fixed_scheme(gradcomp.codec(spec)) is None
        state = gradcomp.CompressionState(spec, model=model, **({"scheme": "allgather"} if gathered else {}))
        records = []
        first_compressed = range(state.start_iter, state.start_iter + 3)
        ddp.register_comm_hook(state, recording_hook(records, rank, wanted=first_compressed.__contains__))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        losses = train(ddp, optimizer, steps, rank)
        results[spec] = {"losses": losses, "records": records, "stats": state.stats(), "start_iter": state.start_iter}
    return results


GPU_LOSSLESS = ["none", "topk:ratio=1", "fp16"]
GPU_SPECS = GPU_LOSSLESS + ["signsgd", "terngrad", "qsgd", "topk:ratio=0.05", "randomk:ratio=0.1", "powersgd:rank=2"]


def on_gpu(rank, world, specs, steps):
    """Both ranks on cuda:0 over gloo: plain DDP, then each spec compressing every bucket from step 0.
    Per configuration: the losses, the synchronized gradients of every step (on the CPU), the stats, and the
    loss on one held-out batch before and after training (each step's batch differs, so the training losses
    of a few steps go up and down with the batch more than with what was learnt)."""
    device = torch.device("cuda", 0)
    x, y = (t.to(device) for t in batch(10_000, 0, rank))
    results = {}
    for name in ["plain", *specs]:
        model = make_model().to(device)
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=BUCKET_CAP_MB)
        state = None if name == "plain" else gradcomp.register(ddp, name, start_iter=0, min_bucket_ratio=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        with torch.no_grad():
            held_out_before = float(nn.functional.cross_entropy(model(x), y))
        losses = train(ddp, optimizer, steps, rank, device=device,
                       record=lambda _: grads.append(torch.cat([g.reshape(-1).cpu() for g in gradients(model)])))
        with torch.no_grad():
            held_out_after = float(nn.functional.cross_entropy(model(x), y))
        results[name] = {"losses": losses, "grads": grads, "stats": state.stats() if state else None,
                         "held_out": (held_out_before, held_out_after)}
    return results


def started(rank, world, spec, start_spec, start_iter, steps):
    """spec registered with start_codec=start_spec for the first start_iter steps. Per step and bucket: the
    bucket's gradient going in, its average coming out and the run's codec's residual after the step ("new"); per
    step: the stats, the state's memory and how many start-codec plans it still holds."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.CompressionState(spec, start_iter=start_iter, start_codec=start_spec, min_bucket_ratio=0,
                                      model=model)
    buckets, steps_seen = [], []
    ddp.register_comm_hook(state, recording_hook(buckets, rank))
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), steps, rank,
          record=lambda step: steps_seen.append({**state.stats()["last"], "start_plans": len(state._start_plans),
                                                 "memory_bytes": state.memory_bytes()}))
    return {"buckets": buckets, "steps": steps_seen}


def recording_hook(records: list, rank: int, wanted=lambda step: True):
    """gradcomp's hook, appending to records, per bucket of the steps wanted: its step, index, rank, parameter keys
    and shapes, the gradient going in, the average coming out, and the run's codec's residual pieces before the
    step ("old") and after it ("new")."""

    def hook(state, bucket):
        step, index = state.iter, bucket.index()
        grad = bucket.buffer().detach().clone()
        old = {k: t.clone() for k, t in _residual_pieces(state._plans.get(index)).items()}
        future = gradcomp.hook(state, bucket)
        if not wanted(step):
            return future
        keys = [state._param_keys[id(p)] for p in bucket.parameters()]
        shapes = [g.shape for g in bucket.gradients()]

        def snapshot(done):
            out = done.value()
            out = out[0] if isinstance(out, list) else out
            new = {k: t.clone() for k, t in _residual_pieces(state._plans.get(index)).items()}
            records.append({"step": step, "bucket": index, "rank": rank, "keys": keys, "shapes": shapes,
                            "grad": grad, "out": out.detach().clone(), "old": old, "new": new})
            return out

        return future.then(snapshot)

    return hook


def _residual_pieces(plan):
    if plan is None:
        return {}
    return {key: piece["residual"] for key, piece in plan.pieces().items() if "residual" in piece}


def resume(rank, world, specs, total, split, workdir, phase):
    """phase "full": total steps uninterrupted, and the first `split` steps with a checkpoint;
    phase "second": fresh processes load that checkpoint and run the rest. Returns the parameters, by the spec's
    position in specs."""
    results = {}
    for index, spec in enumerate(specs):
        path = os.path.join(workdir, f"ckpt.{index}.rank{rank}.pt")
        if phase == "full":
            model, optimizer, _ = _resumable(spec)
            train(model, optimizer, total, rank)
            results[index] = [p.detach().clone() for p in model.parameters()]
            model, optimizer, state = _resumable(spec)
            train(model, optimizer, split, rank)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "gradcomp": state.state_dict()}, path)
        else:
            model, optimizer, state = _resumable(spec)
            checkpoint = torch.load(path, weights_only=False)
            model.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            state.load_state_dict(checkpoint["gradcomp"])
            train(model, optimizer, total - split, rank, first_step=split)
            results[index] = [p.detach().clone() for p in model.parameters()]
    return results


def _resumable(spec):
    """spec: a codec spec, or (spec, register's options)."""
    spec, options = (spec, {}) if isinstance(spec, str) else spec
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec, **options)
    return ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state


def mismatch(rank, world, cases):
    """cases: [(spec, kwargs) per rank]; each case runs a few steps. Returns the error text per case."""
    errors = []
    for per_rank in cases:
        spec, kwargs = per_rank[rank]
        model = make_model()
        ddp = wrap(model)
        gradcomp.register(ddp, spec, **kwargs)
        try:
            train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 4, rank)
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def edge_cases(rank, world):
    """Models and groups that are unusual but legal; returns what the test checks for each."""
    import warnings

    out = {}
    # Buckets of 1-D tensors only, under a matrix codec and an elementwise one.
    for spec in ("powersgd", "topk:ratio=0.5"):
        model = make_model("vectors")
        ddp = wrap(model)
        state = gradcomp.register(ddp, spec, start_iter=0)
        losses = train(ddp, torch.optim.SGD(model.parameters(), lr=0.5), 6, rank)
        out[f"vectors {spec}"] = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                                  "stats": state.stats()}
    # Sparse gradients: averaged by plain allreduce, with a warning.
    model = make_model("sparse")
    ddp = wrap(model)
    gradcomp.register(ddp, "topk", start_iter=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 3, rank)
    out["sparse"] = {"warnings": [str(w.message) for w in caught],
                     "params": [p.detach().clone() for p in model.parameters()]}
    # A process group of one rank per process: compression applies, nothing travels.
    groups = [dist.new_group([r]) for r in range(world)]
    model = make_model()
    ddp = DDP(model, process_group=groups[rank], bucket_cap_mb=BUCKET_CAP_MB)
    state = gradcomp.register(ddp, "topk:ratio=0.1", process_group=groups[rank], start_iter=0)
    out["world of one"] = {"losses": train(ddp, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), 20, rank),
                           "stats": state.stats()}
    # Registered twice.
    model = make_model()
    ddp = wrap(model)
    gradcomp.register(ddp, "topk")
    try:
        gradcomp.register(ddp, "qsgd")
        out["twice"] = None
    except Exception as error:  # noqa: BLE001
        out["twice"] = f"{type(error).__name__}: {error}"
    # fp16 and bf16 models.
    for dtype in (torch.float16, torch.bfloat16):
        for spec in ("qsgd", "powersgd", "topk:ratio=0.1"):
            model = make_model().to(dtype)
            ddp = wrap(model)
            state = gradcomp.register(ddp, spec, start_iter=0)
            losses = train(ddp, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), 8, rank, dtype=dtype)
            out[f"{dtype} {spec}"] = {"losses": losses, "compressed": state.stats()["total"]["compressed_buckets"],
                                      "params": [p.detach().float().clone() for p in model.parameters()]}
    return out


def state_checks(rank, world):
    """Checkpoint refusals, per-step stats and logging, on live process groups."""
    import logging

    out = {}
    model = make_model()
    ddp = wrap(model)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("gradcomp").addHandler(handler)
    logging.getLogger("gradcomp").setLevel(logging.INFO)
    state = gradcomp.register(ddp, "topk:ratio=0.1", log_every=2)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 5, rank)
    out["log"] = messages
    out["stats"] = state.stats()
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    saved = state.state_dict()
    refusals = {}
    for name, other in {
        "codec": gradcomp.CompressionState("topk:ratio=0.2"),
        "start_iter": gradcomp.CompressionState("topk:ratio=0.1", start_iter=5),
        "start_codec": gradcomp.CompressionState("topk:ratio=0.1", start_codec="fp16"),
    }.items():
        try:
            other.load_state_dict(saved)
        except ValueError as error:
            refusals[name] = str(error)
    other_rank = dict(saved, rank=(rank + 1) % world)
    try:
        gradcomp.CompressionState("topk:ratio=0.1").load_state_dict(other_rank)
    except ValueError as error:
        refusals["rank"] = str(error)
    try:
        gradcomp.CompressionState("topk:ratio=0.1").load_state_dict({"model": 1})
    except ValueError as error:
        refusals["foreign"] = str(error)
    out["refusals"] = refusals
    fresh = gradcomp.CompressionState("topk:ratio=0.1")
    fresh.load_state_dict(saved)
    out["reloaded"] = fresh.state_dict()
    out["saved"] = saved
    return out


def local_squares(rank, world):
    """benchmarks/lm_variants.py's AdamW whose second moment is the ranks' own gradients squared, in blocks of 4:
    3 steps of a linear layer under DDP and topk. Returns what the optimizer holds, and the same computed here
    from each rank's gradient taken without DDP and gathered."""
    variants = load_benchmark("lm_variants.py")
    variants.LOCAL_SQUARES_BLOCK = 4
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    config = variants.lm.Config(clip_norm=0.5)
    optimizer = variants.make_optimizer(model, config)
    ddp = DDP(model)
    squares = variants.register_codec(ddp, "topk:ratio=0.5", "auto")
    beta1, beta2 = 0.9, 0.95
    expected_m = [torch.zeros_like(p) for p in model.parameters()]
    expected_v = [torch.zeros_like(p) for p in model.parameters()]
    scales = []
    for step in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        own = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))  # no DDP: this rank's own
        ddp(x).square().mean().backward()
        gathered = [[torch.empty_like(g) for _ in range(world)] for g in own]
        for g, into in zip(own, gathered):
            dist.all_gather(into, g)
        block_squares = []
        for into in gathered:
            mean_square = (sum(g.square() for g in into) / world).flatten()
            means = [mean_square[i:i + 4].mean() for i in range(0, mean_square.numel(), 4)]
            block_squares.append(torch.stack([means[i // 4] for i in range(mean_square.numel())]).view_as(into[0]))
        norm = float(sum(b.sum() for b in block_squares)) ** 0.5
        scale = min(1.0, 0.5 / (norm + 1e-6))
        scales.append(scale)
        for p, m, v, b in zip(model.parameters(), expected_m, expected_v, block_squares):
            m.mul_(beta1).add_(p.grad, alpha=(1 - beta1) * scale)  # p.grad: what the codec delivered
            v.mul_(beta2).add_(b, alpha=(1 - beta2) * scale ** 2)
        optimizer.step()
        optimizer.zero_grad()
    held = [optimizer.state[p] for p in model.parameters()]
    return {"m": [s["m"] for s in held], "v": [s["v"] for s in held], "expected_m": expected_m,
            "expected_v": expected_v, "scales": scales, "wire_bytes": squares.wire_bytes}
