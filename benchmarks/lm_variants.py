"""lm.py's benchmark with variants gradcomp does not ship, written in plain PyTorch: a fix is tried here before
it is built into a codec.

    python benchmarks/lm_variants.py --codecs blocksign:block=256 --seeds 0 --out DIR   # any of lm.py's options
    python benchmarks/lm_variants.py --freeze-variance-after 240 --codecs none topk:ratio=0.01 --out DIR
    python benchmarks/lm_variants.py --spread decay --codecs topk:ratio=0.01 --out DIR
    python benchmarks/lm_variants.py --plain-steps 30 --codecs signsgd:error_feedback=false --out DIR
    python benchmarks/lm_variants.py --codecs scaledtopk:ratio=0.01,by=none,warmup=120 --out DIR
    python benchmarks/lm_variants.py --local-variance 256 --codecs none topk:ratio=0.01 --out DIR

blocksign:block=B[,error_feedback=0][,fraction=F[,hold=1]]: signsgd with one scale, the mean |m| of its block,
    per block of B elements of the bucket; m = gradient + residual. It measured the fix before gradcomp's signsgd
    had its block option, and stays as an independent check of that codec in training. Every rank's decoded tensor
    is averaged by one allreduce, the arithmetic that signsgd's allgather of payloads gives; the bytes counted
    are what such a payload would be (header, a sign bit and 1/B of an fp32 scale per element sent) under the
    allgather scheme. Like gradcomp's hook it starts after --plain-steps steps of plain allreduce (2: DDP rebuilds
    its buckets at step 0), counted per step.
    fraction=F: each step only a random F of the elements, the same on every rank (a seed shared as randomk's
    is: no index bytes), in blocks of B of them; the others decode to 0. hold=1: an element not sent repeats
    its last average instead.
    momentum=M: the signs of this rank's running mean of its gradient (M on the old mean, 1 - M on the gradient)
    instead of the gradient's.
scaledtopk:ratio=R[,by=element|tensor|none][,warmup=N][,keep=K]: topk with error feedback, its k = ceil(R n) elements
    chosen by |m| over this rank's running RMS of the gradient (beta 0.95, as AdamW's second moment), per element
    (by=element, the default) or per parameter (by=tensor), or by |m| alone (by=none: gradcomp's topk, whose
    bytes it counts). warmup=N: DGC's sparsity warm-up, the ratio falling exponentially from 0.25 to R over
    the first N compressed steps. keep=K: the residual is multiplied by K each step (1: error feedback, 0: none),
    so that mass left unsent for long fades.
--start-codec SPEC: gradcomp.register's start_codec: SPEC (one without error feedback) in place of plain allreduce
    for the first --plain-steps steps, then the run's codec.
--plain-steps N: N steps of plain allreduce (or of --start-codec) before the run's codec starts (gradcomp.register's
    start_iter; default 2; with --freeze-variance-after, the larger of the two).
--spread decay|hold: gradcomp's codec, its averaged gradient handed to the optimizer spread out in time by how
    long each element went unsent (class Spread), against the bursts error feedback makes of rarely sent elements.
--local-variance B: AdamW's second moment made of each rank's own gradient squared, taken before the codec and
    averaged over the ranks (one mean per block of B elements of a parameter, B=1 per element; an allreduce per
    step, its bytes counted), instead of the codec's averaged gradient squared (class VariantAdamW). The
    step is then linear in what the codec delivers, and error feedback's bursts arrive at full size instead of
    being divided by themselves. The clipping uses the same squares' norm. This changes uncompressed training
    too (the ranks' own squares hold more noise than their average's): compare with lm.py's `none` as well.
--freeze-variance-after N: 1-bit Adam's recipe. N steps of plain allreduce (the hook's start_iter), then AdamW's
    second moment stops changing, so that its step becomes linear in the gradient; every codec applies.

Specs other than blocksign and scaledtopk go to gradcomp as in lm.py. Results are lm.{json,csv,png} in --out: give
a folder of their own, not benchmarks/results.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp._ops import _C  # noqa: E402
from gradcomp.schemes.base import ring_allreduce_bytes  # noqa: E402

PLAIN_STEPS_ENV = "GRADCOMP_LM_PLAIN_STEPS"
PLAIN_STEPS = int(os.environ.get(PLAIN_STEPS_ENV, "2"))  # default: gradcomp.register's start_iter

FREEZE_ENV = "GRADCOMP_LM_FREEZE_VARIANCE_AFTER"
# Read at import: under mp.spawn every rank imports this file again, so main's setting reaches the ranks too.
FREEZE_AFTER = int(os.environ.get(FREEZE_ENV, "0"))
SPREAD_ENV = "GRADCOMP_LM_SPREAD"
SPREAD = os.environ.get(SPREAD_ENV, "")
START_CODEC_ENV = "GRADCOMP_LM_START_CODEC"
START_CODEC = os.environ.get(START_CODEC_ENV, "")
LOCAL_SQUARES_ENV = "GRADCOMP_LM_LOCAL_SQUARES_BLOCK"
LOCAL_SQUARES_BLOCK = int(os.environ.get(LOCAL_SQUARES_ENV, "0"))  # --local-variance's block; 0: off


class Spread:
    """Hands each element's decoded gradient to the optimizer spread over the steps it went unsent.

    decay: what arrives joins a pending sum, of which 1/s leaves per step (s: the element's last gap
        between arrivals, so a time constant of one gap); nothing is lost. hold: the last arrival divided
        by its gap, every step until the next arrival (what it hands out is not what arrived). Both are
        computed from the averaged gradient, the same on every rank."""

    def __init__(self, state, mode: str):
        self.state, self.mode = state, mode
        self.buffers: dict[int, tuple] = {}
        self.steps: dict[int, int] = {}

    def apply(self, index: int, out: torch.Tensor) -> torch.Tensor:
        step = self.steps[index] = self.steps.get(index, 0) + 1
        buffers = self.buffers.get(index)
        if buffers is None or buffers[0].numel() != out.numel():
            steps = dict(dtype=torch.float32)  # exact step numbers whatever the gradient's dtype
            buffers = self.buffers[index] = (torch.zeros_like(out), torch.full_like(out, step - 1.0, **steps),
                                             torch.ones_like(out, **steps))
        carried, last_arrival, gap = buffers  # pending (decay) or held (hold) values; step numbers
        arrived = out != 0
        gap.copy_(torch.where(arrived, step - last_arrival, gap))
        last_arrival.masked_fill_(arrived, float(step))
        if self.mode == "decay":
            carried.add_(out)
            out.copy_(carried / gap)
            carried.sub_(out)
        else:
            carried.copy_(torch.where(arrived, out / gap, carried))
            out.copy_(carried)
        return out


def spread_hook(spread: Spread, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    past_warmup = spread.state.iter >= spread.state.start_iter  # read first: the hook counts the step at its end
    future = gradcomp.hook(spread.state, bucket)
    if not past_warmup:  # a bucket sent plain later on is dense: a gap of 1 everywhere, handed on as it is
        return future
    index = bucket.index()
    return future.then(lambda done: spread.apply(index, done.value()))


class StandInState:
    """A pure-PyTorch codec's per-bucket residuals and byte counts, with the part of CompressionState's interface
    lm.train_one reads."""

    def __init__(self, spec: str, world: int, plain_steps: int):
        self.spec, self.world, self.plain_steps = spec, world, plain_steps
        self.residuals: dict[int, torch.Tensor] = {}
        self.step = 0  # counted per step, as gradcomp's hook does: a bucket DDP adds at its rebuild is no later
        self.raw_bytes = self.wire_bytes = 0

    def stats(self) -> dict:
        return {"total": {"raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes}, "schemes": {}}


def bucket_zeros(store: dict[int, torch.Tensor], index: int, grad: torch.Tensor) -> torch.Tensor:
    """store's tensor for bucket `index`, zeros like grad when it has none or DDP rebuilt its buckets."""
    tensor = store.get(index)
    if tensor is None or tensor.numel() != grad.numel():
        tensor = store[index] = torch.zeros_like(grad)
    return tensor


