"""policy="time": per bucket, the fastest way to send it (plain allreduce, or the codec under each scheme it can
take), from a cost model measured on the job itself, never what the model predicts to be slower than plain DDP.

The model
    collectives: seconds per bytes, per kind (allreduce, all-gather, all-to-all, reduce-scatter) and level (the
        whole group; inside a node and across nodes where the ranks form several nodes of several), measured at the
        decision by probes of each kind at sizes 4x apart, and at the buckets' own sizes by the plain warm-up steps'
        allreduces; straight between the measured sizes (a Curve: a link is not one alpha + beta x bytes line);
    compute: each option's plan launched on the gradient in hand (tiled to the bucket's size) with local collectives
        (DryStep), timed per bucket shape on this device and dtype: the codec's kernels and all the hook does around
        them, split at the first collective into encode and decode (the planner, gradcomp.plan, uses per-element
        kernel costs instead, measured or stated);
    overlap with backward: DDP launches bucket i when backward has produced it, at offset r_i after the first (the
        warm-up steps' hook calls). Collectives go one at a time in launch order (where the backend runs several at
        once they share the link, which ends the last of them no sooner); a bucket's encode runs on the
        hook's thread (the backward's stream on a GPU), so it delays the buckets after it. What a step costs beyond
        backward without communication (its exposed time) is a queue, in the order the hook issues collectives:
            first round, in launch order:  ready_i = r_i + the encodes before i;
                start_i = max(ready_i + encode_i, end_(i-1));  end_i = start_i + wire_i + middle_i (+ decode_i);
            second round (PowerSGD's Q, two-phase's and the node's all-gathers), which the sequencer issues in bucket
                order once the last bucket is launched (at r_last + every encode):
                start2_i = max(r_last + the encodes, end_i, end of the collective before);  end = start2_i +
                second_i + decode_i;
            exposed = the last end - r_last.
        A bucket whose communication hides behind later buckets' backward gains nothing from compression, and the
        choice leaves it plain.
The decision, at the first step after the warm-up: every rank measures; one allreduce (MAX: the slowest rank sets
the pace) combines the measurements; every rank then chooses from the same numbers by the same arithmetic: per
bucket the option with the least encode + wire + decode where it beats plain by MARGIN, then, bucket by bucket,
the option that shortens the exposed time most given the others (two passes); the same from each option taken for
every bucket; the best predicted of these and of each option for every bucket. It stands only where its exposed
time beats all-plain's by MARGIN; else every bucket goes plain. So the choice is never predicted slower than plain
DDP, nor slower than any option fixed for every bucket by more than MARGIN (within which plain is preferred). It
is kept in the state (a resumed run repeats it) and taken anew every `remeasure_every` steps where that is set.
Then the run tries the model's shortlist for a few steps each and keeps the fastest measured, compression only
where its gain over plain is clear of the rounds' scatter (gradcomp.trial; trial_steps=0 leaves the model's choice).
Known limits (benchmarks/README.md, policy.py): the hook's per-step work on busy cores is not in the dry runs, and
compute on the collectives' callbacks is taken to hold the link; on shared CPU cores the model under-predicts.
On a GPU every time is a pair of CUDA events, read at the decision and at each of the trial's verdicts (one sync
each), none per step.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import trial as policy_trial
from .codecs import chunk_bounds
from .powersgd import PowerSGD
from .schemes import AllreduceBucket, PowerSGDBucket
from .schemes.hierarchical import inner_plan_class
from .step import Step

POLICIES = ("codec", "time")
MARGIN = 0.05  # an option replaces plain only where the model predicts it at least this much faster
KINDS = ("allreduce", "all-gather", "all-to-all", "reduce-scatter")
PROBE_BYTES = tuple(1 << b for b in range(10, 24, 2)) + (1 << 23,)  # up to the largest bucket, at most 8 MiB
PROBE_REPEATS = 2  # after one untimed run; the least is kept (the others met noise)


def check_policy(policy, start_iter: int, start_codec, min_bucket_ratio: float) -> str:
    if policy not in POLICIES:
        raise ValueError(f"gradcomp: policy={policy!r}; valid: {', '.join(map(repr, POLICIES))} ('codec': every "
                         f"bucket under the codec, as the scheme option says; 'time': per bucket the fastest of plain "
                         f"allreduce and the codec's schemes, from the job's measured links and kernels)")
    if policy == "time":
        if start_iter < 2:
            raise ValueError(f"gradcomp: policy='time' measures the links and the backward during the plain warm-up "
                             f"steps after DDP's first one; start_iter={start_iter} leaves none: give start_iter >= 2")
        if start_codec is not None:
            raise ValueError("gradcomp: policy='time' times the backward during plain warm-up steps; a start_codec "
                             "would change them: leave start_codec=None")
        if min_bucket_ratio != 1.0:
            raise ValueError(f"gradcomp: min_bucket_ratio={min_bucket_ratio!r} decides by bytes under policy='codec'; "
                             f"policy='time' decides by predicted time: leave min_bucket_ratio at 1.0")
    return policy


@dataclass
class Line:
    """fixed + per_unit x units (seconds): the codec's kernels, and the links that the planner is told."""

    fixed: float = 0.0
    per_unit: float = 0.0

    def __call__(self, units: float) -> float:
        return self.fixed + self.per_unit * units

    @classmethod
    def fit(cls, points) -> "Line":
        """The line through (units, seconds) points by least relative squares (small sizes count as much as large
        ones), with neither term below 0."""
        points = [(float(x), float(t)) for x, t in points if x > 0 and t > 0]
        if not points:
            return cls()
        if len({x for x, _ in points}) < 2:
            return cls(0.0, min(t / x for x, t in points))
        w = [1.0 / (t * t) for _, t in points]
        sw = sum(w)
        sx, st = sum(wi * x for wi, (x, _) in zip(w, points)), sum(wi * t for wi, (_, t) in zip(w, points))
        sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
        sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
        slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
        fixed = (st - slope * sx) / sw
        if slope < 0:
            return cls(st / sw, 0.0)
        if fixed < 0:
            return cls(0.0, sxt / sxx)
        return cls(fixed, slope)

    def params(self) -> list[float]:
        """What combine() takes the largest of over the ranks."""
        return [self.fixed, self.per_unit]

    def with_params(self, values) -> "Line":
        return Line(*values)

    def to_json(self):
        return [self.fixed, self.per_unit]


