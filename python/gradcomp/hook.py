"""The DDP communication hook: any gradcomp codec on every gradient bucket, with its state.

    state = gradcomp.register(ddp_model, "topk:ratio=0.01")       # or, by hand:
    ddp_model.register_comm_hook(gradcomp.CompressionState("qsgd"), gradcomp.hook)

One bucket, one step:
    warm-up (step < start_iter) without a start codec, a bucket too small to gain, a sparse or float64
        bucket -> plain allreduce of grad / world, exactly what DDP does without a hook;
    warm-up with a start codec (say qsgd:levels=127, about 4x smaller than plain and as good under AdamW's
        first steps): the bucket under that codec, which keeps no state between steps, so nothing is
        carried over when the run's codec takes over at step start_iter;
    otherwise the bucket's plan, by its scheme (a module each in gradcomp.schemes):
    allreduce (none, fp16, bf16, randomk): encode, divide the payload's values by world, allreduce
        them, decode in place;
    allgather or two-phase (signsgd, terngrad, qsgd, topk; the state's scheme option, by default
        the one that sends fewer bytes at this world size): all-gather the payloads and decode-and-sum
        them, or send chunks to their owners, which re-encode the chunk's average for an all-gather;
    powersgd: per tensor, P then Q allreduced;
    hierarchical (where the ranks form several nodes of several ranks): a reduce-scatter inside the node, the
        codec's flat exchange of this rank's shard between nodes, an all-gather inside the node.
Everything is asynchronous: collectives return futures and the next stage runs in a callback.

Stats count the bytes this rank sends and receives under each bucket's scheme (plain allreduce as a
ring: 2(W-1)/W of the bucket), and as raw what plain DDP's ring allreduce would send, so that
raw / wire is the saving against plain DDP at this world size.

Non-finite gradients: no extra collective and no host-device sync decide them. A NaN or Inf in a
rank's gradient + residual, or one the codec's own arithmetic would make, shows in that rank's payload
(a scale, norm or value; randomk adds one flag value to its allreduce) and survives the collective, so
every rank sees the same verdict in the data it receives. Such a bucket arrives non-finite on every
rank (AMP's GradScaler skips the step everywhere), and every rank keeps the residuals and PowerSGD's Q
it had before the step: each step writes its residual and Q into a second buffer, which becomes the
state only when the bucket's data is finite (on CUDA by a device-side select).

State lives per bucket (keyed by bucket.index()) and per parameter inside it, so when DDP lays its
buckets out anew (its rebuild after the first step, or a fresh process resuming a checkpoint)
residuals and Q follow their parameters; a bucket made of whole saved buckets is processed as
those saved buckets, so a resumed run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from ._futures import value_or_raise
from . import nodes as node_layout
from ._tensors import check_tensor
from .checkpoint import every_rank_world_size, is_every_rank, this_ranks_entry
from .codecs import codec as make_codec
from .powersgd import PowerSGD
from .schemes import (GATHERED, PLANS, AllgatherBucket, AllreduceBucket, HierarchicalBucket, PowerSGDBucket,
                      check_scheme, fixed_scheme, make_plan, plan_class, ring_allreduce_bytes, ring_crosses)

logger = logging.getLogger("gradcomp")
STATS_KEYS = ("raw_bytes", "wire_bytes", "received_bytes", "inside_node_bytes", "node_link_bytes",
              "node_link_raw_bytes", "encode_s", "decode_s", "buckets", "compressed_buckets", "nonfinite_buckets")
STATE_FORMAT = 1
_STATS_LOCK = threading.Lock()  # stats are a few additions per bucket: one lock for every state will do


@dataclass(frozen=True)
class BucketLayout:
    """A bucket as DDP laid it out: its index, its parameters (keys and shapes) and its dtype."""

    index: int
    keys: tuple
    shapes: tuple
    dtype: torch.dtype

    def to_dict(self) -> dict:
        return {"index": self.index, "keys": list(self.keys), "shapes": [list(s) for s in self.shapes],
                "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_dict(cls, saved) -> "BucketLayout":
        fields = ("index", "keys", "shapes", "dtype")
        try:
            return cls(int(saved["index"]), tuple(int(k) for k in saved["keys"]),
                       tuple(torch.Size(s) for s in saved["shapes"]), _saved_dtype(saved["dtype"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"gradcomp: a saved bucket layout must hold {', '.join(fields)}; got {saved!r} "
                             f"({error})") from None


class PayloadBucket:
    """The plan class of states pickled before each scheme had a module of its own: unpickles as the
    allreduce or allgather plan it was."""

    def __setstate__(self, state):
        self.__class__ = AllreduceBucket if state["codec"].collective == "allreduce" else AllgatherBucket
        self.__setstate__(state)


class _Sequencer:
    """Puts the collectives that callbacks start (PowerSGD's Q) in one order on every rank, and before
    anything DDP itself issues after the step's last bucket (find_unused_parameters' allreduce).

    Collectives must be issued in one order on all ranks, but callbacks run whenever a collective
    happens to finish on this rank. So each such collective takes a ticket when its bucket is
    launched (in bucket order, on the thread that calls the hook). When the step's last bucket has
    been launched, close() waits until every ticket's collective is ready to go (its P has arrived)
    and issues them in ticket order, on the hook's thread, before DDP's next collective. A chain of
    several such collectives (the hierarchical scheme's all-gather inside the node, after the exchange
    between nodes that itself ends in one) takes tickets of later rounds: close() issues round by round.
    """

    def __init__(self):
        self._ready: dict[int, Any] = {}
        self._tickets: list[tuple[int, torch.futures.Future]] = []  # (round, the result it completes)
        self._abandoned = False
        self._condition = threading.Condition()

    def ticket(self, result: torch.futures.Future, round_: int = 1) -> int:
        """A place in the order, in round round_, for the collective that will complete result."""
        self._tickets.append((round_, result))
        return len(self._tickets) - 1

    def submit(self, ticket: int, launch) -> None:
        """launch() issues the collective; it must handle its own errors. Called exactly once per ticket
        (also when the step failed), so close() never waits forever."""
        with self._condition:
            if not self._abandoned:
                self._ready[ticket] = launch
                self._condition.notify_all()

    def close(self) -> None:
        for round_ in sorted({r for r, _ in self._tickets}):
            tickets = [t for t, (r, _) in enumerate(self._tickets) if r == round_]
            with self._condition:
                self._condition.wait_for(lambda: self._abandoned or all(t in self._ready for t in tickets))
                if self._abandoned:
                    return
                launches = [self._ready.pop(t) for t in tickets]
            for launch in launches:
                launch()

    def abandon(self, error: BaseException) -> None:
        """A bucket failed on this rank mid-step: no more of the step's collectives start here (they could
        no longer match the other ranks'), and the buckets waiting for one end with the error."""
        with self._condition:
            self._abandoned = True
            self._ready.clear()
            self._condition.notify_all()
        for _, result in self._tickets:
            try:
                result.set_exception(error)
            except RuntimeError:  # completed meanwhile
                pass


