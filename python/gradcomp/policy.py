"""policy="time": per bucket, the fastest way to send it (plain allreduce, or the codec under each scheme it can
take), from a cost model measured on the job itself, never what the model predicts to be slower than plain DDP.

The model
    collectives: seconds per bytes, per kind (allreduce, all-gather, all-to-all, reduce-scatter) and level (the
        whole group; inside a node and across nodes where the ranks form several nodes of several), measured alone
        at the decision by probes of each kind at sizes 4x apart, straight between them (a Curve: a link is not one
        alpha + beta x bytes line); taken at the load below;
    compute: each option's plan launched on the gradient in hand (tiled to the bucket's size) with local collectives
        (gradcomp.measure's DryStep), timed per bucket shape on this device and dtype: the codec's kernels and all
        the plan does around them, split at the first collective into encode and decode (the planner, gradcomp.plan,
        uses per-element kernel costs instead, measured or stated, plain's division by the world size among them);
        and the hook's own work per call (its step, stats and checks: the "hook" kernel), which the warm-up's plain
        calls show beyond their allreduce's launch (host seconds on the CPU; none on a GPU, where the host runs ahead
        of the device), added to each compressed option's encode, as a dry run does not hold it. Plain's encode is
        its calls' own time in the warm-up (the hook, its division by the world size and its allreduce's launch, on
        backward's thread or stream);
    overlap with backward: DDP launches bucket i when backward has produced it, at offset r_i after the first (the
        warm-up steps' hook calls, less the time inside the calls before it: backward's own pace, which every
        option's encodes then delay). Collectives go one at a time in launch order (where the backend runs several at
        once they share the link, which ends the last of them no sooner); a bucket's encode runs on the
        hook's thread (the backward's stream on a GPU), as does the hierarchical scheme's reduce-scatter inside the
        node (waited for there; below, part of encode_i), so it delays the buckets after it. What a step costs beyond
        backward without communication (its exposed time) is a queue, in the order the hook issues collectives:
            first round, in launch order:  ready_i = r_i + the encodes before i;
                start_i = max(ready_i + encode_i, end_(i-1));  end_i = start_i + wire_i + middle_i (+ decode_i);
            second round (PowerSGD's Q, two-phase's and the node's all-gathers), which the sequencer issues in bucket
                order once the last bucket is launched (at r_last + every encode):
                start2_i = max(r_last + the encodes, end_i, end of the collective before);  end = start2_i +
                second_i + decode_i;
            exposed = the last end - r_last (so the delay the encodes add to backward counts).
        A bucket whose communication hides behind later buckets' backward gains nothing from compression, and the
        choice leaves it plain.
    load: the warm-up's plain steps, whose allreduces are of the real buckets, show what a step adds to the probes.
        Every rank leaves a step together (its last allreduce ends once every rank's part is in), so the least of
        the ranks' windows (from where a rank's backward would have called the last bucket's hook had no call held it
        up, to its last allreduce's completion) is the last rank's through backward: the plain queue beyond the
        slowest rank's backward. Collectives run slower there than their probes alone where the cores are shared
        with backward and the other ranks, or uneven between the ranks: every collective's time is taken at the
        factor, link_load, that makes the plain queue end where that window did (the kernels' dry-run times as
        measured).
    skew: how long a rank through backward early waits for the last one (the ranks' spread of the time from the step
        before's end to their last hook call, no more than the windows' spread), reported beside the predictions and
        not in them: every option's step waits it, and it is the ranks' compute, not communication.
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
Those steps also time what the probes and dry runs cannot: each compressed option's collectives and plans' launches
inside its own steps, and plain's window among the other candidates' steps; after the verdict the predictions are
taken again at those loads (in_step), which explain() shows beside the decision's.
Known limits (benchmarks/README.md, policy.py): compute on the collectives' callbacks is taken to hold the link, not
to slow backward or the encodes beside it (where a rank has one core to itself, it does; after the trial, whose
collective times hold it, an option's decodes run beside the link: in_step); the load is one factor for every
collective, measured on the plain allreduces only.
On a GPU every time is a pair of CUDA events, read at the decision and at each of the trial's verdicts (one sync
each), none per step.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass

import torch

from . import trial as policy_trial
from .codecs import chunk_bounds
from .powersgd import PowerSGD
from .schemes import AllreduceBucket, PowerSGDBucket
from .schemes.hierarchical import inner_plan_class

POLICIES = ("codec", "time")
# start_iter by default: DDP's first step (not timed); then 4 whose median window sets the load, the last 3 of them
# (a compute read from the step before's end) the wait.
WARMUP_STEPS = 5
MARGIN = 0.05  # an option replaces plain only where the model predicts it at least this much faster
KINDS = ("allreduce", "all-gather", "all-to-all", "reduce-scatter")


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
    smallest's time below the smallest, the last segment's slope beyond the largest. A link's cost is no one line (a
    token bucket's burst bends it; TCP's window and NCCL's protocols can), and one line fitted across 1 KiB to 8 MiB
    missed the sizes between by 2-3x behind a 100 Mbit/s link (benchmarks/README.md)."""

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
    def through(cls, points) -> "Curve":
        """The curve through (units, seconds) points (at sizes the same on every rank, so that the ranks' curves
        combine size by size), with no size slower than a larger one: noise only adds time, so of two such points
        the smaller size's is lowered, and of two at one size the slower is dropped."""
        least: dict[float, float] = {}
        for x, t in points:
            least[float(x)] = min(float(t), least.get(float(x), math.inf))
        xs = sorted(least)
        ts = [least[x] for x in xs]
        for i in range(len(ts) - 2, -1, -1):
            ts[i] = min(ts[i], ts[i + 1])
        return cls(tuple(xs), tuple(ts))

    def params(self) -> list[float]:
        return list(self.seconds)

    def with_params(self, values) -> "Curve":
        return Curve(self.sizes, tuple(values))

    def to_json(self):
        return {"sizes": list(self.sizes), "seconds": list(self.seconds)}