@dataclass(frozen=True)
class Curve:
    """Seconds of a collective of `units` bytes per rank, measured at a few sizes: straight between them, the
    smallest's time below the smallest, the last segment's slope beyond the largest. A link's cost is no one line: a
    token bucket's burst, TCP's window and NCCL's protocols bend it, and one line fitted across 1 KiB to 8 MiB missed
    the sizes between by 2-4x behind a 100 Mbit/s link (benchmarks/README.md)."""

    sizes: tuple[float, ...]
    seconds: tuple[float, ...]

    def __call__(self, units: float) -> float:
        xs, ts = self.sizes, self.seconds
        if not xs:
            return 0.0
        if units <= xs[0]:
            return ts[0]
        i = bisect.bisect_left(xs, units)
        if i == len(xs):
            slope = (ts[-1] - ts[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            return ts[-1] + (slope if slope > 0 else ts[-1] / xs[-1]) * (units - xs[-1])
        return ts[i - 1] + (ts[i] - ts[i - 1]) * (units - xs[i - 1]) / (xs[i] - xs[i - 1])

    @classmethod
    def through(cls, points, at) -> "Curve":
        """The curve at the sizes `at` (the same on every rank, so that the ranks' curves combine size by size),
        from (units, seconds) points: the median of the points at each size, straight between sizes, and no size
        slower than a larger one (noise only adds time, so of two such points the smaller size's is lowered)."""
        by_size: dict[float, list[float]] = {}
        for x, t in points:
            if x > 0 and t > 0:
                by_size.setdefault(float(x), []).append(float(t))
        xs = sorted(by_size)
        ts = [statistics.median(by_size[x]) for x in xs]
        for i in range(len(ts) - 2, -1, -1):
            ts[i] = min(ts[i], ts[i + 1])
        measured = cls(tuple(xs), tuple(ts))
        sizes = sorted({float(x) for x in at})
        return cls(tuple(sizes), tuple(measured(x) for x in sizes))

    def params(self) -> list[float]:
        return list(self.seconds)

    def with_params(self, values) -> "Curve":
        return Curve(self.sizes, tuple(values))

    def to_json(self):
        return {"sizes": list(self.sizes), "seconds": list(self.seconds)}


def link_from_json(saved) -> "Line | Curve":
    """A link as to_json wrote it: a Curve (measured), or a Line (stated: the planner; or saved before curves)."""
    return Curve(tuple(saved["sizes"]), tuple(saved["seconds"])) if isinstance(saved, dict) else Line(*saved)


@dataclass(frozen=True)
class Cost:
    """An option's seconds for one bucket: encode (on the hook's thread, before its collectives), wire (its first
    collective), decode (after its last); for a plan of two rounds also middle (between them: PowerSGD's Q, the
    two-phase owner's re-encode) and second (the collectives the sequencer issues once every bucket is launched)."""

    encode: float
    wire: float
    decode: float
    middle: float = 0.0
    second: float = 0.0

    @property
    def total(self) -> float:
        return self.encode + self.wire + self.middle + self.second + self.decode

    def parts(self) -> list[float]:
        """The fields in the constructor's order (Cost(*c.parts()) == c)."""
        return [self.encode, self.wire, self.decode, self.middle, self.second]


class CostModel:
    """Collectives per (level, kind) and the codec's kernels, as Lines; and what each option costs a bucket."""

    def __init__(self, links: dict[str, Line | Curve], kernels: dict[str, Line]):
        self.links, self.kernels = links, kernels  # links: "level/kind" -> seconds for bytes per rank

    def link(self, level: str, kind: str, nbytes: float) -> float:
        return self.links[f"{level}/{kind}"](nbytes) if nbytes > 0 else 0.0

    def kernel(self, name: str, elements: float, calls: int = 1) -> float:
        line = self.kernels.get(name, Line())
        return calls * line.fixed + line.per_unit * elements

    def to_dict(self) -> dict:
        return {"links": {k: v.to_json() for k, v in self.links.items()},
                "kernels": {k: v.to_json() for k, v in self.kernels.items()}}

    @classmethod
    def from_dict(cls, saved: dict) -> "CostModel":
        return cls({k: link_from_json(v) for k, v in saved["links"].items()},
                   {k: Line(*v) for k, v in saved["kernels"].items()})

    def flat(self, scheme: str, codec, shapes, numel: int, dtype: torch.dtype, ranks: int, level: str) -> Cost:
        """A bucket under a flat scheme among `ranks` ranks at `level`."""
        if ranks == 1:
            return Cost(0.0, 0.0, 0.0)
        if scheme == "plain":
            return Cost(0.0, self.link(level, "allreduce", numel * dtype.itemsize), 0.0)
        if scheme == "powersgd":
            p, q = PowerSGDBucket.summed_numels(codec, shapes)
            return Cost(0.0, self.link(level, "allreduce", 4 * p), self.kernel("powersgd", numel * codec.rank),
                        second=self.link(level, "allreduce", 4 * q))
        encode, decode = self.kernel("encode", numel), self.kernel("decode", numel)
        if scheme == "allreduce":
            return Cost(encode, self.link(level, "allreduce", AllreduceBucket.summed_bytes(codec, numel, dtype)), decode)
        if scheme == "allgather":
            wire = self.link(level, "all-gather", codec.payload_nbytes(numel, dtype))
            return Cost(encode, wire, self.kernel("decode", ranks * numel))
        if scheme == "two-phase":
            sizes = [codec.payload_nbytes(end - start, dtype) for start, end in chunk_bounds(numel, ranks)]
            owner = self.kernel("decode", numel) + self.kernel("encode", math.ceil(numel / ranks))
            return Cost(self.kernel("encode", numel, calls=ranks), self.link(level, "all-to-all", sum(sizes)),
                        self.kernel("decode", numel), middle=owner, second=self.link(level, "all-gather", max(sizes)))
        raise ValueError(f"gradcomp: no cost for scheme {scheme!r}")

    def hierarchical(self, codec, shapes, numel: int, dtype: torch.dtype, world: int, node_size: int) -> Cost:
        """The reduce-scatter inside the node (waited for on the hook's thread), the codec's exchange of a 1/L shard
        across nodes, the all-gather inside the node."""
        nodes, shard = world // node_size, math.ceil(numel / node_size)
        scatter = self.link("inside", "reduce-scatter", node_size * shard * dtype.itemsize)
        gather = self.link("inside", "all-gather", shard * dtype.itemsize)
        inner_scheme = inner_plan_class(codec, shard, dtype, nodes).scheme
        if inner_scheme == "powersgd":  # its shards are groups of whole parameters: about 1/L of the bucket each
            whole = self.flat(inner_scheme, codec, shapes, numel, dtype, nodes, "across")
            inner = Cost(*(part / node_size for part in (0.0, whole.wire, whole.decode, whole.middle, whole.second)))
        else:
            inner = self.flat(inner_scheme, codec, None, shard, dtype, nodes, "across")
        # the all-gather inside the node is a second-round collective, after the exchange across nodes
        return Cost(scatter + inner.encode, inner.wire, inner.decode, inner.middle, inner.second + gather)


def candidates(codec, scheme_option: str, two_levels: bool) -> list[str]:
    """The options of each bucket: plain, and the schemes the codec can take that the scheme option allows."""
    if isinstance(codec, PowerSGD):
        flat = ["powersgd"]
    elif codec.collective == "allreduce":
        flat = ["allreduce"]
    else:
        flat = ["allgather", "two-phase"]
    if scheme_option in ("allgather", "two-phase"):
        flat = [scheme_option]
    options = ["plain"]
    if scheme_option != "hierarchical" or not two_levels:
        options += flat
    if two_levels and scheme_option in ("auto", "hierarchical"):
        options.append("hierarchical")
    return options


def option_costs(model: CostModel, options, codec, shapes, dtype: torch.dtype, world: int, node_size,
                 measured: dict | None = None) -> dict:
    """Each option's Cost for a bucket of these shapes. measured: {option: (encode, middle, decode)} seconds of the
    plan's own launch (time_plan), which then stand for the kernels (the model's kernels are left out: zero)."""
    numel = sum(torch.Size(s).numel() for s in shapes)
    if measured:
        model = CostModel(model.links, {})

    def cost(o):
        c = (model.hierarchical(codec, shapes, numel, dtype, world, node_size) if o == "hierarchical"
             else model.flat(o, codec, shapes, numel, dtype, world, "world"))
        if measured and o in measured:
            encode, middle, decode = measured[o]
            c = Cost(c.encode + encode, c.wire, c.decode + decode, c.middle + middle, c.second)
        return c

    return {o: cost(o) for o in options}


def exposed(ready: list[float], costs: list[Cost]) -> float:
    """Seconds a step spends beyond backward without communication (the queue in the module's docstring); ready:
    each bucket's offset after the first, in launch order."""
    if not costs:
        return 0.0
    delay, free, first_done = 0.0, -math.inf, []
    for offset, cost in zip(ready, costs):
        start = max(offset + delay + cost.encode, free)
        delay += cost.encode
        free = start + cost.wire + cost.middle + (0.0 if cost.second else cost.decode)
        first_done.append(free)
    launched = ready[-1] + delay  # the hook's thread is through the last bucket: the sequencer's second round
    for done, cost in zip(first_done, costs):
        if cost.second:
            free = max(launched, done, free) + cost.second + cost.decode
    return max(free - ready[-1], 0.0)


def choose(ready: list[float], options: list[dict]) -> list[str]:
    """Per bucket the option name (see the module's docstring); options: per bucket {name: Cost}, "plain" in each,
    the same names for every bucket."""

    def predicted(names):
        return exposed(ready, [costs[n] for costs, n in zip(options, names)])

    def improved(choice):
        for _ in range(2):
            for i, costs in enumerate(options):
                current = predicted(choice)
                for name in costs:
                    trial = choice[:i] + [name] + choice[i + 1:]
                    if predicted(trial) < current * (1 - 1e-9):
                        choice, current = trial, predicted(trial)
                if choice[i] != "plain":  # plain unless the bucket's option itself shortens the step by MARGIN
                    plain = choice[:i] + ["plain"] + choice[i + 1:]
                    if predicted(plain) <= current + MARGIN * options[i]["plain"].total:
                        choice = plain
        return choice

    standalone = []
    for costs in options:
        best = min(costs, key=lambda o: costs[o].total)
        standalone.append(best if costs[best].total < (1 - MARGIN) * costs["plain"].total else "plain")
    # Single-bucket moves can stall where one link is the bottleneck for every bucket: start also from each option
    # for every bucket, and keep those as they are too, so the choice is never predicted slower than any of them
    # (unless plain, within MARGIN).
    uniform = [[name] * len(options) for name in options[0] if name != "plain"] if options else []
    candidates_ = [improved(standalone), *(improved(u) for u in uniform), *uniform]
    choice = min(candidates_, key=predicted)  # the first of equals: the per-bucket start, then the options' order
    plain = ["plain"] * len(options)
    return choice if predicted(choice) < (1 - MARGIN) * predicted(plain) else plain


# -- measuring ---------------------------------------------------------------------------------------------------


class Clock:
    """Host seconds on the CPU; CUDA events on a GPU, read at the decision and at the trial's verdicts (one sync
    each)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class WarmupTimings:
    """What the plain warm-up steps show: when each bucket's hook was called (backward's progress), and each plain
    allreduce from its launch to its completion; and each step's start, there and during the trial (gradcomp.trial).
    Kept in memory only: a decision is taken once, and saved."""

    def __init__(self):
        self.clock = None
        self.steps: dict[int, list] = {}  # step -> [(bucket index, mark)] in launch order
        self.allreduces: dict[int, list] = {}  # step -> [(bytes, launch mark, [completion mark])]
        self.starts: dict[int, Any] = {}  # step -> the mark of its first bucket's hook call

    def bucket_called(self, step: int, index: int, device: torch.device) -> None:
        if self.clock is None:
            self.clock = Clock(device)
        mark = self.clock.mark()
        self.steps.setdefault(step, []).append((index, mark))
        self.starts.setdefault(step, mark)

    def allreduce_launched(self, step: int, nbytes: int):
        """Returns what the allreduce's completion callback calls (on the stream that waits for it, on a GPU)."""
        if self.clock is None or step not in self.steps:
            return lambda: None
        entry = (nbytes, self.clock.mark(), [])
        self.allreduces.setdefault(step, []).append(entry)
        return lambda: entry[2].append(self.clock.mark())

    def step_started(self, step: int, device: torch.device) -> None:
        """A step's first bucket reached the hook: step_seconds() takes the times between consecutive steps."""
        if self.clock is None:
            self.clock = Clock(device)
        self.starts.setdefault(step, self.clock.mark())

    def step_seconds(self) -> dict[int, float]:
        """step -> seconds from its first hook call to the next step's (every step of it: forward, backward,
        communication, optimizer), for each step whose next one was marked too."""
        return {s: self.clock.seconds(mark, self.starts[s + 1]) for s, mark in self.starts.items()
                if s + 1 in self.starts}

    def ready_offsets(self, indices: list[int]) -> list[float] | None:
        """Per bucket (in the order given), the median over the warm-up steps of its hook call after the first's;
        None where no step called every one of them."""
        offsets = []
        for marks in self.steps.values():
            by_index = dict(marks)
            if set(indices) <= set(by_index):
                first = marks[0][1]
                offsets.append([self.clock.seconds(first, by_index[i]) for i in indices])
        if not offsets:
            return None
        return [statistics.median(column) for column in zip(*offsets)]

    def allreduce_points(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each warm-up allreduce that had the link to itself: launched after the one before had
        completed, and completed before the next was launched (gloo runs collectives on several threads at once, and
        NCCL's overlap as well; overlapping ones share the link, and their times say nothing of one alone)."""
        points = []
        for step, entries in self.allreduces.items():
            origin = self.steps[step][0][1]
            since = lambda mark: self.clock.seconds(origin, mark)  # noqa: E731
            spans = [(nbytes, since(launched), since(done[0])) for nbytes, launched, done in entries if done]
            for i, (nbytes, start, end) in enumerate(spans):
                alone = (i == 0 or spans[i - 1][2] <= start) and (i + 1 == len(spans) or end <= spans[i + 1][1])
                if alone and end > start:
                    points.append((nbytes, end - start))
        return points


class DryStep:
    """What a bucket plan's launch needs of the hook's Step, with local copies for collectives: a launch on it times
    the plan's kernels and everything the hook does around them, on this device, without the network. Each "rank"
    receives what this rank sends (as if every rank held its gradient). `marks` gets the clock's mark as each
    collective is issued (the reduce-scatter inside a node, waited for on the hook's thread, aside): the encode ends
    at the first, the middle of a two-round plan at the last."""

    def __init__(self, world: int, rank: int, nodes, clock: Clock, marks: list | None = None):
        self.world, self.rank, self.step, self.nodes, self.clock = world, rank, 0, nodes, clock
        self.decode_status, self.counts_nonfinite = None, False
        self.marks = [] if marks is None else marks

    def on(self, group, world: int, rank: int) -> "DryStep":
        return DryStep(world, rank, self.nodes, self.clock, self.marks)

    def add(self, key: str, value: float) -> None:
        pass

    def count_nonfinite(self, finite: torch.Tensor) -> None:
        pass

    new_future = staticmethod(Step.new_future)

    def _done(self, value, device) -> torch.futures.Future:
        future = self.new_future(device)
        future.set_result(value)
        return future

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        self.marks.append(self.clock.mark())
        return self._done([tensor], tensor.device)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.futures.Future:
        self.marks.append(self.clock.mark())  # before the local copy, which stands for the wire
        out.view(self.world, -1).copy_(tensor.reshape(1, -1).expand(self.world, -1))
        return self._done([out], out.device)

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_splits, in_splits) -> torch.futures.Future:
        self.marks.append(self.clock.mark())
        start = sum(in_splits[: self.rank])
        mine = tensor[start: start + in_splits[self.rank]]
        out.view(self.world, -1).copy_(mine.reshape(1, -1).expand(self.world, -1))
        return self._done([out], out.device)

    def reduce_scatter_now(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        out.copy_(tensor.view(self.world, -1)[self.rank])

    def chain_in_order(self, first, prepare, second, callback, result, device, round_: int = 1) -> None:
        try:
            done = first()
            prepare(done)
            callback(second())
        except BaseException as error:  # noqa: BLE001 - ends in result, as the hook's Step does
            if not result.done():
                result.set_exception(error)


def time_plan(plan, sample: torch.Tensor, world: int, rank: int, nodes, clock: Clock, repeats: int = 2) -> list:
    """Marks (start, first collective, last collective, end) of plan's launch on a copy of sample (tiled to the
    bucket's size), its collectives local (DryStep), `repeats` runs after an untimed one (read with plan_seconds)."""
    flat = sample.detach().reshape(-1)
    flat = flat.repeat(math.ceil(plan.numel / max(flat.numel(), 1)))[: plan.numel]
    runs = []
    for _ in range(repeats + 1):
        data = flat.clone()
        views = [part.view(shape) for part, shape in zip(data.split([s.numel() for s in plan.shapes]), plan.shapes)]
        step = DryStep(world, rank, nodes, clock)
        start = clock.mark()
        plan.launch(step, data, views).wait()
        end = clock.mark()
        runs.append((start, step.marks[0] if step.marks else end, step.marks[-1] if step.marks else end, end))
    return runs[1:]


def plan_seconds(runs: list, clock: Clock) -> tuple[float, float, float]:
    """(encode, middle, decode): the least time to the first collective, the least from there to the last, and the
    least of the rest (after clock.sync())."""
    encode = min(clock.seconds(start, first) for start, first, _, _ in runs)
    middle = min(clock.seconds(first, last) for _, first, last, _ in runs)
    total = min(clock.seconds(start, end) for start, _, _, end in runs)
    return encode, middle, max(total - encode - middle, 0.0)


def _probe(group, kind: str, nbytes: int, device: torch.device, clock: Clock) -> tuple:
    """Marks around PROBE_REPEATS runs of one collective of nbytes per rank (after one untimed)."""
    world = dist.get_world_size(group)
    nbytes = max(world * 4, nbytes - nbytes % (world * 4))
    data = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    if kind == "allreduce":
        run = lambda: dist.all_reduce(data, group=group, async_op=True)  # noqa: E731
    elif kind == "all-gather":
        out = torch.empty(world * data.numel(), dtype=data.dtype, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as the schemes call it
        run = lambda: gather(out, data, group=group, async_op=True)  # noqa: E731
    elif kind == "all-to-all":
        out = torch.empty_like(data)
        run = lambda: dist.all_to_all_single(out, data, group=group, async_op=True)  # noqa: E731
    else:
        out = torch.empty(data.numel() // world, dtype=data.dtype, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        run = lambda: scatter(out, data, group=group, async_op=True)  # noqa: E731
    run().wait()
    marks = []
    for _ in range(PROBE_REPEATS):
        start = clock.mark()
        run().wait()
        marks.append((start, clock.mark()))
    return nbytes, marks


def measure_links(needed: dict[str, list[str]], groups: dict, bucket_bytes: list[int], device: torch.device,
                  clock: Clock, warmup_points: list) -> dict[str, Curve]:
    """Curves for each level's needed kinds: probes at PROBE_BYTES up to the largest bucket (every rank in the same
    order), and for the whole group's allreduce the warm-up's own allreduces of the buckets, at their sizes too."""
    largest = max(bucket_bytes, default=0)
    sizes = sorted({min(b, max(largest, PROBE_BYTES[0])) for b in PROBE_BYTES})
    marks = {}
    for level, kinds in needed.items():
        for kind in kinds:
            marks[f"{level}/{kind}"] = [_probe(groups[level], kind, size, device, clock) for size in sizes]
    clock.sync()
    curves = {}
    for key, probes in marks.items():
        points = [(nbytes, min(clock.seconds(a, b) for a, b in runs)) for nbytes, runs in probes]
        at = [nbytes for nbytes, _ in points]
        if key == "world/allreduce":
            points += warmup_points
            at += bucket_bytes
        curves[key] = Curve.through(points, at)
    return curves


def measure_kernels(codec, sample: torch.Tensor, largest: int, clock: Clock) -> dict[str, Line]:
    """The codec's kernels timed at two sizes (the largest bucket and 1/64 of it), on the gradient in hand tiled to
    those sizes: encode and decode for the wire-format codecs, the round trip for powersgd."""
    sizes = sorted({max(1, largest // 64), max(largest, 1)})
    flat = sample.detach().reshape(-1)
    if flat.numel() == 0:
        flat = torch.ones(1, dtype=sample.dtype, device=sample.device)
    marks: dict[str, list] = {}
    for size in sizes:
        data = flat.repeat(math.ceil(size / flat.numel()))[:size].clone()
        for name, run in _kernel_runs(codec, data).items():
            run()
            start = clock.mark()
            run()
            marks.setdefault(name, []).append((size, start, clock.mark()))
    clock.sync()
    units = codec.rank if isinstance(codec, PowerSGD) else 1
    return {name: Line.fit([(size * units, clock.seconds(a, b)) for size, a, b in runs]) for name, runs in marks.items()}


def _kernel_runs(codec, data: torch.Tensor) -> dict:
    if isinstance(codec, PowerSGD):
        rows = max(1, int(math.sqrt(data.numel())))
        matrix = data[: rows * (data.numel() // rows)].view(rows, -1)
        q = torch.randn(matrix.shape[1], codec.rank, device=data.device)
        return {"powersgd": lambda: codec.roundtrip(matrix, None, q)}
    residual = torch.zeros_like(data) if codec.error_feedback else None
    payload = codec.encode(data, None if residual is None else residual.clone())
    out = torch.empty_like(data)
    return {"encode": lambda: codec.encode(data, None if residual is None else residual.clone()),
            "decode": lambda: codec.decode_sum(payload.view(1, -1), out, 1.0)}


def needed_links(options, codec) -> dict[str, list[str]]:
    """The (level, collective kinds) the options' costs read, in one order on every rank."""
    kinds = {"plain": {"allreduce"}, "allreduce": {"allreduce"}, "powersgd": {"allreduce"},
             "allgather": {"all-gather"}, "two-phase": {"all-to-all", "all-gather"}}
    needed = {"world": [k for k in KINDS if any(k in kinds.get(o, ()) for o in options)]}
    if "hierarchical" in options:
        needed["inside"] = ["all-gather", "reduce-scatter"]
        summable = isinstance(codec, PowerSGD) or codec.collective == "allreduce"
        needed["across"] = ["allreduce"] if summable else ["all-gather", "all-to-all"]
    return needed


def combine(model: CostModel, ready: list[float] | None, buckets: int, group, device: torch.device,
            measured: list[dict] | None = None):
    """Every rank's measurements, the largest of each (the slowest rank sets the pace): one allreduce, after which
    every rank holds the same numbers. Returns (model, ready, measured), ready None where any rank lacks it."""
    links, kernels = sorted(model.links), sorted(model.kernels)
    measured_lines = [model.links[key] for key in links] + [model.kernels[key] for key in kernels]
    values = [x for line in measured_lines for x in line.params()]
    timed = [(i, o) for i, per_option in enumerate(measured or []) for o in sorted(per_option)]
    values += [x for i, o in timed for x in measured[i][o]]
    values += [1.0 if ready is None else 0.0, *(ready if ready is not None else [0.0] * buckets)]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    values = tensor.cpu().tolist()
    lines, at = [], 0
    for line in measured_lines:  # the same structure on every rank: the same kinds, and curves at the same sizes
        width = len(line.params())
        lines.append(line.with_params(values[at:at + width]))
        at += width
    combined = CostModel(dict(zip(links, lines[:len(links)])), dict(zip(kernels, lines[len(links):])))
    if measured is not None:
        width = len(measured[timed[0][0]][timed[0][1]]) if timed else 0
        measured = [dict() for _ in measured]
        for k, (i, o) in enumerate(timed):
            measured[i][o] = tuple(values[at + width * k: at + width * (k + 1)])
        at += width * len(timed)
    missing, offsets = values[at], values[at + 1:]
    return combined, (None if missing else offsets), measured


# -- the decision, and how it reads -------------------------------------------------------------------------------


def decide(model: CostModel, ready: list[float] | None, buckets: list[dict], codec, scheme_option: str, world: int,
           node_size: int | None, step: int, measured: list[dict] | None = None) -> dict:
    """The decision for buckets ({"index", "shapes", "dtype"} in launch order): JSON-able, kept in the state.
    measured: per bucket, {option: (encode, middle, decode) seconds} of its plans' own launches, else the model's
    kernels."""
    options = candidates(codec, scheme_option, node_size is not None)
    overlap = ready is not None
    ready = ready if overlap else [0.0] * len(buckets)
    measured = measured or [None] * len(buckets)
    costs = [option_costs(model, options, codec, b["shapes"], b["dtype"], world, node_size, m)
             for b, m in zip(buckets, measured)]
    choice = choose(ready, costs)
    fixed = {o: exposed(ready, [c[o] for c in costs]) for o in options}
    return {
        "step": step, "world_size": world, "node_size": node_size, "overlap_measured": overlap,
        "model": model.to_dict(), "options": options,
        "buckets": [{"index": b["index"], "elements": sum(torch.Size(s).numel() for s in b["shapes"]),
                     "bytes": sum(torch.Size(s).numel() for s in b["shapes"]) * b["dtype"].itemsize,
                     "ready_s": r, "choice": name,
                     "predicted_s": {o: c.parts() for o, c in cost.items()}}
                    for b, r, cost, name in zip(buckets, ready, costs, choice)],
        "predicted_exposed_s": {"policy": exposed(ready, [c[n] for c, n in zip(costs, choice)]), **fixed},
    }


def explain(decision: dict | None, spec: str) -> str:
    """The decision as a table: per bucket its size, each option's predicted seconds, the choice; then each fixed
    option's and the policy's predicted exposed communication per step."""
    if decision is None:
        return f"gradcomp {spec}, policy='time': no decision yet (taken at the first step after the warm-up)"
    options = decision["options"]
    lines = [f"gradcomp {spec}, policy='time': decided at step {decision['step']} on {decision['world_size']} ranks"
             + (f" ({decision['node_size']} per node)" if decision["node_size"] else "")
             + ("" if decision["overlap_measured"] else "; overlap with backward not measured (assumed none)"),
             f"{'bucket':>6} {'MB':>8} " + " ".join(f"{o + ' ms':>16}" for o in options) + "  choice"]
    for bucket in decision["buckets"]:
        times = " ".join(f"{sum(bucket['predicted_s'][o]) * 1e3:16.2f}" for o in options)
        lines.append(f"{bucket['index']:>6} {bucket['bytes'] / 1e6:8.2f} {times}  {bucket['choice']}")
    predicted = decision["predicted_exposed_s"]
    lines.append("predicted communication per step beyond backward (ms): "
                 + ", ".join(f"{o} {predicted[o] * 1e3:.2f}" for o in options)
                 + f", the model's choice {predicted['policy'] * 1e3:.2f}")
    return "\n".join(lines + policy_trial.describe(decision.get("trial")))