class _Step:
    """What a bucket needs for one step: the group, this rank, the step, its stats and collectives."""

    __slots__ = ("group", "world", "rank", "step", "record", "total", "sequencer", "stats_lock", "decode_status",
                 "device_counters", "nonfinite_on_device", "nodes", "counts_nonfinite")

    def __init__(self, group, world, rank, step, record, total, sequencer, stats_lock, device_counters, nodes=None):
        self.group, self.world, self.rank, self.step, self.record, self.total = group, world, rank, step, record, total
        self.sequencer, self.stats_lock = sequencer, stats_lock
        self.decode_status = None  # CUDA: the step's device status word for the payload checks
        self.device_counters = device_counters  # CUDA: the step's non-finite bucket counts on the device
        self.nonfinite_on_device = None
        self.nodes = nodes  # the node layout and its groups (gradcomp.nodes.NodeLayout), where there is one
        self.counts_nonfinite = True

    def on(self, group, world: int, rank: int) -> "_Step":
        """The same step in another group (the hierarchical scheme's levels), with the same stats and sequencer;
        the bucket's own step counts its non-finite verdict."""
        step = _Step(group, world, rank, self.step, self.record, self.total, self.sequencer, self.stats_lock,
                     self.device_counters, self.nodes)
        step.decode_status, step.counts_nonfinite = self.decode_status, False
        return step

    def add(self, key: str, value: float) -> None:
        with self.stats_lock:  # callbacks add from the collectives' threads
            self.record[key] += value
            self.total[key] += value

    def add_plain_ddp_bytes(self, nbytes: int) -> None:
        """What plain DDP's ring allreduce of a bucket of nbytes sends: this rank's, and its node's across its link
        (once per ring step: the node's last rank sends to the next node's first)."""
        ring = ring_allreduce_bytes(nbytes, self.world)
        self.add("raw_bytes", ring)
        if self.nodes is not None and self.nodes.nodes > 1:
            self.add("node_link_raw_bytes", ring)

    def add_ring_bytes(self, nbytes: int) -> None:
        """What this rank sends and receives in a ring allreduce of nbytes (and its node across its link)."""
        ring = ring_allreduce_bytes(nbytes, self.world)
        self.add("wire_bytes", ring)
        self.add("received_bytes", ring)
        if self.nodes is not None:
            crosses = ring_crosses(self.rank, self.world, self.nodes)
            self.add("inside_node_bytes", 0 if crosses else ring)
            self.add("node_link_bytes", ring if self.nodes.nodes > 1 else 0)

    def add_plan_bytes(self, plan) -> None:
        """What a plan's scheme sends and receives, this rank's, and its node's across its link (every rank of the
        node counts what they all send: the same figure on each)."""
        sent, received = plan.traffic(self.world, self.rank)
        self.add("wire_bytes", sent)
        self.add("received_bytes", received)
        if self.nodes is not None:
            first = self.nodes.node * self.nodes.node_size
            self.add("inside_node_bytes", sent - plan.traffic_across(self.world, self.rank, self.nodes))
            self.add("node_link_bytes", sum(plan.traffic_across(self.world, r, self.nodes)
                                            for r in range(first, first + self.nodes.node_size)))

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return self._explained(dist.all_reduce(tensor, group=self.group, async_op=True).get_future(), "allreduce")

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.futures.Future:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._explained(gather(out.view(-1), tensor, group=self.group, async_op=True).get_future(), "all-gather")

    def reduce_scatter_now(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """A reduce-scatter, waited for here: on NCCL the current stream waits for it, not the host; on gloo (whose
        reduce-scatter has no future) the host does."""
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            scatter(out, tensor, group=self.group, async_op=True).wait()
        except Exception as error:
            raise self._failure("reduce-scatter", error) from error

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_splits, in_splits) -> torch.futures.Future:
        work = dist.all_to_all_single(out.view(-1), tensor, out_splits, in_splits, group=self.group, async_op=True)
        return self._explained(work.get_future(), "all-to-all")

    def count_nonfinite(self, finite: torch.Tensor) -> None:
        """Counts a bucket whose data was not finite: at once on the CPU, on the device on CUDA (read by stats())."""
        if not self.counts_nonfinite:
            return
        if not finite.is_cuda:
            if not bool(finite):
                self.add("nonfinite_buckets", 1)
            return
        with self.stats_lock:
            counter = self.nonfinite_on_device
            if counter is None or counter.device != finite.device:  # one counter per step, on one device
                counter = self.nonfinite_on_device = torch.zeros((), dtype=torch.int64, device=finite.device)
                self.device_counters.append(counter)
        counter.add_(~finite)

    def _explained(self, future: torch.futures.Future, what: str) -> torch.futures.Future:
        """The collective's result, or its error with what gradcomp was doing when it failed."""

        def check(done):
            try:
                return done.value()
            except Exception as error:
                raise self._failure(what, error) from error

        return future.then(check)

    def _failure(self, what: str, error: BaseException) -> RuntimeError:
        return collective_failure(what, self.step, self.rank, self.world, error)

    @staticmethod
    def new_future(device: torch.device) -> torch.futures.Future:
        return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()

    def chain_in_order(self, first, prepare, second, callback, result: torch.futures.Future, device,
                       round_: int = 1) -> None:
        """A bucket's two dependent collectives (PowerSGD's P then Q, two-phase's all-to-all then all-gather).

        first() issues the first collective now; when it completes, prepare(done) runs on its callback
        thread. The second is started from that callback, yet collectives must go in one order on every
        rank: so second() is issued by the step's sequencer, in bucket order on the hook's thread, after
        the CUDA work prepare queued on device. callback(done) runs when it completes. Any error ends in
        result; second() is issued even after one, so that the other ranks are not left waiting."""
        ticket = self.sequencer.ticket(result, round_)
        ready = []  # on CUDA: an event after prepare, which ran on another thread and stream

        def issue():
            try:
                if ready:
                    torch.cuda.current_stream(device).wait_event(ready[0])
                self.chain(second(), callback, result)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting DDP reducer
                if not result.done():
                    result.set_exception(error)

        def after_first(done):
            try:
                prepare(done)
                if device.type == "cuda":
                    ready.append(torch.cuda.Event())
                    ready[0].record(torch.cuda.current_stream(device))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting DDP reducer
                result.set_exception(error)
            self.sequencer.submit(ticket, issue)

        try:
            self.chain(first(), after_first, result)
        except BaseException:
            self.sequencer.submit(ticket, lambda: None)  # the step ends here: nothing for the second to wait on
            raise

    @staticmethod
    def chain(future: torch.futures.Future, callback, result: torch.futures.Future) -> None:
        """Runs callback(future) when future completes; any error (the collective's too) ends in result."""

        def guarded(done):
            try:
                callback(done)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting DDP reducer
                if not result.done():
                    result.set_exception(error)

        future.add_done_callback(guarded)


def collective_failure(what: str, step: int, rank: int, world: int, error: BaseException) -> RuntimeError:
    """The error every gradcomp collective ends with when it fails: what failed, where, and the likely why."""
    return RuntimeError(f"gradcomp: the {what} of step {step} failed on rank {rank} of {world} (a rank that died, "
                        f"stalled past the process group's timeout or left the group ends every rank's step this "
                        f"way): {error}")