def link_from_json(saved) -> "Line | Curve":
    """A link as to_json wrote it: a Curve (measured), or a Line (stated: the planner; or saved before curves)."""
    return Curve(tuple(saved["sizes"]), tuple(saved["seconds"])) if isinstance(saved, dict) else Line(*saved)


def world_links(decision: dict) -> dict[str, "Line | Curve"]:
    """A decision's links over the whole group, by collective kind (what the trial's collectives are timed against)."""
    return {key.split("/")[1]: link_from_json(saved) for key, saved in decision["model"]["links"].items()
            if key.split("/")[0] == "world"}


@dataclass(frozen=True)
class Cost:
    """An option's seconds for one bucket: encode (on the hook's thread, before its collectives), wire (its first
    collective), decode (after its last); for a plan of two rounds also middle (between them: PowerSGD's Q, the
    two-phase owner's re-encode) and second (the collectives the sequencer issues once every bucket is launched);
    held: a collective waited for on the hook's thread before the wire (the hierarchical scheme's reduce-scatter inside
    the node), which delays the buckets after it as encode does."""

    encode: float
    wire: float
    decode: float
    middle: float = 0.0
    second: float = 0.0
    held: float = 0.0

    @property
    def total(self) -> float:
        return self.encode + self.held + self.wire + self.middle + self.second + self.decode

    @property
    def on_hook_thread(self) -> float:
        return self.encode + self.held

    def parts(self) -> list[float]:
        """The fields in the constructor's order (Cost(*c.parts()) == c)."""
        return [self.encode, self.wire, self.decode, self.middle, self.second, self.held]

    def loaded(self, load: float) -> "Cost":
        """The collectives' times (wire, second, held) x load; the kernels' as measured."""
        return Cost(self.encode, self.wire * load, self.decode, self.middle, self.second * load, self.held * load)


