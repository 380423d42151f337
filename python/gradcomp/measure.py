"""What policy="time" measures on the job (gradcomp.policy reads it): the plain warm-up steps' timings (backward's
progress, the plain allreduces, each step's start, the hook's own time per call), probes of each collective kind
(measure_links), the codec's kernels (measure_kernels, for the planner) and each option's plan launched with local
collectives (DryStep, time_plan); and the one allreduce that gives every rank the slowest rank's figures (combine)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ._tensors import views_of
from .policy import KINDS, CostModel, Curve, Line, saved_hook_seconds
from .powersgd import PowerSGD
from .step import Step

PROBE_BYTES = tuple(1 << b for b in range(10, 24, 2)) + (1 << 23,)  # up to the largest bucket, at most 8 MiB
# after one untimed run; the least is kept: the others met noise, or (gloo) a peer's late start (_probe)
PROBE_REPEATS = 4


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
    """What the plain warm-up steps show: when each bucket's hook was called and when it returned (backward's own
    progress is the calls less the time inside the ones before), when each plain allreduce completed, and how long
    each call took beyond launching it; and each step's start, there and during the trial (gradcomp.trial). Kept in
    memory only: a decision is taken once, and saved."""

    def __init__(self):
        self.clock = None
        self.steps: dict[int, list] = {}  # step -> [(bucket index, mark)] in launch order
        self.returns: dict[int, dict] = {}  # step -> {bucket index: the mark of its hook call's return}
        self.allreduces: dict[int, list] = {}  # step -> per launched allreduce, [its completion's mark] once done
        self.starts: dict[int, Any] = {}  # step -> the mark of its first bucket's hook call
        self.hook_calls: list[float] = []  # host seconds of each plain hook call beyond its allreduce's launch
        self.collectives: dict[int, list] = {}  # trial step -> [[option, kind, bytes, launch mark, completion mark]]
        self.launches: dict[str, list] = {}  # trial: option -> [(bucket index, host seconds of its plan's launch)]

    def hook_called(self, seconds: float) -> None:
        """A plain warm-up call of the hook took `seconds` on backward's thread beyond launching its allreduce: the
        hook's own work (its step, stats and checks), which a compressed call does too, beyond its plan's launch."""
        self.hook_calls.append(seconds)

    def hook_seconds(self) -> float:
        """The median of the hook's own seconds per call over the warm-up (0 where none was timed: on a GPU the host
        runs ahead of the device, and its work costs the step nothing)."""
        return statistics.median(self.hook_calls) if self.hook_calls else 0.0

    def bucket_called(self, step: int, index: int, device: torch.device) -> None:
        if self.clock is None:
            self.clock = Clock(device)
        mark = self.clock.mark()
        self.steps.setdefault(step, []).append((index, mark))
        self.starts.setdefault(step, mark)

    def bucket_returned(self, step: int, index: int) -> None:
        """The hook's call for a bucket marked by bucket_called returns: backward was held up in between (on a GPU,
        its stream: the marks are events on it)."""
        if self.clock is not None and step in self.steps:
            self.returns.setdefault(step, {})[index] = self.clock.mark()

    def _held(self, step: int) -> list[float] | None:
        """Per hook call of `step`, in call order, the seconds from the call to its return; None unless every call
        of the step returned."""
        calls, returns = self.steps.get(step) or [], self.returns.get(step, {})
        if not calls or any(index not in returns for index, _ in calls):
            return None
        return [self.clock.seconds(mark, returns[index]) for index, mark in calls]

    def _window(self, step: int, end) -> float | None:
        """From where backward would have called the step's last bucket's hook, had no call held it up (the last
        call less the time inside the calls before it), to the mark `end`: what the step spent beyond backward
        without communication. None where a call did not return."""
        held = self._held(step)
        if held is None:
            return None
        return max(0.0, self.clock.seconds(self.steps[step][-1][1], end)) + sum(held[:-1])

    def allreduce_launched(self, step: int):
        """Returns what the allreduce's completion callback calls (on the stream that waits for it, on a GPU)."""
        if self.clock is None or step not in self.steps:
            return lambda: None
        done: list = []
        self.allreduces.setdefault(step, []).append(done)
        return lambda: done.append(self.clock.mark())

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

    def ready_offsets(self, indices: list[int]) -> tuple[list[float], list[float]] | None:
        """Per bucket (in the order given), the medians over the warm-up steps that called and returned every one
        of them of (its hook call after the first's, less the time inside the calls between: backward's own pace;
        its own call's time to return: plain's work on backward's thread, its division and launch); None where no
        step did."""
        offsets, held_per_step = [], []
        for step, marks in self.steps.items():
            held, by_index = self._held(step), dict(marks)
            if held is None or not set(indices) <= set(by_index):
                continue
            held_by_index = {index: seconds for (index, _), seconds in zip(marks, held)}
            before, total = {}, 0.0
            for (index, _), seconds in zip(marks, held):
                before[index], total = total, total + seconds
            offsets.append([self.clock.seconds(marks[0][1], by_index[i]) - before[i] for i in indices])
            held_per_step.append([held_by_index[i] for i in indices])
        if not offsets:
            return None
        return [statistics.median(column) for column in zip(*offsets)], \
            [statistics.median(column) for column in zip(*held_per_step)]

    def collective_launched(self, option: str, step: int, kind: str, nbytes: int, device: torch.device):
        """A collective of a bucket sent as `option` in the trial's step `step` (of nbytes per rank, as the cost
        model counts them) is being issued; returns what its completion calls (on the stream that waits for it, on
        a GPU)."""
        if self.clock is None:
            self.clock = Clock(device)
        entry = [option, kind, nbytes, self.clock.mark(), None]
        self.collectives.setdefault(step, []).append(entry)
        return lambda: entry.__setitem__(4, self.clock.mark())

    def busy_periods(self, step: int) -> list[tuple[list[tuple], float]]:
        """The trial's timed collectives of step `step` in the link's busy periods: in launch order, a period goes on
        while the next collective is launched before the last completion in it so far (gloo runs two at once, which
        then share the link). Each period: its collectives (option, kind, bytes, seconds in flight after backward:
        from the step's last hook call, backward's end on this rank, to its completion where launched before it,
        else inf) and the seconds it held the link after backward, from that call or its first launch where later,
        to its last completion. Before that call, a collective in flight shares the cores with backward, or waits
        for ranks still in it. Periods that ended before that call are left out (hidden behind backward), as is every
        period of a step where any collective did not complete."""
        entries, calls = self.collectives.get(step, []), self.steps.get(step)
        if not entries or not calls or any(entry[4] is None for entry in entries):
            return []
        origin = entries[0][3]
        at = lambda mark: self.clock.seconds(origin, mark)  # noqa: E731 - CUDA events order by elapsed time
        timed = sorted(((at(launched), at(completed), (option, kind, nbytes))
                        for option, kind, nbytes, launched, completed in entries), key=lambda entry: entry[0])
        backward_done, periods, members, start, end = at(calls[-1][1]), [], [], 0.0, -math.inf
        for launched, completed, collective in timed + [(math.inf, math.inf, None)]:  # the last closes the last
            if launched >= end:
                if members and end > max(start, backward_done):
                    periods.append((members, end - max(start, backward_done)))
                members, start = [], launched
            after_backward = completed - backward_done if launched < backward_done else math.inf
            members.append((*collective, max(after_backward, 0.0)) if collective else None)
            end = max(end, completed)
        return periods

    def collective_loads(self, curves: dict) -> dict[str, dict[str, float]]:
        """Per option and collective kind, how much slower than alone its collectives ran in the trial's steps: each
        busy period's seconds after backward (busy_periods) over the sum of its collectives' probes' times at their
        sizes (curves: kind -> Curve), and per option and kind the median over its collectives in those periods. A
        collective launched during backward counts at most for its seconds in flight after it: it did the rest
        before. Counted whole, ResNet-18's 931 KB all-gather at 4 ranks behind 100 Mbit/s, launched 90 ms before
        backward's end, read the link at 0.6 of its probes, and signsgd's allgather was predicted at 0.42 of what it
        measured. A period with a kind that has no curve is left out. Timing each collective alone from the
        completion before its own (as gradcomp did before) left out the time it shared the link with one issued
        during backward: at 4 ranks behind 100 Mbit/s, two all-gathers read 0.33x their probes, and the step was
        predicted at 0.41 of what it measured. The seconds hold this rank's waits for others still encoding: a rank's
        window holds them too (the least over the ranks is taken of the medians, not of each collective)."""
        ratios: dict[tuple[str, str], list[float]] = {}
        for step in self.collectives:
            for members, seconds in self.busy_periods(step):
                if not all(kind in curves for _, kind, _, _ in members):
                    continue
                alone = sum(min(curves[kind](nbytes), after_backward) for _, kind, nbytes, after_backward in members)
                if alone > 0:
                    for option, kind, _, _ in members:
                        ratios.setdefault((option, kind), []).append(seconds / alone)
        loads: dict[str, dict[str, float]] = {}
        for (option, kind), values in sorted(ratios.items()):
            loads.setdefault(option, {})[kind] = statistics.median(values)
        return loads

    def plan_launched(self, option: str, index: int, seconds: float) -> None:
        """A bucket's plan of `option` took `seconds` to launch (its encode, to its first collective) in a step of
        the trial (host seconds, on the CPU only)."""
        self.launches.setdefault(option, []).append((index, seconds))

    def launch_loads(self, decision: dict) -> dict[str, dict[int, float]]:
        """Per option and bucket index, the median over that bucket's launches in the trial of each one's seconds over
        the decision's encode for it less the hook's own time (the plan's dry run): how much slower its encode ran in
        the step than alone (the caches cold, the cores shared). Per bucket, not one factor per option: ResNet-18's
        26.5 MB topk bucket launched at 0.55-0.65 of its dry run while its two small ones launched at 1.10-1.76, and
        their median (1.26-1.37) put topk's allgather at 1.35-1.65x what it measured."""
        hook = saved_hook_seconds(decision)
        encodes = {option: {b["index"]: b["predicted_s"][option][0] - hook for b in decision["buckets"]
                            if option in b["predicted_s"]} for option in self.launches}
        loads: dict[str, dict[int, float]] = {}
        for option, launches in self.launches.items():
            ratios: dict[int, list[float]] = {}
            for index, seconds in launches:
                if encodes[option].get(index, 0.0) > 0:
                    ratios.setdefault(index, []).append(seconds / encodes[option][index])
            if ratios:
                loads[option] = {index: statistics.median(values) for index, values in sorted(ratios.items())}
        return loads

    def trial_loads(self, curves: dict, decision: dict) -> dict[str, dict]:
        """Per option, its collectives' loads by kind (collective_loads) and, under "encode", its encodes' loads per
        bucket in the decision's order (launch_loads; None for a bucket it did not launch): what policy.in_step
        takes, on this rank."""
        loads = self.collective_loads(curves)
        positions = {bucket["index"]: at for at, bucket in enumerate(decision["buckets"])}
        for option, per_bucket in self.launch_loads(decision).items():
            encode = [None] * len(positions)
            for index, factor in per_bucket.items():
                encode[positions[index]] = factor
            loads.setdefault(option, {})["encode"] = encode
        return loads

    def trial_windows(self, steps) -> dict[int, float]:
        """Per step given (the trial's steps of the candidate that sends every bucket plain) whose calls all returned
        and collectives all completed, to its last collective's completion: the plain window, as plain_windows reads
        the warm-up's."""
        windows = {}
        for step in steps:
            calls, entries = self.steps.get(step), self.collectives.get(step)
            if not calls or not entries or any(entry[4] is None for entry in entries):
                continue
            window = self._window(step, self._latest([entry[4] for entry in entries]))
            if window is not None:
                windows[step] = window
        return windows

    def _last_completion(self, step: int):
        """The mark of step's last allreduce completion; None unless every allreduce it launched completed."""
        completions = self.allreduces.get(step)
        if not completions or not all(completions):
            return None
        return self._latest([done[0] for done in completions])

    def _latest(self, marks: list):
        """The latest of the clock's marks (CUDA events order by elapsed time, not by value)."""
        return max(marks, key=lambda mark: self.clock.seconds(marks[0], mark))

    def plain_windows(self) -> dict[int, float]:
        """Per warm-up step whose calls all returned and allreduces all completed (step -> seconds), to its last
        allreduce's completion (_window): the plain step's communication beyond backward, as the model predicts it
        (plain's calls are its encodes there: ready_offsets)."""
        windows = {}
        for step in self.allreduces:
            last = self._last_completion(step)
            window = None if last is None else self._window(step, last)
            if window is not None:
                windows[step] = window
        return windows

    def computes(self) -> dict[int, float]:
        """Per warm-up step after one whose allreduces all completed (step -> seconds), from that step's last
        allreduce's completion to this step's last bucket's hook call: this rank's optimizer step, forward and
        backward. Every rank leaves a step at about the same time (its last allreduce ends once every rank's part
        is in), so the ranks' spread of this is how long the first through backward waits for the last one."""
        computes = {}
        for step, marks in self.steps.items():
            left = self._last_completion(step - 1)
            if left is not None:
                computes[step] = self.clock.seconds(left, marks[-1][1])
        return computes


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
        views = views_of(data, plan.shapes)
        step = DryStep(world, rank, nodes, clock)
        start = clock.mark()
        plan.launch(step, data, views).wait()
        end = clock.mark()
        runs.append((start, step.marks[0] if step.marks else end, step.marks[-1] if step.marks else end, end))
    return runs[1:]