class _DecodeChecks:
    """CUDA decodes check the payloads on the device and OR what they find into one status word per
    step and device (the bucket becomes NaN). The hook reads those words back without waiting: at
    each step it copies the earlier steps' words to pinned memory behind an event, and raises for
    any whose copy has landed with a problem in it. A bad payload surfaces one or two steps later,
    with no host-device sync in the hook."""

    __slots__ = ("_words", "_copies")

    def __init__(self):
        self._words: dict[tuple[int, torch.device], torch.Tensor] = {}  # (step, device) -> status word
        self._copies: list[tuple[int, torch.Tensor, Any]] = []           # (step, pinned copy, event)

    def word(self, step: int, device: torch.device) -> torch.Tensor | None:
        if device.type != "cuda":
            return None  # the CPU path raises at once
        key = (step, device)
        if key not in self._words:
            self._words[key] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._words[key]

    def poll(self, current_step: int) -> None:
        """Starts the read-back of the words of finished steps, and raises for any landed one that is not 0."""
        for key in [k for k in self._words if k[0] < current_step]:
            word = self._words.pop(key)
            with torch.cuda.device(word.device):
                copy = torch.empty(1, dtype=torch.int32, pin_memory=True)
                copy.copy_(word, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._copies.append((key[0], copy, event))
        pending, landed = [], []
        for entry in self._copies:  # each event queried once
            (landed if entry[2].query() else pending).append(entry)
        self._copies = pending
        for step, copy, _ in landed:
            if int(copy.item()) != 0:  # a pinned host tensor: no sync
                raise RuntimeError(f"gradcomp: malformed payloads in step {step}: "
                                   f"{_ops._C.describe_decode_problems(int(copy.item()))}; their buckets were "
                                   f"set to NaN (ranks with another gradcomp build, codec or memory corruption)")


def _empty_stats() -> dict[str, float]:
    return dict.fromkeys(STATS_KEYS, 0)


class _DeviceCounts:
    """CUDA: the non-finite buckets counted on the device (no host sync in the hook). The current step's
    counters are folded into one running total per device at the end of each step; stats() reads them."""

    __slots__ = ("current", "last", "total")

    def __init__(self):
        self.current: list = []  # the counters of the step in progress, appended by _Step
        self.last: list = []
        self.total: dict = {}    # device -> counter

    def end_step(self) -> None:
        for counter in self.current:
            if counter.device in self.total:
                self.total[counter.device].add_(counter)
            else:
                self.total[counter.device] = counter.clone()
        self.last, self.current = self.current, []

    @staticmethod
    def read(counters) -> int:
        return sum(int(c.item()) for c in counters)  # CUDA: a sync, when the caller asks for stats


class CompressionState:
    """Everything the hook keeps between steps: the codec, the step, per-bucket residuals and Q.

    Pickles (and state_dict()s) without its process group and its model. Parameters are keyed by
    their position in the model, resolved when the state meets its model (gradcomp.register, or the
    first step of a hook registered by hand), so a pickled or checkpointed state applies to a fresh
    copy of the model. Residuals belong to one rank: every rank saves and loads its own.
    """

    __slots__ = ("process_group", "codec", "scheme", "start_iter", "start_codec", "min_bucket_ratio", "log_every",
                 "node_size", "iter", "_plans", "_start_plans", "_warmup_layout", "_pool", "_param_keys", "_model",
                 "_ddp", "_nodes", "_verified", "_total", "_last", "_current", "_warned", "_sequencer", "_checks",
                 "_device_counts")

    def __init__(self, spec: str = "topk", *, process_group: dist.ProcessGroup | None = None, scheme: str = "auto",
                 start_iter: int = 2, start_codec: str | None = None, min_bucket_ratio: float = 1.0,
                 log_every: int = 0, node_size: int | None = None, model: torch.nn.Module | None = None,
                 **codec_params: Any):
        for name, value in (("start_iter", start_iter), ("log_every", log_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"gradcomp: {name}={value!r} must be an integer >= 0")
        if isinstance(min_bucket_ratio, bool) or not isinstance(min_bucket_ratio, (int, float)) or not (
                min_bucket_ratio >= 0):
            raise ValueError(f"gradcomp: min_bucket_ratio={min_bucket_ratio!r} must be a number >= 0")
        if "nonfinite" in codec_params:
            raise ValueError(f"gradcomp: nonfinite={codec_params['nonfinite']!r}: the option is gone; a bucket "
                             f"holding a NaN or Inf on any rank now always arrives non-finite on every rank, with "
                             f"residuals and Q left as they were (GradScaler skips the step)")
        self.codec = make_codec(spec, **codec_params)
        self.scheme = check_scheme(self.codec, scheme)
        self.start_codec = None if start_codec is None else _stateless_start_codec(start_codec, start_iter)
        self.process_group = process_group
        self.start_iter, self.min_bucket_ratio, self.log_every = start_iter, float(min_bucket_ratio), log_every
        self.node_size = node_layout.check_node_size(node_size)
        self.iter = 0
        self._plans: dict[int, Any] = {}  # bucket index -> its plan, an instance of one of schemes.PLANS
        self._start_plans: dict[int, Any] = {}  # the same under the start codec, for steps < start_iter
        # The buckets as DDP laid them out (once final) in the steps before start_iter: the run's codec starts on
        # them, so that a run resumed at start_iter, whose fresh DDP starts with other buckets, does as well.
        self._warmup_layout: dict[int, BucketLayout] = {}
        self._pool: dict[int, dict[str, torch.Tensor]] = {}  # per-parameter state waiting for its new bucket
        self._verified = False
        self._total, self._last, self._current = _empty_stats(), _empty_stats(), _empty_stats()
        self._warned: set[str] = set()
        self._unbind()
        if model is not None:
            self.bind(model)

    def _unbind(self) -> None:
        """Forgets the model (and the transient helpers): after unpickling, until the state meets its model."""
        self._param_keys: dict[int, int] = {}  # id(parameter) -> its position in model.parameters()
        self._model = None                     # weak reference to that model
        self._ddp = None                       # weak reference to the DistributedDataParallel around it, if known
        self._nodes = None                     # the node layout and its groups, where the scheme has two levels
        self._sequencer = _Sequencer()
        self._checks = _DecodeChecks()
        self._device_counts = _DeviceCounts()

    # -- configuration ---------------------------------------------------------------------------------------------

    @property
    def spec(self) -> str:
        return self.codec.spec()

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def config(self) -> dict[str, Any]:
        """What every rank must agree on (compared at the first step) and what a checkpoint must match."""
        world = dist.get_world_size(self._group()) if dist.is_initialized() else None
        scheme = self.scheme if self.scheme in ("hierarchical", "flat") else fixed_scheme(self.codec) or self.scheme
        return {"codec": self.spec, "scheme": scheme, "start_iter": self.start_iter,
                "start_codec": None if self.start_codec is None else self.start_codec.spec(),
                "min_bucket_ratio": self.min_bucket_ratio, "node_size": self.node_size, "world_size": world,
                "wire_format": _ops._C.format_version}

    def bind(self, model: torch.nn.Module, ddp: torch.nn.parallel.DistributedDataParallel | None = None) -> None:
        """Keys this state's parameters by their position in model.parameters() (the module DDP wraps), and
        checks a loaded state against them. gradcomp.register calls it; a hook registered by hand finds its
        DDP model at its first step."""
        params = list(model.parameters())
        self._param_keys = {id(p): i for i, p in enumerate(params)}
        self._model = weakref.ref(model)
        self._ddp = None if ddp is None else weakref.ref(ddp)
        self._check_against(params)

    def _find_ddp(self):
        """The DistributedDataParallel model this state is registered on (ddp.register_comm_hook(state, hook))."""
        with warnings.catch_warnings():  # isinstance on some deprecated torch.distributed objects warns
            warnings.simplefilter("ignore")
            for candidate in gc.get_objects():
                if isinstance(candidate, torch.nn.parallel.DistributedDataParallel) and any(
                        s is self for _, s in getattr(candidate, "_comm_hooks", ())):
                    return candidate
        return None

    def _meet_model(self, bucket: dist.GradBucket) -> None:
        """Binds to the registered DDP model (and takes its process group unless one was given) when the state
        has not met one, or when the bucket holds parameters of another model (the state moved to a new one)."""
        bound = self._model is not None and self._model() is not None
        if bound and all(id(p) in self._param_keys for p in bucket.parameters()):
            if self._ddp is None:  # built with model=: its DDP's options matter too (find_unused_parameters)
                ddp = self._find_ddp()
                self._ddp = weakref.ref(ddp) if ddp is not None else _no_ddp
            return
        ddp = self._find_ddp()
        if ddp is None:
            raise RuntimeError("gradcomp: this CompressionState does not know the model it is registered on; "
                               "register it with gradcomp.register(ddp_model, state) (or build it with "
                               "CompressionState(spec, model=ddp_model.module))")
        if self.process_group is None:
            self.process_group = ddp.process_group
        self.bind(ddp.module, ddp)

    def _verify(self) -> None:
        """All ranks compare their configuration and step, and the rank and world size their residuals were built
        on (a pickled state registered elsewhere): a mismatch raises on every rank, no hang."""
        mine = json.dumps({**self.config(), "step": self.iter}, sort_keys=True)
        built_on = sorted({(p.rank, p.world) for p in self._plans.values() if getattr(p, "world", None) is not None})
        group = self._group()
        everyone: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(everyone, (mine, built_on, node_layout.facts()), group=group)
        except Exception as error:
            raise collective_failure("comparison of the ranks' configuration", self.iter, dist.get_rank(group),
                                     len(everyone), error) from error
        if len({config for config, _, _ in everyone}) > 1:
            listing = "\n".join(f"  rank {r}: {config}" for r, (config, _, _) in enumerate(everyone))
            raise RuntimeError(f"gradcomp: the ranks are configured differently; every rank must register the same "
                               f"codec, parameters and step:\n{listing}")
        world = len(everyone)
        elsewhere = [f"rank {r} holds residuals of rank {a} of {w}" for r, (_, held, _) in enumerate(everyone)
                     for a, w in held if (a, w) != (r, world)]
        if elsewhere:
            raise RuntimeError(f"gradcomp: residuals belong to the rank that built them, and this state was built "
                               f"elsewhere ({'; '.join(elsewhere)}; this world has {world} ranks): each rank registers "
                               f"the state it pickled itself (or loads gradcomp.every_rank(state)'s checkpoint); on "
                               f"another world size, start from a fresh CompressionState")
        self._lay_out_nodes(group, [facts for _, _, facts in everyone])
        self._verified = True

    def _lay_out_nodes(self, group, gathered: list[dict[str, Any]]) -> None:
        """The node layout, for the stats of what crosses each node's link, and the groups of the hierarchical
        scheme where it may be taken; called on every rank at once (the same facts give the same layout). The
        hierarchical scheme falls back to the flat ones, saying why where it was asked for (or the nodes are
        unequal)."""
        world = len(gathered)
        asked = self.scheme == "hierarchical" or self.node_size is not None
        if self._nodes is not None or world == 1:
            return
        if group is not dist.group.WORLD and world != dist.get_world_size():
            if asked:
                self._warn_once("nodes", "gradcomp: node layouts, and so the hierarchical scheme, need DDP on the "
                                "default process group; this one runs on a subgroup: its buckets take the flat schemes")
            return
        size, found_by = node_layout.find_node_size(world, self.node_size, gathered)
        if size is None:
            self._warn_once("nodes", f"gradcomp: no layout of equal nodes: {found_by}; the buckets take the flat "
                            f"schemes")
            return
        layout = node_layout.NodeLayout(world, size, dist.get_rank(group), found_by)
        hierarchical = self.scheme in ("auto", "hierarchical")
        if hierarchical and layout.two_levels:
            layout.create_groups(group)
        elif hierarchical and asked:
            self._warn_once("nodes", f"gradcomp: the hierarchical scheme falls back to the flat schemes: "
                            f"{layout.describe()}, and it needs several nodes of several ranks")
        held = {p.node_size for p in self._plans.values() if isinstance(p, HierarchicalBucket)}
        if held - ({size} if layout.inside is not None else set()):
            raise RuntimeError(f"gradcomp: this state's hierarchical buckets were laid out for nodes of "
                               f"{sorted(held)} ranks; this run has {layout.describe()}")
        self._nodes = layout

    # -- the hook --------------------------------------------------------------------------------------------------

    def communicate(self, bucket: dist.GradBucket) -> torch.futures.Future:
        try:
            self._meet_model(bucket)
            if not self._verified:
                self._verify()
            self._checks.poll(self.iter)
            group = self._group()
            step = _Step(group, dist.get_world_size(group), dist.get_rank(group), self.iter, self._current,
                         self._total, self._sequencer, _STATS_LOCK, self._device_counts.current, self._nodes)
            buffer = bucket.buffer()
            step.add_plain_ddp_bytes(buffer.numel() * buffer.element_size())
            step.add("buckets", 1)
            starting, compressible = self.iter < self.start_iter, self._compressible(buffer)
            if starting and compressible and self._layout_is_final():
                self._record_layout(bucket, buffer)
            if not compressible:
                future = self._plain(step, buffer)
            elif starting and self.start_codec is None:
                future = self._plain_as_recorded(step, bucket, buffer)
            elif starting:
                self._warn_if_resumed_on_other_buckets(known=self.iter >= 2 and bool(self._start_plans))
                future = self._compressed(step, bucket, buffer, self._start_plans, self._new_start_plan)
            else:
                if not self._plans:
                    self._warn_if_resumed_on_other_buckets(known=bool(self._warmup_layout))
                    self._first_plans(step, buffer)
                future = self._compressed(step, bucket, buffer, self._plans, self._new_plan)
            if bucket.is_last():
                self._sequencer.close()
        except BaseException as error:
            # DDP abandons the step's backward: end the step here, and have the ranks compare their
            # steps again before the next collective (one whose step failed only here may be behind).
            self._sequencer.abandon(error)
            self._end_step()
            self._verified = False
            raise
        if bucket.is_last():
            self._end_step()
        return future

    def _ddp_model(self):
        return None if self._ddp is None else self._ddp()

    def _layout_is_final(self) -> bool:
        """Whether DDP's buckets keep their present layout: it lays them out anew once, after its first step (not
        under find_unused_parameters without static_graph)."""
        ddp = self._ddp_model()
        if ddp is None:
            return False
        rebuilt = getattr(ddp, "_has_rebuilt_buckets", True)
        return bool(rebuilt or (ddp.find_unused_parameters and not ddp.static_graph))

    def _record_layout(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
        keys = tuple(self._param_keys[id(p)] for p in bucket.parameters())
        for old in _overlapping(self._warmup_layout, bucket.index(), keys):
            del self._warmup_layout[old]
        self._warmup_layout[bucket.index()] = BucketLayout(bucket.index(), keys,
                                                           tuple(g.shape for g in bucket.gradients()), buffer.dtype)

    def _first_plans(self, step: _Step, buffer: torch.Tensor) -> None:
        """The run's codec's first step: its plans laid out as DDP's buckets were in the steps before (or as a state
        saved then holds them), so that a fresh DDP's first buckets, laid out otherwise, go as those did."""
        layout, self._warmup_layout = self._warmup_layout, {}
        for entry in layout.values():
            self._new_plan(step, entry.index, entry.keys, entry.shapes, entry.dtype, buffer.device)

    def _warn_if_resumed_on_other_buckets(self, known: bool) -> None:
        """A compressed step at step 1 or later on a fresh DDP's first buckets (a resumed run), whose layout the
        uninterrupted run never used and the state does not know (known: it holds the buckets as DDP laid them
        out for good): the codec's blocks, selections and random streams follow the buckets, so say it."""
        if not known and self.iter >= 1 and not self._layout_is_final():
            self._warn_once("layout", f"gradcomp: this run resumed at step {self.iter} from a state saved before DDP "
                            f"laid its buckets out for good (after step 0), and compresses this step: the first "
                            f"buckets of a fresh DDP are laid out otherwise, so it trains on, but not bit for bit as "
                            f"the uninterrupted run (a checkpoint from step 2 on resumes exactly)")

    def _compressible(self, buffer: torch.Tensor) -> bool:
        if buffer.layout != torch.strided:
            return self._warn_once("sparse", "gradcomp: sparse gradients go through plain allreduce")
        if buffer.dtype not in _ops.DTYPE_IDS:
            return self._warn_once(str(buffer.dtype), f"gradcomp: {buffer.dtype} gradients go through plain "
                                   f"allreduce (codecs take {', '.join(map(str, _ops.DTYPE_IDS))})")
        return True

    def _warn_once(self, key: str, message: str) -> bool:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)
        return False

    @staticmethod
    def _plain(step: _Step, tensor: torch.Tensor) -> torch.futures.Future:
        step.add_ring_bytes(tensor.numel() * tensor.element_size())
        tensor.div_(step.world)
        return step.allreduce(tensor).then(lambda done: value_or_raise(done)[0])

    def _compressed(self, step: _Step, bucket: dist.GradBucket, buffer: torch.Tensor, plans: dict,
                    new_plan) -> torch.futures.Future:
        """The bucket under the codec of `plans` (the run's, or the start codec's): by its plan; as the saved plans
        that together make it up (a bucket made of whole earlier or saved buckets, such as a fresh DDP's first one,
        goes as those, so a resumed run repeats the uninterrupted one); else by new_plan's."""
        keys = tuple(self._param_keys[id(p)] for p in bucket.parameters())
        views = bucket.gradients()
        plan = plans.get(bucket.index())
        if plan is None or plan.keys != keys:
            saved = self._saved_buckets_covering(plans, keys, views, buffer.dtype)
            if saved:
                return self._launch_saved(step, saved, dict(zip(keys, views)), buffer)
            plan = new_plan(step, bucket.index(), keys, [v.shape for v in views], buffer.dtype, buffer.device)
        return self._launch(step, plan, buffer, views)

    def _launch(self, step: _Step, plan, flat: torch.Tensor, views) -> torch.futures.Future:
        if not self._gains(step, plan, flat):
            return self._plain(step, flat)
        if plan.device is not None and plan.device != flat.device:  # a loaded checkpoint, kept on the CPU
            plan.to(flat.device)
        step.add_plan_bytes(plan)
        step.add("compressed_buckets", 1)
        step.decode_status = self._checks.word(step.step, flat.device)
        ddp = self._ddp_model()
        if ddp is None or not ddp.find_unused_parameters:
            return plan.launch(step, flat, views)
        counts = self._nonzero_counts(step, views)
        future = plan.launch(step, flat, views)

        def set_idle_aside(done):
            bucket_result, counted = done.value()
            value_or_raise(bucket_result)
            value_or_raise(counted)
            plan.set_idle_aside(counts == 0, flat)
            return flat

        return torch.futures.collect_all([future, step.allreduce(counts)]).then(set_idle_aside)

    @staticmethod
    def _nonzero_counts(step: _Step, views) -> torch.Tensor:
        """find_unused_parameters: per parameter of the bucket, 1 where this rank's gradient is not all zero, to be
        summed over the ranks. DDP leaves the .grad of a parameter that no rank used as it was, so what the codec
        sends for it would be lost; a parameter whose sum is 0 is set aside instead (plan.set_idle_aside). A few
        bytes, allreduced right after the bucket's first collective (the same order on every rank), and counted."""
        counts = torch.stack([v.ne(0).any() for v in views]).to(torch.int32)
        step.add_ring_bytes(counts.numel() * counts.element_size())
        return counts

    @staticmethod
    def _saved_buckets_covering(saved: dict, keys, views, dtype) -> list:
        """The saved plans that together are exactly this bucket (same parameters and shapes), else []."""
        owner = {k: plan for plan in saved.values() for k in plan.keys}
        shapes = dict(zip(keys, (v.shape for v in views)))
        plans = {id(owner[k]): owner[k] for k in keys if k in owner}
        if any(k not in owner for k in keys) or sum(len(p.keys) for p in plans.values()) != len(keys):
            return []
        if any(p.dtype != dtype or any(shapes[k] != s for k, s in zip(p.keys, p.shapes)) for p in plans.values()):
            return []
        return sorted(plans.values(), key=lambda p: p.index)

    def _plain_as_recorded(self, step: _Step, bucket: dist.GradBucket, buffer: torch.Tensor) -> torch.futures.Future:
        """A plain step. On a fresh DDP's first buckets (a run resumed during the first steps) as the buckets DDP
        laid out for good before, when the state recorded them: a ring allreduce sums in an order that follows the
        tensor's size, so this repeats the uninterrupted run's sums bit for bit at any world size."""
        if self._warmup_layout and not self._layout_is_final():
            keys = tuple(self._param_keys[id(p)] for p in bucket.parameters())
            views = bucket.gradients()
            parts = self._saved_buckets_covering(self._warmup_layout, keys, views, buffer.dtype)
            if parts:
                return self._in_parts(parts, dict(zip(keys, views)), buffer,
                                      lambda part, flat, views: self._plain(step, flat))
        return self._plain(step, buffer)

    def _launch_saved(self, step: _Step, plans, views_by_key, buffer: torch.Tensor) -> torch.futures.Future:
        """This bucket holds several saved buckets (a fresh DDP's first step): each goes as it was saved."""
        return self._in_parts(plans, views_by_key, buffer,
                              lambda plan, flat, views: self._launch(step, plan, flat, views))

    @staticmethod
    def _in_parts(parts, views_by_key, buffer: torch.Tensor, launch) -> torch.futures.Future:
        """The bucket as the given parts (plans or layouts, each with keys): launch(part, flat, views) on a flat copy of
        each part's gradients; the results are copied back into the bucket."""
        futures, copies = [], []
        for part in parts:
            views = [views_by_key[k] for k in part.keys]
            flat = torch.cat([v.reshape(-1) for v in views])
            flat_views = [piece.view(v.shape) for piece, v in zip(flat.split([v.numel() for v in views]), views)]
            futures.append(launch(part, flat, flat_views))
            copies.append((views, flat_views))

        def scatter(done):
            for future in done.value():
                value_or_raise(future)  # raises what a bucket raised
            for views, flat_views in copies:
                for view, part in zip(views, flat_views):
                    view.copy_(part)
            return buffer

        return torch.futures.collect_all(futures).then(scatter)

    def _gains(self, step: _Step, plan, flat: torch.Tensor) -> bool:
        """Whether plain allreduce would send more than min_bucket_ratio x what the compressed bucket sends
        (rank 0's figure, so that every rank decides alike; one rank alone compares the bucket with its
        payload)."""
        nbytes = flat.numel() * flat.element_size()
        if step.world == 1:
            return nbytes > plan.payload_bytes() * self.min_bucket_ratio
        plain = ring_allreduce_bytes(nbytes, step.world)
        weighed = getattr(plan, "weighed_bytes", None)  # the hierarchical scheme weighs what crosses the nodes' links
        plain, sent = weighed(step.world, plain) if weighed else (plain, plan.traffic(step.world, 0)[0])
        return plain > sent * self.min_bucket_ratio

    def _new_plan(self, step: _Step, index: int, keys, shapes, dtype: torch.dtype, device: torch.device):
        """A bucket laid out anew: the old state of its parameters moves over, nothing is misapplied."""
        for old in _overlapping(self._plans, index, keys):
            plan = self._plans.pop(old)
            self._pool.update(plan.pieces())
            loss = getattr(plan, "relayout_loss", None)  # state that covers parts of parameters
            if loss and any(t is not None for t in plan.tensors().values()):
                logger.warning("gradcomp: bucket %d was laid out anew; %s starts again from zero", old, loss)
        plan = self._make_plan(self.codec, step, index, keys, shapes, dtype, device)
        plan.take(self._pool)
        self._plans[index] = plan
        return plan

    def _new_start_plan(self, step: _Step, index: int, keys, shapes, dtype: torch.dtype, device: torch.device):
        """A bucket laid out anew during the start steps: the start codec keeps no state, so the plans it replaces
        are dropped."""
        for old in _overlapping(self._start_plans, index, keys):
            del self._start_plans[old]
        plan = self._make_plan(self.start_codec, step, index, keys, shapes, dtype, device)
        self._start_plans[index] = plan
        return plan

    def _make_plan(self, codec, step: _Step, index: int, keys, shapes, dtype: torch.dtype, device: torch.device):
        numel = sum(torch.Size(s).numel() for s in shapes)
        grouped = self._nodes if self._nodes is not None and self._nodes.inside is not None else None
        plan_type = plan_class(codec, self.scheme, numel, dtype, step.world, grouped)
        return make_plan(plan_type, codec, index, keys, shapes, dtype, device, world=step.world, rank=step.rank,
                         node_size=None if grouped is None else grouped.node_size)

    def _end_step(self) -> None:
        self.iter += 1
        if self.iter >= self.start_iter:
            self._start_plans.clear()
        self._sequencer = _Sequencer()
        self._device_counts.end_step()
        self._last, self._current = self._current, _empty_stats()
        if self.log_every and self.iter % self.log_every == 0:
            stats = self.stats()
            logger.info("gradcomp %s step %d, %s ranks: %s", self.spec, self.iter, stats["world_size"],
                        _describe(stats["total"]))

    # -- stats -----------------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """{"step", "world_size", "schemes": {scheme: buckets the run's codec laid out for it (not the start
        codec)}, "last": the last finished step, "total": since the start}. "last" and "total" hold the bytes
        this rank sent ("wire_bytes") and received under each bucket's scheme; "raw_bytes", what plain DDP's
        ring allreduce would have sent (2(W-1)/W of each bucket); "ratio" = raw / wire, the saving against plain
        DDP at this world size; where the node layout is known, "inside_node_bytes", what this rank sends to ranks
        of its own node, "node_link_bytes" and "node_link_raw_bytes", what this rank's node sends across its
        link under gradcomp and under plain DDP (0 on one node), and "node_link_ratio" between them (the saving
        where the link between nodes is the slow one: "ratio" counts the full-precision bytes inside a node of the
        hierarchical scheme too); encode and decode seconds; buckets, compressed buckets and non-finite buckets."""

        def with_ratio(stats, device_nonfinite):
            stats = {**stats, "nonfinite_buckets": stats["nonfinite_buckets"] + device_nonfinite}
            link = stats["node_link_bytes"]
            return {**stats, "ratio": stats["raw_bytes"] / stats["wire_bytes"] if stats["wire_bytes"] else 1.0,
                    "node_link_ratio": stats["node_link_raw_bytes"] / link if link else 1.0}

        counts = self._device_counts
        schemes: dict[str, int] = {}
        for plan in self._plans.values():
            schemes[plan.scheme] = schemes.get(plan.scheme, 0) + 1
        world = dist.get_world_size(self._group()) if dist.is_initialized() else None
        return {"step": self.iter, "world_size": world, "schemes": schemes,
                "last": with_ratio(self._last, counts.read(counts.last)),
                "total": with_ratio(self._total, counts.read(counts.total.values()))}

    def memory_bytes(self) -> int:
        """Bytes this state holds between steps: error-feedback residuals and PowerSGD's Q, each twice (the
        step writes the new ones beside the old, which stay when the step's data is not finite), and state
        waiting for its parameter's next bucket. A step adds, per bucket in flight, its payload (and the
        world's gathered payloads for allgather codecs; P for powersgd) and frees it when the bucket completes."""
        plans = [*self._plans.values(), *self._start_plans.values()]
        tensors = [t for plan in plans for t in [*plan.tensors().values(), *plan.spares()]]
        tensors += [t for piece in self._pool.values() for t in piece.values()]  # views keep whole buffers alive
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(storages.values())

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of this rank's state: config, step, per-bucket residuals and Q, stats; during a start codec's
        steps, its buckets' layout."""
        rank = dist.get_rank(self._group()) if dist.is_initialized() else None
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731

        def layout(p):
            return {"index": p.index, "keys": list(p.keys), "shapes": [list(s) for s in p.shapes],
                    "dtype": str(p.dtype).removeprefix("torch."), "scheme": p.scheme,
                    **({"node_size": p.node_size} if isinstance(p, HierarchicalBucket) else {})}

        return {
            "format": STATE_FORMAT, "config": self.config(), "rank": rank, "iter": self.iter,
            "buckets": [{**layout(p), "tensors": {k: clone(t) for k, t in p.tensors().items()}}
                        for p in self._plans.values()],
            "start_buckets": [layout(p) for p in self._start_plans.values()],
            "warmup_buckets": [entry.to_dict() for entry in self._warmup_layout.values()],
            "pool": {key: {k: clone(t) for k, t in piece.items()} for key, piece in self._pool.items()},
            "total": dict(self._total),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what state_dict() saved, after checking it was saved for this configuration and rank; from
        what every_rank(state).state_dict() saved, this rank's entry."""
        rank = dist.get_rank(self._group()) if dist.is_initialized() else None
        if is_every_rank(state):  # its entries can be told apart only on the world size that saved them
            self._refuse_other_configuration({**self.config(), "world_size": every_rank_world_size(state)})
            state = this_ranks_entry(state, rank)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else None
            raise ValueError(f"gradcomp: not a gradcomp state (format {STATE_FORMAT}); got "
                             f"{type(state).__name__} with format {found}")
        saved_config = {"scheme": self._scheme_before_schemes(), **state["config"]}
        self._refuse_other_configuration(saved_config)
        if state.get("rank") is not None and rank is not None and state["rank"] != rank:
            raise ValueError(f"gradcomp: this state holds rank {state['rank']}'s residuals; this is rank {rank} "
                             f"(every rank loads the state it saved; where a framework saves rank 0's checkpoint "
                             f"only, save and load gradcomp.every_rank(state), which holds every rank's)")
        plans = {}
        # Where the saving run's world or rank is unknown (saved without a process group), this one's
        world = saved_config.get("world_size") or self.config()["world_size"] or 1
        saved_rank = next(r for r in (state.get("rank"), rank, 0) if r is not None)
        for saved in state["buckets"]:
            plan = self._plan_from_layout(saved, world, saved_rank, self.codec)
            plan.load_tensors(saved["tensors"])
            plans[saved["index"]] = plan
        start_plans = {}
        start_buckets = state.get("start_buckets", [])  # states saved before start codecs have none
        if start_buckets and (self.start_codec is None or int(state["iter"]) >= self.start_iter):
            raise ValueError(f"gradcomp: the state holds start-codec buckets at step {state['iter']}, but "
                             f"start_codec={self.config()['start_codec']!r} with start_iter={self.start_iter}")
        for saved in start_buckets:
            start_plans[saved["index"]] = self._plan_from_layout(saved, world, saved_rank, self.start_codec)
        warmup_layout = {}
        for saved in state.get("warmup_buckets", []):  # states saved before they were kept have none
            entry = BucketLayout.from_dict(saved)
            warmup_layout[entry.index] = entry
        pool = {int(k): dict(v) for k, v in state["pool"].items()}
        for key, piece in pool.items():
            for name, tensor in piece.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"gradcomp: the saved {name} of parameter {key} is {type(tensor).__name__}, "
                                     f"not a tensor")
        self._plans, self._pool, self._start_plans, self._warmup_layout = plans, pool, start_plans, warmup_layout
        self.iter = int(state["iter"])
        for plan in plans.values():
            if isinstance(plan, PowerSGDBucket):
                plan.redraw_dead_columns(self.iter)
        self._total = {**_empty_stats(), **state["total"]}
        self._last, self._current = _empty_stats(), _empty_stats()
        self._verified = False  # the ranks compare their steps again
        model = self._model() if self._model is not None else None
        if model is not None:
            self._check_against(list(model.parameters()))

    def _refuse_other_configuration(self, saved_config: dict[str, Any]) -> None:
        """A ValueError naming every setting saved_config has otherwise than this state (a world size only when
        both are known)."""
        differing = {k: (saved_config.get(k), v) for k, v in self.config().items()
                     if saved_config.get(k) != v and not (k == "world_size" and None in (v, saved_config.get(k)))}
        if differing:
            listing = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in differing.items())
            hint = ("; residuals belong to the ranks that built them, so a run on another number of ranks starts "
                    "from a fresh CompressionState (the residuals are dropped, training goes on)"
                    if "world_size" in differing else "")
            raise ValueError(f"gradcomp: the state was saved for another configuration ({listing}){hint}")

    def _scheme_before_schemes(self) -> str:
        """The scheme of a state saved before states named their schemes: the codec's one, else allgather."""
        return fixed_scheme(self.codec) or AllgatherBucket.scheme

    def _plan_from_layout(self, saved: dict, world: int, rank: int, codec):
        """A plan on the CPU under codec (the run's or the start codec) for a saved bucket's layout (state_dict's
        "buckets" and "start_buckets" entries); its tensors are the caller's to load."""
        plan_type = self._saved_plan_type(saved.get("scheme", self._scheme_before_schemes()), codec)
        return make_plan(plan_type, codec, saved["index"], saved["keys"], saved["shapes"], _saved_dtype(saved["dtype"]),
                         "cpu", world=world, rank=rank, node_size=saved.get("node_size"))

    @staticmethod
    def _saved_plan_type(scheme, codec) -> type:
        """The plan class of a saved bucket's scheme, refused where codec does not travel by it."""
        fixed = fixed_scheme(codec)
        allowed = ([fixed] if fixed else [plan.scheme for plan in GATHERED]) + [HierarchicalBucket.scheme]
        if scheme not in allowed:
            raise ValueError(f"gradcomp: the state holds a bucket of scheme {scheme!r}; {codec.name} travels by "
                             f"{' or '.join(allowed)}")
        return PLANS[scheme]

    def _check_against(self, params: list) -> None:
        """Refuses state that does not fit the model: a parameter position it lacks, or another shape or dtype."""
        def parameter(key, where):
            if not isinstance(key, int) or not 0 <= key < len(params):
                raise ValueError(f"gradcomp: the state holds {where} of parameter {key!r}, but the model has "
                                 f"{len(params)} parameters (0..{len(params) - 1}): was it saved for another model?")
            return params[key]

        for plan in [*self._plans.values(), *self._start_plans.values(), *self._warmup_layout.values()]:
            for key, shape in zip(plan.keys, plan.shapes):
                p = parameter(key, f"bucket {plan.index}'s state")
                if p.shape != shape or p.dtype != plan.dtype:
                    raise ValueError(f"gradcomp: bucket {plan.index}'s state of parameter {key} is for shape "
                                     f"{list(shape)} {plan.dtype}; the model's parameter {key} is {list(p.shape)} "
                                     f"{p.dtype}")
        layout = PLANS[fixed_scheme(self.codec) or AllgatherBucket.scheme].piece_layout  # alike for both gathered
        for key, piece in self._pool.items():
            p = parameter(key, "state")
            expected = layout(self.codec, p.shape, p.dtype)
            for name, tensor in piece.items():
                check_tensor(f"{name} of parameter {key}", tensor, *expected.get(name, (None, None)))

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__
                if name not in ("process_group", "_sequencer", "_checks", "_param_keys", "_model", "_ddp",
                                "_device_counts")}

    def __setstate__(self, state):
        self.process_group = None
        self.start_codec, self._start_plans = None, {}  # states pickled before start codecs have neither
        self.node_size = None  # nor before nodes
        self._warmup_layout = {}  # nor before the buckets' layout was kept during the first steps
        self._unbind()  # parameters are matched anew when the state meets its model
        for name, value in state.items():
            setattr(self, name, value)
        self._verified = False  # the ranks it meets compare their configurations, and where its residuals came from
        if "scheme" not in state:  # pickled before there were schemes to choose from
            self.scheme = "auto" if fixed_scheme(self.codec) else AllgatherBucket.scheme