def spec_options(spec: str, valid: tuple[str, ...]) -> dict[str, str]:
    """A stand-in spec's options, 'name:key=value,...', refusing keys not in `valid`."""
    name, _, rest = spec.partition(":")
    options = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    unknown = set(options) - set(valid)
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {sorted(unknown)}; valid: {', '.join(valid)}")
    return options


def flag(options: dict[str, str], key: str, default: str) -> bool:
    return options.get(key, default) not in ("0", "False", "false")


class BlockSignState(StandInState):
    def __init__(self, spec: str, block: int, error_feedback: bool, fraction: float, hold: bool, momentum: float,
                 world: int, plain_steps: int):
        super().__init__(spec, world, plain_steps)
        self.block, self.error_feedback = block, error_feedback
        self.fraction, self.hold, self.momentum = fraction, hold, momentum
        self.momenta: dict[int, torch.Tensor] = {}
        self.held: dict[int, torch.Tensor] = {}


def block_sign_decoded(m: torch.Tensor, block: int) -> torch.Tensor:
    """sign(m) times its block's mean |m| (the last block may be short); m >= 0 decodes to +scale."""
    n = m.numel()
    blocks = -(-n // block)
    padded = torch.cat([m, m.new_zeros(blocks * block - n)]).view(blocks, block)
    lengths = torch.full((blocks, 1), float(block), dtype=m.dtype)
    lengths[-1] = n - (blocks - 1) * block
    scale = padded.abs().sum(1, keepdim=True) / lengths
    return torch.where(padded >= 0, scale, -scale).flatten()[:n]


def sparse_block_sign_decoded(m: torch.Tensor, block: int, sent: torch.Tensor) -> torch.Tensor:
    """block_sign_decoded of the elements `sent` (a mask), in their order, blocks of `block` of them; 0 elsewhere."""
    decoded = torch.zeros_like(m)
    count = int(sent.sum())
    if count:
        decoded[sent] = block_sign_decoded(m[sent], min(block, count))
    return decoded


def running_mean(store: dict[int, torch.Tensor], index: int, value: torch.Tensor, beta: float) -> torch.Tensor:
    """store's running mean for bucket `index` (beta on the old mean, 1 - beta on value), started at value when it
    has none or DDP rebuilt its buckets. Should DDP re-lay a bucket after step 0 without changing its size, step 0's
    part sits on other elements and fades by beta per step."""
    mean = store.get(index)
    if mean is None or mean.numel() != value.numel():
        mean = store[index] = value.clone()
        return mean
    return mean.mul_(beta).add_(value, alpha=1 - beta)


def local_momentum(state: BlockSignState, index: int, grad: torch.Tensor) -> torch.Tensor:
    """This rank's running mean of its own gradient (its weight on the newest: 1 - momentum), plain steps included."""
    return running_mean(state.momenta, index, grad, state.momentum)


def begin_bucket(state: StandInState, bucket: dist.GradBucket) -> tuple[torch.Tensor, int, int, int, int]:
    """The bucket's gradient, size, index and step (counted per step, as gradcomp's hook does: a bucket DDP adds at
    its rebuild is no later), and the bytes plain allreduce would send for it, added to the state's count."""
    grad = bucket.buffer()
    step = state.step
    if bucket.is_last():
        state.step += 1
    raw = ring_allreduce_bytes(grad.numel() * grad.element_size(), state.world)
    state.raw_bytes += raw
    return grad, grad.numel(), bucket.index(), step, raw


def aligned_payload(body_bytes: int) -> int:
    return -(-(_C.header_bytes + body_bytes) // _C.payload_align) * _C.payload_align


def block_sign_hook(state: BlockSignState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    grad, n, index, step, raw = begin_bucket(state, bucket)
    sent = None
    signal = local_momentum(state, index, grad) if state.momentum else grad
    if step < state.plain_steps:
        state.wire_bytes += raw
    else:
        m = signal
        if state.error_feedback:
            residual = bucket_zeros(state.residuals, index, grad)
            m = signal + residual
        if state.fraction < 1:  # the same random elements on every rank: their indices need no bytes
            generator = torch.Generator().manual_seed(step * 1_000_003 + index)
            sent = torch.rand(n, generator=generator) < state.fraction
            signs, decoded = int(sent.sum()), sparse_block_sign_decoded(m, state.block, sent)
        else:
            signs, decoded = n, block_sign_decoded(m, min(state.block, n))
        if state.error_feedback:
            residual.copy_(m - decoded)
        body = 4 * -(-signs // state.block) + -(-signs // 8)  # the scales, then the sign bits
        payload = aligned_payload(body)
        state.wire_bytes += (state.world - 1) * payload  # every rank's payload to every other rank
        grad.copy_(decoded)
    grad.div_(state.world)
    future = dist.all_reduce(grad, async_op=True).get_future().then(lambda fut: fut.value()[0])
    if sent is None or not state.hold:
        return future
    held = bucket_zeros(state.held, index, grad)

    def hold_unsent(done):  # every element keeps its last average until it is sent again
        average = done.value()
        held[sent] = average[sent]
        return average.copy_(held)

    return future.then(hold_unsent)


def parse_block_sign(spec: str) -> tuple[int, bool, float, bool, float]:
    options = spec_options(spec, ("block", "error_feedback", "fraction", "hold", "momentum"))
    momentum = float(options.get("momentum", 0))
    if not 0 <= momentum < 1:
        raise ValueError(f"blocksign: momentum must be in [0, 1), got {momentum}")
    block, fraction = int(options.get("block", 256)), float(options.get("fraction", 1))
    if block < 1:
        raise ValueError(f"blocksign: block must be at least 1, got {block}")
    if not 0 < fraction <= 1:
        raise ValueError(f"blocksign: fraction must be in (0, 1], got {fraction}")
    error_feedback, hold = flag(options, "error_feedback", "1"), flag(options, "hold", "0")
    if hold and (fraction == 1 or error_feedback):  # with error feedback, what it repeats would be sent again
        raise ValueError("blocksign: hold=1 repeats the elements a step does not send: give a fraction below 1 "
                         "and error_feedback=0")
    return block, error_feedback, fraction, hold, momentum


class ScaledTopKState(StandInState):
    def __init__(self, spec: str, ratio: float, by: str, warmup: int, keep: float, world: int, plain_steps: int):
        super().__init__(spec, world, plain_steps)
        self.ratio, self.by, self.warmup, self.keep = ratio, by, warmup, keep
        self.mean_squares: dict[int, torch.Tensor] = {}  # this rank's running mean squared gradient


SCALE_BETA = 0.95  # AdamW's beta2 in lm.py: the scale is the RMS AdamW would divide this rank's gradient by


def tensor_mean_squares(grad: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each parameter's mean squared gradient, repeated over its elements."""
    means = torch.stack([part.square().mean() for part in grad.split(sizes)])
    return means.repeat_interleave(torch.tensor(sizes, device=grad.device))


def scaled_top_k_sent(m: torch.Tensor, mean_square: torch.Tensor | None, k: int) -> torch.Tensor:
    """m's k elements of largest |m| / sqrt(mean_square) (of largest |m| without it), 0 elsewhere."""
    score = m.abs() if mean_square is None else m.abs() / mean_square.sqrt().clamp_min(1e-30)
    chosen = score.topk(k, sorted=False).indices
    sent = torch.zeros_like(m)
    sent[chosen] = m[chosen]
    return sent


def running_mean_square(state: ScaledTopKState, bucket: dist.GradBucket) -> torch.Tensor:
    """This rank's running mean of the squared gradient, per element or per parameter, plain steps included."""
    grad, index = bucket.buffer(), bucket.index()
    if state.by == "tensor":
        sizes = [p.numel() for p in bucket.parameters()]
        if sum(sizes) != grad.numel():
            raise RuntimeError(f"scaledtopk: bucket {index} holds {grad.numel()} elements, its parameters "
                               f"{sum(sizes)}")
        squares = tensor_mean_squares(grad, sizes)
    else:
        squares = grad.square()
    return running_mean(state.mean_squares, index, squares, SCALE_BETA)


def scaled_top_k_hook(state: ScaledTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    grad, n, index, step, raw = begin_bucket(state, bucket)
    mean_square = None if state.by == "none" else running_mean_square(state, bucket)
    if step < state.plain_steps:
        state.wire_bytes += raw
    else:
        residual = bucket_zeros(state.residuals, index, grad)
        m = grad + residual
        k = gradcomp.codecs.count_for_ratio(warmed_up_ratio(state.ratio, state.warmup, step - state.plain_steps), n)
        sent = scaled_top_k_sent(m, mean_square, k)
        torch.sub(m, sent, out=residual).mul_(state.keep)
        payload = aligned_payload(8 * k)  # topk's: k int32 indices, then k fp32 values
        state.wire_bytes += (state.world - 1) * payload
        grad.copy_(sent)
    grad.div_(state.world)
    return dist.all_reduce(grad, async_op=True).get_future().then(lambda fut: fut.value()[0])


WARMUP_START_RATIO = 0.25  # DGC's sparsity warm-up: 75% sparse at first, falling exponentially to the target


def warmed_up_ratio(ratio: float, warmup: int, compressed_step: int) -> float:
    if compressed_step >= warmup or ratio >= WARMUP_START_RATIO:
        return ratio
    return WARMUP_START_RATIO * (ratio / WARMUP_START_RATIO) ** (compressed_step / warmup)


def parse_scaled_top_k(spec: str) -> tuple[float, str, int, float]:
    options = spec_options(spec, ("ratio", "by", "warmup", "keep"))
    ratio, by, warmup = float(options.get("ratio", 0.01)), options.get("by", "element"), int(options.get("warmup", 0))
    keep = float(options.get("keep", 1))
    if warmup < 0:
        raise ValueError(f"scaledtopk: warmup must be >= 0 steps, got {warmup}")
    if not 0 <= keep <= 1:
        raise ValueError(f"scaledtopk: keep must be in [0, 1], got {keep}")
    if not 0 < ratio <= 1:
        raise ValueError(f"scaledtopk: ratio must be in (0, 1], got {ratio}")
    if by not in ("element", "tensor", "none"):
        raise ValueError(f"scaledtopk: by must be element, tensor or none, got {by!r}")
    return ratio, by, warmup, keep


def register_codec(ddp, spec: str, scheme: str):
    plain_steps = max(FREEZE_AFTER, PLAIN_STEPS)
    # gradcomp.register's options, also for the states of the hooks that wrap gradcomp's
    options = dict(scheme=scheme, start_iter=plain_steps, start_codec=START_CODEC or None)
    if LOCAL_SQUARES_BLOCK:
        squares = RUN_SQUARES[0]
        squares.state = gradcomp.CompressionState(spec, model=ddp.module, **options)
        ddp.register_comm_hook(squares, local_squares_hook)
        return squares
    if SPREAD:
        state = gradcomp.CompressionState(spec, model=ddp.module, **options)
        ddp.register_comm_hook(Spread(state, SPREAD), spread_hook)
        return state
    if spec.startswith("scaledtopk"):
        ratio, by, warmup, keep = parse_scaled_top_k(spec)
        state = ScaledTopKState(spec, ratio, by, warmup, keep, dist.get_world_size(), plain_steps)
        ddp.register_comm_hook(state, scaled_top_k_hook)
        return state
    if not spec.startswith("blocksign"):
        return gradcomp.register(ddp, spec, **options)
    block, error_feedback, fraction, hold, momentum = parse_block_sign(spec)
    state = BlockSignState(spec, block, error_feedback, fraction, hold, momentum, dist.get_world_size(),
                           plain_steps)
    ddp.register_comm_hook(state, block_sign_hook)
    return state


def check_spec(spec: str) -> None:
    options = (("--spread", SPREAD), ("--start-codec", START_CODEC), ("--local-variance", LOCAL_SQUARES_BLOCK))
    for option, given in options:
        if spec.startswith(("blocksign", "scaledtopk")) and given:
            raise ValueError(f"{option} applies to gradcomp's codecs, not to blocksign or scaledtopk")
    if spec.startswith("blocksign"):
        parse_block_sign(spec)
    elif spec.startswith("scaledtopk"):
        parse_scaled_top_k(spec)
    else:
        gradcomp.codec(spec)


class LocalSquares:
    """Each rank's own gradient squared, per parameter, as the means of its blocks of `block` elements, taken in
    the hook before the codec sees the gradient; what VariantAdamW's second moment is made of. Wraps gradcomp's
    hook and state."""

    def __init__(self, block: int):
        self.state, self.block = None, block
        self.local: dict[torch.Tensor, torch.Tensor] = {}
        self.wire_bytes = 0  # the statistic's allreduce, per rank

    @property
    def spec(self) -> str:
        return self.state.spec

    def stats(self) -> dict:
        stats = self.state.stats()
        total = dict(stats["total"], wire_bytes=stats["total"]["wire_bytes"] + self.wire_bytes)
        return dict(stats, total=total)


def local_squares_hook(squares: LocalSquares, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    for parameter, grad in zip(bucket.parameters(), bucket.gradients()):
        squares.local[parameter] = block_means(grad.detach().square(), squares.block)
    return gradcomp.hook(squares.state, bucket)


def block_means(values: torch.Tensor, block: int) -> torch.Tensor:
    """The mean of each block of `block` elements of values, flattened (the last block may be short)."""
    flat = values.flatten()
    sums = torch.zeros((flat.numel() + block - 1) // block, dtype=flat.dtype, device=flat.device)
    index = torch.arange(flat.numel(), device=flat.device) // block
    counts = torch.bincount(index, minlength=sums.numel()).to(flat.dtype)
    return sums.index_add_(0, index, flat) / counts


class VariantAdamW(torch.optim.Optimizer):
    """torch's AdamW (decoupled weight decay, bias-corrected moments), with two variants of its second moment.

    freeze_after=N: the second moment, and its bias correction, stop changing after N steps (1-bit Adam).
    squares (LocalSquares): the second moment is made of every rank's own gradient squared, averaged over the
        ranks (one allreduce per step, counted in the run's bytes), not of the codec's averaged gradient: the
        same on every rank, and blind to how the codec delivers the gradient (error feedback's bursts). Per
        element (block=1) or one mean per block of the squares' block of elements of each parameter. The
        clipping is done here, by the norm those squares give (the root mean square of the ranks' own gradient
        norms), on both moments alike; lm.py's clipping then only measures the norm. From 2 ranks on this is not
        AdamW even without compression: the ranks' own squares hold more noise than the average's square, and
        their norm is larger, so compare with lm.py's `none` as well as with this variant's."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float = 0.0,
                 eps: float = 1e-8, freeze_after: int = 0, squares: LocalSquares | None = None,
                 clip_norm: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, eps=eps))
        self.freeze_after, self.squares, self.clip_norm = freeze_after, squares, clip_norm

    @torch.no_grad()
    def shared_squares(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """Per parameter, the ranks' mean of their own gradient squared (per block, expanded back to the
        parameter's shape), and the clipping factor for the norm it gives."""
        block = self.squares.block
        reduced = [self.squares.local.pop(p) for p in params]
        flat = torch.cat(reduced)
        world = dist.get_world_size()
        dist.all_reduce(flat)
        flat /= world
        self.squares.wire_bytes += ring_allreduce_bytes(flat.numel() * flat.element_size(), world)
        shared, offset, norm_square = [], 0, 0.0
        for p, mine in zip(params, reduced):
            means = flat[offset:offset + mine.numel()]
            offset += mine.numel()
            assert means.numel() == -(-p.numel() // block), "a parameter's squares are not its own"
            expanded = means.repeat_interleave(block)[:p.numel()].view_as(p)
            norm_square += float(expanded.sum())
            shared.append(expanded)
        scale = min(1.0, self.clip_norm / (norm_square ** 0.5 + 1e-6)) if self.clip_norm else 1.0
        return shared, scale

    @torch.no_grad()
    def step(self):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        shared, scale = self.shared_squares(params) if self.squares else (None, 1.0)
        variance_inputs = dict(zip(params, shared)) if shared else {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, variance_steps=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["m"].mul_(beta1).add_(p.grad, alpha=(1 - beta1) * scale)
                if p in variance_inputs:
                    state["v"].mul_(beta2).add_(variance_inputs[p], alpha=(1 - beta2) * scale * scale)
                    state["variance_steps"] = state["step"]
                elif not self.freeze_after or state["step"] <= self.freeze_after:
                    state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    state["variance_steps"] = state["step"]
                m_hat = state["m"] / (1 - beta1 ** state["step"])
                v_hat = state["v"] / (1 - beta2 ** state["variance_steps"])
                p.addcdiv_(m_hat, v_hat.sqrt_().add_(group["eps"]), value=-group["lr"])


# The running optimizer's squares, for register_codec: lm.train_one makes the optimizer first (one run at a time).
RUN_SQUARES: list[LocalSquares] = []


def make_optimizer(model, config: lm.Config) -> torch.optim.Optimizer:
    if not FREEZE_AFTER and not LOCAL_SQUARES_BLOCK:
        return ADAMW_OR_SGD(model, config)
    squares = None
    if LOCAL_SQUARES_BLOCK:
        squares = LocalSquares(LOCAL_SQUARES_BLOCK)
        RUN_SQUARES[:] = [squares]
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return VariantAdamW([{"params": decayed, "weight_decay": config.weight_decay},
                         {"params": others, "weight_decay": 0.0}],
                        lr=config.peak_lr, betas=(0.9, 0.95), freeze_after=FREEZE_AFTER, squares=squares,
                        clip_norm=config.clip_norm)


ADAMW_OR_SGD = lm.make_optimizer
# lm.train_one and lm.parse_args look these up in lm's globals when they run, in every rank.
lm.register_codec, lm.check_spec, lm.make_optimizer = register_codec, check_spec, make_optimizer
lm.CLIP_IN_OPTIMIZER = bool(LOCAL_SQUARES_BLOCK)


def main() -> None:
    global FREEZE_AFTER, SPREAD, PLAIN_STEPS, START_CODEC, LOCAL_SQUARES_BLOCK
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--plain-steps", type=int, default=PLAIN_STEPS)
    parser.add_argument("--freeze-variance-after", type=int, default=0)
    parser.add_argument("--spread", choices=["decay", "hold"], default="")
    parser.add_argument("--start-codec", default="")
    parser.add_argument("--local-variance", type=int, default=0, metavar="BLOCK")
    known, rest = parser.parse_known_args()
    if known.local_variance < 0 or (known.local_variance and (known.spread or known.freeze_variance_after)):
        raise SystemExit(f"--local-variance takes a block size >= 1 (0: off), got {known.local_variance}, and "
                         "goes with neither --spread nor --freeze-variance-after")
    os.environ[LOCAL_SQUARES_ENV] = str(known.local_variance)
    LOCAL_SQUARES_BLOCK = known.local_variance
    lm.CLIP_IN_OPTIMIZER = bool(LOCAL_SQUARES_BLOCK)
    if known.start_codec:
        if known.spread or known.freeze_variance_after:
            raise SystemExit("--start-codec goes with neither --spread nor --freeze-variance-after")
        gradcomp.CompressionState("none", start_codec=known.start_codec)  # a bad one fails here, naming valid ones
    os.environ[START_CODEC_ENV] = START_CODEC = known.start_codec
    if known.freeze_variance_after < 0:
        raise SystemExit(f"--freeze-variance-after must be >= 0, got {known.freeze_variance_after}")
    if known.plain_steps < 2:  # as the hook's start_iter: no codec before DDP has rebuilt its buckets after step 0
        raise SystemExit(f"--plain-steps must be >= 2, got {known.plain_steps}")
    os.environ[PLAIN_STEPS_ENV] = str(known.plain_steps)
    PLAIN_STEPS = known.plain_steps
    os.environ[SPREAD_ENV] = SPREAD = known.spread  # before lm.parse_args, whose check_spec reads it
    args = lm.parse_args(rest)
    if (known.freeze_variance_after or LOCAL_SQUARES_BLOCK) and args.config.optimizer != "adamw":
        raise SystemExit("--freeze-variance-after and --local-variance apply to AdamW, not to --optimizer sgd")
    os.environ[FREEZE_ENV] = str(known.freeze_variance_after)
    FREEZE_AFTER = known.freeze_variance_after
    if "--out" not in rest and not any(a.startswith("--out=") for a in rest):
        raise SystemExit("lm_variants.py: give --out DIR (a folder of its own, not benchmarks/results)")
    variants = {"freeze_variance_after": FREEZE_AFTER, "spread": SPREAD, "plain_steps": max(FREEZE_AFTER, PLAIN_STEPS)}
    if START_CODEC:  # absent otherwise, as in the reports from before it
        variants["start_codec"] = START_CODEC
    if LOCAL_SQUARES_BLOCK:
        variants["local_variance_block"] = LOCAL_SQUARES_BLOCK
    path = os.path.join(args.out, "lm" + ("_quick" if args.quick else "") + ".json")
    if not args.replot and not args.fresh and os.path.exists(path):  # lm.main merges into it: the same variant only
        with open(path) as f:
            earlier = json.load(f).get("variants")
        if earlier != variants:
            raise SystemExit(f"lm_variants.py: {path} holds runs of the variant {earlier}, not {variants}: give "
                             "another --out, or --fresh")
    lm.main(rest)
    if not args.replot:  # the report says which variant ran
        with open(path) as f:
            report = json.load(f)
        report["variants"] = variants
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