def plan_seconds(runs: list, clock: Clock) -> tuple[float, float, float]:
    """(encode, middle, decode): the least over the runs of each part, to the first collective, from there to the
    last, and after it (after clock.sync()). Not the least whole run less the other parts' least: that put into the
    decode what preemption added to that run's middle (a two-phase decode at twice its measure)."""
    encode = min(clock.seconds(start, first) for start, first, _, _ in runs)
    middle = min(clock.seconds(first, last) for _, first, last, _ in runs)
    decode = min(clock.seconds(last, end) for _, _, last, end in runs)
    return encode, middle, decode


def collective_launcher(group, kind: str, nbytes: int, device: torch.device) -> tuple:
    """(bytes, launch): one collective of `kind` (KINDS) of about nbytes per rank, as the schemes call it, rounded to
    whole float32 elements that every rank's share divides; launch() starts it and returns its work."""
    world = dist.get_world_size(group)
    nbytes = max(world * 4, nbytes - nbytes % (world * 4))
    data = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    if kind == "allreduce":
        return nbytes, lambda: dist.all_reduce(data, group=group, async_op=True)
    if kind == "all-gather":
        out = torch.empty(world * data.numel(), dtype=data.dtype, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return nbytes, lambda: gather(out, data, group=group, async_op=True)
    if kind == "all-to-all":
        out = torch.empty_like(data)
        return nbytes, lambda: dist.all_to_all_single(out, data, group=group, async_op=True)
    out = torch.empty(data.numel() // world, dtype=data.dtype, device=device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return nbytes, lambda: scatter(out, data, group=group, async_op=True)


def _probe(group, kind: str, nbytes: int, device: torch.device, clock: Clock) -> tuple:
    """Marks around PROBE_REPEATS runs of one collective of nbytes per rank (after one untimed), each run started
    together by a one-element allreduce. Why together: gloo sends only to a posted receive, and a rank that starts
    after its peer's receive notice has come writes its data before its own notice, so the peer's data waits behind
    it; run after run, the rank that finished last starts last again, and a lone all-gather of 4 MB behind 100 Mbit/s
    read 1.5x, an all-to-all 2x, the link's time. Lined up, a third to a half of the runs escape it
    (benchmarks/probe_start.py). A step's collectives, two at a time on gloo's threads, keep the link busy through
    the wait, and the trial's steps read what is left as a load (gradcomp.policy.in_step)."""
    nbytes, run = collective_launcher(group, kind, nbytes, device)
    run().wait()
    together = torch.zeros(1, dtype=torch.float32, device=device)
    marks = []
    for _ in range(PROBE_REPEATS):
        dist.all_reduce(together, group=group, async_op=True).wait()
        start = clock.mark()
        run().wait()
        marks.append((start, clock.mark()))
    return nbytes, marks


def measure_links(needed: dict[str, list[str]], groups: dict, largest: int, device: torch.device,
                  clock: Clock) -> dict[str, Curve]:
    """Curves for each level's needed kinds: probes at PROBE_BYTES up to the largest bucket, every rank in the same
    order. The collectives alone: how much longer they take inside a step, the plain warm-up steps show (the load,
    gradcomp.policy.link_load)."""
    sizes = sorted({min(b, max(largest, PROBE_BYTES[0])) for b in PROBE_BYTES})
    marks = {}
    for level, kinds in needed.items():
        for kind in kinds:
            marks[f"{level}/{kind}"] = [_probe(groups[level], kind, size, device, clock) for size in sizes]
    clock.sync()
    curves = {}
    for key, probes in marks.items():
        points = [(nbytes, min(clock.seconds(a, b) for a, b in runs)) for nbytes, runs in probes]
        curves[key] = Curve.through(points)
    return curves


def measure_kernels(codec, sample: torch.Tensor, largest: int, clock: Clock) -> dict[str, Line]:
    """The codec's kernels timed at two sizes (the largest bucket and 1/64 of it), on the gradient in hand tiled to
    those sizes: encode and decode for the wire-format codecs, the round trip for powersgd; and plain DDP's division
    of a bucket by the world size."""
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
    out = torch.empty_like(data)
    divide = lambda: torch.div(data, 2, out=out)  # noqa: E731 - plain's pass: the bucket over the world size
    if isinstance(codec, PowerSGD):
        rows = max(1, int(math.sqrt(data.numel())))
        matrix = data[: rows * (data.numel() // rows)].view(rows, -1)
        q = torch.randn(matrix.shape[1], codec.rank, device=data.device)
        return {"powersgd": lambda: codec.roundtrip(matrix, None, q), "divide": divide}
    residual = torch.zeros_like(data) if codec.error_feedback else None
    payload = codec.encode(data, None if residual is None else residual.clone())
    return {"encode": lambda: codec.encode(data, None if residual is None else residual.clone()),
            "decode": lambda: codec.decode_sum(payload.view(1, -1), out, 1.0), "divide": divide}


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


def flat_loads(loads: dict[str, dict]) -> dict[tuple, float]:
    """trial_loads' figures by one name each, for taking the least over the ranks: (option, kind), and (option,
    "encode", position) per bucket launched."""
    flat = {}
    for option, kinds in loads.items():
        for kind, load in kinds.items():
            if kind == "encode":
                flat.update({(option, kind, at): factor for at, factor in enumerate(load) if factor is not None})
            else:
                flat[(option, kind)] = load
    return flat


def nested_loads(flat: dict[tuple, float], buckets: int) -> dict[str, dict]:
    """flat_loads' figures back in trial_loads' shape, each option's encodes over `buckets` buckets."""
    loads: dict[str, dict] = {}
    for name, load in flat.items():
        option, kind = name[:2]
        if kind == "encode":
            loads.setdefault(option, {}).setdefault(kind, [None] * buckets)[name[2]] = load
        else:
            loads.setdefault(option, {})[kind] = load
    return loads


def least_over_ranks(figures: dict, names: list, group, device: torch.device) -> dict:
    """Per name (of those given, in one order on every rank), the least of the ranks' figures (one allreduce, alike on
    every rank); a name that any rank lacks is left out."""
    values = [x for name in names for x in ((-figures[name], 0.0) if name in figures else (0.0, 1.0))]  # MAX of -x
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if names and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    values = tensor.cpu().tolist()
    return {name: -values[2 * i] for i, name in enumerate(names) if not values[2 * i + 1]}


def last_ranks_window(windows: dict[int, float], steps: list[int], group, device: torch.device) -> float | None:
    """The median over `steps` (the same on every rank) of the least of the ranks' windows there (one allreduce), the
    last rank's through backward (see combine); None where no step has a window on every rank."""
    least = least_over_ranks(windows, steps, group, device)
    return statistics.median(least.values()) if least else None


def combine(model: CostModel, ready: list[float] | None, buckets: int, group, device: torch.device,
            measured: list[dict] | None = None, windows: list[tuple] | None = None):
    """Every rank's measurements, the largest of each (the slowest rank sets the pace): one allreduce, after which
    every rank holds the same numbers. windows: per warm-up step (the same steps on every rank), this rank's
    (plain window, compute before it: WarmupTimings.computes), either None where not measured. Returns (model,
    ready, measured, window, skew): ready None where any rank lacks it; window the median over the steps with a
    window on every rank of the least of the ranks' windows (None where none had one): the last rank's through
    backward, as every rank leaves the step together (its last allreduce ends once every rank's part is in), so the
    communication beyond the slowest rank's backward; skew, over the steps whose window and compute were measured on
    every rank, the median of the ranks' spread of the compute, no more than that of the windows (how long a rank
    through backward early waits for the last: the rest of the windows' spread is the collectives' own, uneven
    between the ranks), None where none was measured."""
    links, kernels = sorted(model.links), sorted(model.kernels)
    measured_lines = [model.links[key] for key in links] + [model.kernels[key] for key in kernels]
    values = [x for line in measured_lines for x in line.params()]
    timed = [(i, o) for i, per_option in enumerate(measured or []) for o in sorted(per_option)]
    values += [x for i, o in timed for x in measured[i][o]]
    windows = windows or []
    for figure in (w for pair in windows for w in pair):  # -figure: MAX gives -min
        values += (1.0, 0.0, 0.0) if figure is None else (0.0, figure, -figure)
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
    spans = []  # per step and figure, (the largest, the least) over the ranks
    for _ in range(2 * len(windows)):
        missing, largest, negated_least = values[at:at + 3]
        spans.append(None if missing else (largest, -negated_least))
        at += 3
    per_step = list(zip(spans[0::2], spans[1::2]))
    last_ranks = [window[1] for window, _ in per_step if window is not None]
    # The first timed step has no compute (the step before it, DDP's first, is not timed): no wait read there.
    waits = [min(compute[0] - compute[1], window[0] - window[1]) for window, compute in per_step
             if window is not None and compute is not None]
    window = statistics.median(last_ranks) if last_ranks else None
    skew = statistics.median(waits) if waits else None
    missing, offsets = values[at], values[at + 1:]
    return combined, (None if missing else offsets), measured, window, skew