def _no_ddp():
    """The DDP model of a state whose hook runs without one it can find."""
    return None


def _overlapping(plans: dict, index: int, keys) -> list[int]:
    """The indices of the plans (or layouts) a bucket laid out anew replaces: its own index, and any holding one of
    its keys."""
    wanted = set(keys)
    return [i for i, plan in plans.items() if i == index or wanted.intersection(plan.keys)]


def _stateless_start_codec(spec, start_iter: int):
    """The start codec of spec: one that keeps no state between steps (what it would keep could not carry over
    to the run's codec), for a warm-up of at least one step."""
    if not isinstance(spec, str):
        raise ValueError(f"gradcomp: start_codec={spec!r} must be a codec spec (a string), or None for plain "
                         f"allreduce during the first start_iter steps")
    try:
        codec = make_codec(spec)
    except ValueError as error:
        raise ValueError(f"gradcomp: start_codec={spec!r}: {error}") from None
    if isinstance(codec, PowerSGD) or codec.error_feedback:
        kept = "PowerSGD's Q" if isinstance(codec, PowerSGD) else "an error-feedback residual"
        raise ValueError(f"gradcomp: start_codec={spec!r} keeps {kept} between steps, which the run's codec could "
                         f"not take over; a start codec keeps none: any codec but powersgd, with error_feedback=false "
                         f"(the default of none, fp16, bf16, qsgd and terngrad)")
    if start_iter == 0:
        raise ValueError(f"gradcomp: start_codec={spec!r} runs for the first start_iter steps, and start_iter=0 "
                         f"leaves it none; give start_iter >= 1")
    return codec