class CostModel:
    """Collectives per (level, kind), as Curves (measured) or Lines (told, in the planner), and the codec's kernels as
    Lines; and what each option costs a bucket."""

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
        if scheme == "plain":  # its division by the world size on the hook's thread, then the allreduce
            return Cost(self.kernel("divide", numel), self.link(level, "allreduce", numel * dtype.itemsize), 0.0)
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
        return Cost(inner.encode, inner.wire, inner.decode, inner.middle, inner.second + gather, held=scatter)


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
    plan's own launch (time_plan), or for plain its calls' time in the warm-up, which then stand for the kernels (the
    model's kernels are left out: zero). The model's "hook" kernel, the hook's own seconds per call beyond what it
    launches, is added to every compressed option's encode: the warm-up's plain calls held it too, but a plan's dry
    run does not."""
    numel = sum(torch.Size(s).numel() for s in shapes)
    hook = model.kernel("hook", 0)
    if measured:
        model = CostModel(model.links, {})

    def cost(o):
        c = (model.hierarchical(codec, shapes, numel, dtype, world, node_size) if o == "hierarchical"
             else model.flat(o, codec, shapes, numel, dtype, world, "world"))
        if measured and o in measured:
            encode, middle, decode = measured[o]
            c = Cost(c.encode + encode, c.wire, c.decode + decode, c.middle + middle, c.second, c.held)
        return c if o == "plain" else Cost(c.encode + hook, *c.parts()[1:])

    return {o: cost(o) for o in options}


def exposed(ready: list[float], costs: list[Cost], decodes_beside: list[bool] | None = None) -> float:
    """Seconds a step spends beyond backward without communication (the queue in the module's docstring); ready:
    each bucket's offset after the first, in launch order. decodes_beside: per bucket, whether its decode runs beside
    the collectives after it instead of holding the link (in_step's, for the options whose collectives the trial's
    steps timed); none by default."""
    if not costs:
        return 0.0
    beside = decodes_beside or [False] * len(costs)
    delay, free, first_done, ends = 0.0, -math.inf, [], []
    for offset, cost, aside in zip(ready, costs, beside):
        start = max(offset + delay + cost.on_hook_thread, free)
        delay += cost.on_hook_thread
        free = start + cost.wire + cost.middle
        if not cost.second:
            if aside:
                ends.append(free + cost.decode)
            else:
                free += cost.decode
        first_done.append(free)
    launched = ready[-1] + delay  # the hook's thread is through the last bucket: the sequencer's second round
    for done, cost, aside in zip(first_done, costs, beside):
        if cost.second:
            free = max(launched, done, free) + cost.second
            if aside:
                ends.append(free + cost.decode)
            else:
                free += cost.decode
    return max(max([free, *ends]) - ready[-1], 0.0)


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


# -- the decision, and how it reads -------------------------------------------------------------------------------


LOAD_BOUNDS = (0.5, 4.0)  # a warm-up step's window that implies more is taken as noise, not as the links' pace


def link_load(ready: list[float], plain: list[Cost], window: float | None) -> float:
    """How much longer the collectives take inside a step than their probes alone (CPU cores shared with backward
    and the other ranks, a rank waiting for the slowest one's backward): the factor on every collective's time that
    makes the plain queue end where the warm-up's plain steps did (bisection: the exposed time grows with it), within
    LOAD_BOUNDS; 1 where no window was measured or the plain queue hides whole behind backward."""
    def plain_exposed(load):
        return exposed(ready, [c.loaded(load) for c in plain])

    low, high = LOAD_BOUNDS
    at_high = plain_exposed(high)
    if window is None or at_high <= 0.0:
        return 1.0
    if plain_exposed(low) >= window:
        return low
    if at_high <= window:
        return high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if plain_exposed(middle) < window else (low, middle)
    return (low + high) / 2


def decide(model: CostModel, ready: list[float] | None, buckets: list[dict], codec, scheme_option: str, world: int,
           node_size: int | None, step: int, measured: list[dict] | None = None,
           plain_window: float | None = None, backward_skew: float | None = None) -> dict:
    """The decision for buckets ({"index", "shapes", "dtype"} in launch order): JSON-able, kept in the state.
    measured: per bucket, {option: (encode, middle, decode) seconds} of its plans' own launches, else the model's
    kernels. plain_window: the warm-up's plain steps' communication beyond the last rank's backward (seconds,
    gradcomp.measure's combine), which sets the load (link_load); backward_skew: how long the first rank through
    backward waited for the last (kept and shown, not predicted: every option waits it alike)."""
    options = candidates(codec, scheme_option, node_size is not None)
    overlap = ready is not None
    ready = ready if overlap else [0.0] * len(buckets)
    measured = measured or [None] * len(buckets)
    alone = [option_costs(model, options, codec, b["shapes"], b["dtype"], world, node_size, m)
             for b, m in zip(buckets, measured)]
    load = link_load(ready, [c["plain"] for c in alone], plain_window)
    costs = [{o: c.loaded(load) for o, c in per_option.items()} for per_option in alone]
    choice = choose(ready, costs)

    def predicted(per_bucket):  # the model's choice's exposed time, and each option's for every bucket
        return {"policy": exposed(ready, [c[n] for c, n in zip(per_bucket, choice)]),
                **{o: exposed(ready, [c[o] for c in per_bucket]) for o in options}}

    return {
        "step": step, "world_size": world, "node_size": node_size, "overlap_measured": overlap,
        "model": model.to_dict(), "options": options, "plain_window_s": plain_window,
        "backward_skew_s": backward_skew or 0.0,
        "link_load": load,
        "buckets": [{"index": b["index"], "elements": sum(torch.Size(s).numel() for s in b["shapes"]),
                     "bytes": sum(torch.Size(s).numel() for s in b["shapes"]) * b["dtype"].itemsize,
                     "ready_s": r, "choice": name,
                     "predicted_s": {o: c.parts() for o, c in cost.items()}}
                    for b, r, cost, name in zip(buckets, ready, costs, choice)],
        "predicted_exposed_s": predicted(costs),
        "predicted_exposed_alone_s": predicted(alone),  # at the probes' own pace: the trial prunes what is slow at both
    }


# The collective kind of the loaded parts (wire, second) of each flat scheme's Cost. The hierarchical scheme's run in
# the node's and the nodes' groups, whose collectives the trial does not time.
PART_KINDS = {"plain": ("allreduce", None), "allreduce": ("allreduce", None), "allgather": ("all-gather", None),
              "two-phase": ("all-to-all", "all-gather"), "powersgd": ("allreduce", "allreduce")}


def in_step(decision: dict, loads: dict[str, dict], plain_window: float | None = None) -> dict:
    """The decision's predictions again, at the loads that the trial's own steps showed instead of the one load
    fitted to the warm-up's plain steps:
        each compressed option's collectives at the loads its own steps showed, kind by kind (loads: option -> kind
            -> the link's busy time in the step over its collectives' probes, the least over the ranks:
            gradcomp.measure's WarmupTimings.collective_loads), and each bucket's encode (less the hook's own time)
            at its plan's launches in those steps over its dry run (loads: option -> "encode" -> per bucket in the
            decision's order, None where not launched, which takes the median of the others; one number for every
            bucket in a decision saved before: WarmupTimings.launch_loads);
        plain's at the load (link_load) that makes its queue end where the trial's steps that sent every bucket
            plain did (plain_window: their window, as the warm-up's is read; None where none ran): the one load is
            fitted to plain's whole window, as at the decision, from steps among the other candidates' (as a run's
            later steps are, where the warm-up's ran one after another);
        any other collective (a kind not timed; the hierarchical scheme's, in groups the trial does not time) as
            decided; the other kernels (decode, middle: on the collectives' callbacks) and backward's offsets as
            decided;
        the decodes of an option whose collectives the trial timed run beside the link, not holding it (exposed's
            decodes_beside): the time of a busy period of the link in the step holds the decodes run on the
            callbacks meanwhile (gloo runs two collectives at once; on a GPU the decode is not on NCCL's stream), so
            the load already holds what they take from it. Counted on the link as well, they put the allgathers and
            two-phase at 4 ranks at 1.25-1.5x what they measured.
    JSON-able, kept in the decision; explain() shows it. It changes no choice: the trial measured the steps."""
    load, hook = decision["link_load"], saved_hook_seconds(decision)
    ready = [bucket["ready_s"] for bucket in decision["buckets"]]
    plain_load = None
    if plain_window is not None and load > 0:
        plain_load = link_load(ready, [Cost(*b["predicted_s"]["plain"]).loaded(1 / load) for b in decision["buckets"]],
                               plain_window)

    def at_step(option: str, parts: list[float], at: int) -> Cost:
        cost = Cost(*parts)
        if option == "plain":
            return cost if plain_load is None else cost.loaded(plain_load / load)
        wire_kind, second_kind = PART_KINDS.get(option, (None, None))
        measured = loads.get(option, {})

        def scaled(seconds, kind):
            return seconds / load * measured[kind] if kind in measured and load > 0 else seconds

        factor = encode_load(measured.get("encode"), at)
        encode = cost.encode if factor is None else hook + (cost.encode - hook) * factor
        return Cost(encode, scaled(cost.wire, wire_kind), cost.decode, cost.middle,
                    scaled(cost.second, second_kind), cost.held)

    costs = [{o: at_step(o, parts, at) for o, parts in bucket["predicted_s"].items()}
             for at, bucket in enumerate(decision["buckets"])]
    timed = {option for option, kinds in loads.items() if set(kinds) - {"encode"}}  # its collectives, in the steps

    def at_loads(names: list[str]) -> float:
        return exposed(ready, [c[name] for c, name in zip(costs, names)], [name in timed for name in names])

    trial = decision.get("trial") or {}
    model_choice = (trial.get("choices") or {}).get(policy_trial.MODEL) or \
        [bucket["choice"] for bucket in decision["buckets"]]  # the buckets' choices follow the trial's candidates
    predicted = {"policy": at_loads(model_choice), **{o: at_loads([o] * len(costs)) for o in decision["options"]}}
    return {"loads": {option: dict(kinds) for option, kinds in loads.items()}, "plain_window_s": plain_window,
            "plain_load": plain_load, "predicted_exposed_s": predicted}


def encode_load(per_bucket, at: int) -> float | None:
    """The encode's load of the bucket at position `at` (in_step's loads[option]["encode"]): its own; the median of
    the option's other buckets' where it has none; a decision saved before the loads were per bucket holds one number
    for every bucket; None where none was measured."""
    if per_bucket is None or isinstance(per_bucket, (int, float)):
        return per_bucket
    if per_bucket[at] is not None:
        return per_bucket[at]
    others = [factor for factor in per_bucket if factor is not None]
    return statistics.median(others) if others else None


def saved_hook_seconds(decision: dict) -> float:
    """The hook's own seconds per call that a decision was taken with: its model's "hook" kernel (0 in a decision
    saved before gradcomp measured it)."""
    return Line(*decision["model"]["kernels"].get("hook", (0.0, 0.0))).fixed


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
    if decision.get("plain_window_s") is not None:
        lines.insert(1, f"collectives taken at {decision['link_load']:.2f}x their probes' times, as the warm-up's "
                        f"plain steps spent {decision['plain_window_s'] * 1e3:.2f} ms beyond the last rank's "
                        f"backward; the first rank through backward waited "
                        f"{decision.get('backward_skew_s', 0.0) * 1e3:.2f} ms for the last (every option alike: not "
                        f"in the predictions below)")
    hook = saved_hook_seconds(decision)
    if hook:
        lines.insert(1, f"each compressed bucket's hook call takes {hook * 1e3:.2f} ms beyond its plan's launch, as "
                        f"the warm-up's plain calls took beyond their allreduce's")
    for bucket in decision["buckets"]:
        times = " ".join(f"{sum(bucket['predicted_s'][o]) * 1e3:16.2f}" for o in options)
        lines.append(f"{bucket['index']:>6} {bucket['bytes'] / 1e6:8.2f} {times}  {bucket['choice']}")
    predicted = decision["predicted_exposed_s"]
    lines.append("predicted communication per step beyond backward (ms): "
                 + ", ".join(f"{o} {predicted[o] * 1e3:.2f}" for o in options)
                 + f", the model's choice {predicted['policy'] * 1e3:.2f}")
    lines += policy_trial.describe(decision.get("trial"))
    after = decision.get("in_step")
    if after and (after["loads"] or after.get("plain_load") is not None):
        loads = [f"{option}'s " + ", ".join(_load_text(kind, load) for kind, load in kinds.items())
                 for option, kinds in after["loads"].items()]
        if after.get("plain_load") is not None:
            loads.insert(0, f"plain's allreduces {after['plain_load']:.2f}x (its steps spent "
                            f"{after['plain_window_s'] * 1e3:.2f} ms beyond the last rank's backward)")
        predicted = after["predicted_exposed_s"]
        lines.append(f"in the trial's steps, the collectives against their probes and the encodes against their dry "
                     f"runs: {'; '.join(loads)} (the decision took every collective at "
                     f"{decision['link_load']:.2f}x); predicted at those, the decodes of the options timed there "
                     f"beside the link, as their loads hold them (ms): "
                     + ", ".join(f"{o} {predicted[o] * 1e3:.2f}" for o in options)
                     + f", the model's choice {predicted['policy'] * 1e3:.2f}")
    return "\n".join(lines)


def _load_text(kind: str, load) -> str:
    """One of in_step's loads as explain() shows it: a factor, or the encodes' bucket by bucket ("-": not launched)."""
    if isinstance(load, list):
        return f"{kind}s by bucket " + "/".join("-" if factor is None else f"{factor:.2f}x" for factor in load)
    return f"{kind} {load:.2f}x"
