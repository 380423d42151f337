"""The per-step machinery of the hook: what one bucket's step needs (Step: the group, the step, the stats and
the collectives, with gradcomp's errors), the order of collectives started from callbacks (Sequencer), and
the CUDA read-backs that raise and count without a host-device sync (DecodeChecks, DeviceCounts)."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from .schemes import PlainBucket, ring_allreduce_bytes, ring_crosses

STATS_KEYS = ("raw_bytes", "wire_bytes", "received_bytes", "inside_node_bytes", "node_link_bytes",
              "node_link_raw_bytes", "encode_s", "decode_s", "buckets", "compressed_buckets", "nonfinite_buckets")
STATS_LOCK = threading.Lock()  # stats are a few additions per bucket: one lock for every state will do


def empty_stats() -> dict[str, float]:
    return dict.fromkeys(STATS_KEYS, 0)


class Sequencer:
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

    def unused(self) -> bool:
        """Whether no collective took a ticket and no step was abandoned: the next step can go on with it."""
        return not self._tickets and not self._abandoned

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


class Step:
    """What a bucket needs for one step: the group, this rank, the step, its stats and collectives."""

    __slots__ = ("group", "world", "rank", "step", "record", "total", "sequencer", "stats_lock", "decode_status",
                 "device_counters", "nonfinite_on_device", "nodes", "counts_nonfinite", "times")

    def __init__(self, group, world, rank, step, record, total, sequencer, stats_lock, device_counters, nodes=None):
        self.group, self.world, self.rank, self.step, self.record, self.total = group, world, rank, step, record, total
        self.sequencer, self.stats_lock = sequencer, stats_lock
        self.decode_status = None  # CUDA: the step's device status word for the payload checks
        self.device_counters = device_counters  # CUDA: the step's non-finite bucket counts on the device
        self.nonfinite_on_device = None
        self.nodes = nodes  # the node layout and its groups (gradcomp.nodes.NodeLayout), where there is one
        self.counts_nonfinite = True
        self.times = None  # policy="time"'s trial: times(step, kind, nbytes, device) as a collective is issued,
        # which returns what its completion calls (WarmupTimings.collective_launched for the bucket's option)

    def on(self, group, world: int, rank: int) -> "Step":
        """The same step in another group (the hierarchical scheme's levels), with the same stats and sequencer;
        the bucket's own step counts its non-finite verdict. Its collectives are not timed: the trial times the
        whole group's."""
        step = Step(group, world, rank, self.step, self.record, self.total, self.sequencer, self.stats_lock,
                     self.device_counters, self.nodes)
        step.decode_status, step.counts_nonfinite = self.decode_status, False
        return step

    def add(self, key: str, value: float) -> None:
        with self.stats_lock:  # callbacks add from the collectives' threads
            self.record[key] += value
            self.total[key] += value

    def add_counts(self, counts) -> None:
        """Several (key, value) pairs under one acquisition of the lock: the hook counts each bucket at once."""
        with self.stats_lock:
            for key, value in counts:
                self.record[key] += value
                self.total[key] += value

    def add_bucket(self, nbytes: int) -> None:
        """A bucket of nbytes, counted with what plain DDP's ring allreduce of it sends: this rank's, and its node's
        across its link (once per ring step: the node's last rank sends to the next node's first)."""
        ring = ring_allreduce_bytes(nbytes, self.world)
        across = ring if self.nodes is not None and self.nodes.nodes > 1 else 0
        self.add_counts((("buckets", 1), ("raw_bytes", ring), ("node_link_raw_bytes", across)))

    def add_ring_bytes(self, nbytes: int) -> None:
        """What this rank sends and receives in a ring allreduce of nbytes (and its node across its link)."""
        ring = ring_allreduce_bytes(nbytes, self.world)
        counts = [("wire_bytes", ring), ("received_bytes", ring)]
        if self.nodes is not None:
            crosses = ring_crosses(self.rank, self.world, self.nodes)
            counts += [("inside_node_bytes", 0 if crosses else ring),
                       ("node_link_bytes", ring if self.nodes.nodes > 1 else 0)]
        self.add_counts(counts)

    def plan_counts(self, plan) -> tuple:
        """What a step of a plan's scheme adds to the stats: the bytes this rank sends and receives, and its node's
        across its link (every rank of the node counts what they all send: the same figure on each); a compressed
        plan counts its bucket as compressed. Fixed for a plan at one world size, rank and node layout."""
        sent, received = plan.traffic(self.world, self.rank)
        counts = [("wire_bytes", sent), ("received_bytes", received)]
        if self.nodes is not None:
            first = self.nodes.node * self.nodes.node_size
            counts += [("inside_node_bytes", sent - plan.traffic_across(self.world, self.rank, self.nodes)),
                       ("node_link_bytes", sum(plan.traffic_across(self.world, r, self.nodes)
                                               for r in range(first, first + self.nodes.node_size)))]
        if not isinstance(plan, PlainBucket):
            counts.append(("compressed_buckets", 1))
        return tuple(counts)

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        completed = self._timed("allreduce", tensor)
        return self._explained(dist.all_reduce(tensor, group=self.group, async_op=True).get_future(), "allreduce",
                               completed)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.futures.Future:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        completed = self._timed("all-gather", tensor)
        return self._explained(gather(out.view(-1), tensor, group=self.group, async_op=True).get_future(), "all-gather",
                               completed)

    def reduce_scatter_now(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        """A reduce-scatter, waited for here: on NCCL the current stream waits for it, not the host; on gloo (whose
        reduce-scatter has no future) the host does."""
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        try:
            scatter(out, tensor, group=self.group, async_op=True).wait()
        except Exception as error:
            raise self._failure("reduce-scatter", error) from error

    def all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, out_splits, in_splits) -> torch.futures.Future:
        completed = self._timed("all-to-all", tensor)
        work = dist.all_to_all_single(out.view(-1), tensor, out_splits, in_splits, group=self.group, async_op=True)
        return self._explained(work.get_future(), "all-to-all", completed)

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

    def _timed(self, kind: str, tensor: torch.Tensor):
        """What a timed collective's completion calls (None where this step's collectives are not timed)."""
        if self.times is None:
            return None
        return self.times(self.step, kind, tensor.numel() * tensor.element_size(), tensor.device)

    def _explained(self, future: torch.futures.Future, what: str, completed=None) -> torch.futures.Future:
        """The collective's result, or its error with what gradcomp was doing when it failed; completed(), where
        given, is called as it completes."""

        def check(done):
            if completed is not None:
                completed()
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


class DecodeChecks:
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
        if not self._words and not self._copies:  # the CPU's, and a CUDA step without compressed buckets
            return
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


class DeviceCounts:
    """CUDA: the non-finite buckets counted on the device (no host sync in the hook). The current step's
    counters are folded into one running total per device at the end of each step; stats() reads them."""

    __slots__ = ("current", "last", "total")

    def __init__(self):
        self.current: list = []  # the counters of the step in progress, appended by Step
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