def _saved_dtype(name) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in _ops.DTYPE_IDS:
        raise ValueError(f"gradcomp: the state names dtype {name!r}; valid: "
                         f"{', '.join(str(d).removeprefix('torch.') for d in _ops.DTYPE_IDS)}")
    return dtype


def _describe(stats: dict[str, Any]) -> str:
    return (f"{stats['wire_bytes'] / 1e6:.2f} MB on the wire for {stats['raw_bytes'] / 1e6:.2f} MB "
            f"({stats['ratio']:.1f}x), encode {stats['encode_s']:.3f}s, decode {stats['decode_s']:.3f}s")


def gradcomp_hook(state, bucket):  # DDP checks the annotations, which this module's string annotations would fail
    """The communication hook: ddp_model.register_comm_hook(state, gradcomp.hook).

    state: a CompressionState; bucket: a torch.distributed.GradBucket; returns a Future holding the
    bucket's averaged gradient (written in place into bucket.buffer())."""
    return state.communicate(bucket)


hook = gradcomp_hook  # DDP's logs (_get_ddp_logging_data()["comm_hook"]) name a hook by its function's name

WHERE_TO_REGISTER = (
    "call gradcomp.register on the DistributedDataParallel model, once it is wrapped: plain PyTorch: "
    "DistributedDataParallel(model) after dist.init_process_group; Lightning: Trainer(callbacks="
    "[gradcomp.lightning.GradcompCallback(spec)]); Fabric: the module fabric.setup(model) returns; Accelerate: "
    "gradcomp.accelerate.register(accelerator, accelerator.prepare(model), spec)")


def find_ddp(model) -> torch.nn.parallel.DistributedDataParallel:
    """The DistributedDataParallel model inside what a user holds: DDP itself, Fabric's module (fabric.setup's
    result), or a LightningModule whose trainer has wrapped it; otherwise a TypeError saying where to call."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    inner = getattr(model, "_forward_module", None)  # Fabric's _FabricModule
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner
    if any(c.__name__ == "LightningModule" for c in type(model).__mro__):
        trainer = getattr(model, "_trainer", None)
        wrapped = getattr(getattr(trainer, "strategy", None), "model", None)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            return wrapped
        raise TypeError(f"gradcomp.register: this LightningModule ({type(model).__name__}) is not wrapped in "
                        f"DistributedDataParallel (yet); with Lightning, add gradcomp.lightning.GradcompCallback(spec) "
                        f"to the Trainer's callbacks, which registers once the DDP strategy has wrapped the model")
    what = type(model).__name__
    if isinstance(inner, torch.nn.Module):
        what += f" around a {type(inner).__name__} (this process runs no DDP: is the world size 1?)"
    raise TypeError(f"gradcomp.register takes a DistributedDataParallel model, got {what}; {WHERE_TO_REGISTER}")


def register(ddp_model: torch.nn.Module, spec: "str | CompressionState" = "topk", *,
             process_group: dist.ProcessGroup | None = None, scheme: str = "auto", start_iter: int = 2,
             start_codec: str | None = None, min_bucket_ratio: float = 1.0, log_every: int = 0,
             node_size: int | None = None, **codec_params: Any) -> CompressionState:
    """Registers codec `spec` as ddp_model's communication hook; returns its state (for stats and checkpoints).

    ddp_model: a DistributedDataParallel model, or what a framework hands out around one (Fabric's module,
        a LightningModule once its trainer has wrapped it; with Lightning, gradcomp.lightning.GradcompCallback
        registers at the right moment).

    spec: a codec spec, or a CompressionState (say, one unpickled or loaded from a checkpoint), which is
        then registered as it is (with no other options).
    process_group: the group to communicate in; by default the one DDP was built with.
    scheme: how signsgd, terngrad, qsgd and topk payloads travel: "allgather" (every rank's payload to
        every rank: W-1 payloads sent per rank), "two-phase" (chunks to their owners, re-encoded averages
        back: about 2 payloads per rank at any W), "hierarchical" (full precision inside each node, the
        codec's exchange of a 1/L shard between nodes; powersgd's shards are groups of whole parameters), or
        "auto" (the default): hierarchical where the ranks form several nodes of several ranks, else per
        bucket the flat scheme that sends fewer bytes at this world size; "flat" is auto without the
        hierarchical scheme. Other codecs take "auto", "flat" or "hierarchical".
    start_iter: steps of plain allreduce first (past DDP's bucket rebuild after step 0). Under AdamW a few % of
        the run's steps: much of what a codec costs there arises in the first steps.
    start_codec: a codec spec for those first steps in place of plain allreduce, one that keeps no state
        between steps (any codec but powersgd, with error_feedback=false, the default of none, fp16, bf16, qsgd
        and terngrad), e.g. "qsgd:levels=127", about 4x smaller than plain. It travels by `scheme` too.
    min_bucket_ratio: a bucket is compressed only when raw bytes > this x its bytes on the wire.
    log_every: log the cumulative stats to the "gradcomp" logger every N steps (0: never).
    node_size: the ranks per node (ranks n*L .. n*L+L-1 share node n), for the hierarchical scheme; by default
        torchrun's LOCAL_WORLD_SIZE, else the ranks' host names. Given, it also emulates nodes on one machine.
    """
    ddp_model = find_ddp(ddp_model)
    if isinstance(getattr(ddp_model, "_gradcomp_state", None), CompressionState):
        raise RuntimeError(f"gradcomp: a hook ({ddp_model._gradcomp_state.spec}) is already registered on this "
                           f"model; DDP takes one communication hook per model")
    group = process_group if process_group is not None else ddp_model.process_group
    if isinstance(spec, CompressionState):
        options = {"scheme": (scheme, "auto"), "start_iter": (start_iter, 2), "start_codec": (start_codec, None),
                   "min_bucket_ratio": (min_bucket_ratio, 1.0), "log_every": (log_every, 0),
                   "node_size": (node_size, None), **{k: (v, None) for k, v in codec_params.items()}}
        given = [k for k, (value, default) in options.items() if value != default]
        if given:
            raise ValueError(f"gradcomp.register: options ({', '.join(given)}) go with a spec, not with a "
                             f"CompressionState, which keeps its own")
        state = spec
        if process_group is not None or state.process_group is None:
            state.process_group = group
    else:
        state = CompressionState(spec, process_group=group, scheme=scheme, start_iter=start_iter,
                                 start_codec=start_codec, min_bucket_ratio=min_bucket_ratio, log_every=log_every,
                                 node_size=node_size, **codec_params)
    state.bind(ddp_model.module, ddp_model)
    ddp_model.register_comm_hook(state, hook)
    ddp_model._gradcomp_state = state
    return state
