"""CompressionState: everything the hook keeps between steps, and what it does with each bucket.

State lives per bucket (keyed by bucket.index()) and per parameter inside it, so when DDP lays its
buckets out anew (its rebuild after the first step, or a fresh process resuming a checkpoint)
residuals and Q follow their parameters; a bucket made of whole saved buckets is processed as
those saved buckets, so a resumed run repeats the uninterrupted one bit for bit. Checkpoints and
pickling: gradcomp.state_io; the per-step machinery: gradcomp.step; how a bucket goes: gradcomp.hook.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import statistics
import time
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from ._futures import value_or_raise
from ._tensors import views_of
from . import measure
from . import nodes as node_layout
from . import policy as time_policy
from . import trial as policy_trial
from .codecs import codec as make_codec
from .powersgd import PowerSGD
from .schemes import PLANS, HierarchicalBucket, PlainBucket, PowerSGDBucket, check_scheme, fixed_scheme, make_plan, \
    plan_class, ring_allreduce_bytes
from .state_io import BucketLayout, StateCheckpoints
from .step import STATS_LOCK, DecodeChecks, DeviceCounts, Sequencer, Step, collective_failure, empty_stats

logger = logging.getLogger("gradcomp")


def _show_logs() -> None:
    """log_every asks for lines: where no logging is set up (no handler on the "gradcomp" logger or above it), they
    go to stderr at INFO, rather than nowhere. A program that sets up logging itself keeps its own."""
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)


class CompressionState(StateCheckpoints):
    """Everything the hook keeps between steps: the codec, the step, per-bucket residuals and Q.

    Pickles (and state_dict()s) without its process group and its model. Parameters are keyed by
    their position in the model, resolved when the state meets its model (gradcomp.register, or the
    first step of a hook registered by hand), so a pickled or checkpointed state applies to a fresh
    copy of the model. Residuals belong to one rank: every rank saves and loads its own.
    """

    __slots__ = ("process_group", "codec", "scheme", "start_iter", "start_codec", "min_bucket_ratio", "log_every",
                 "node_size", "iter", "_plans", "_start_plans", "_warmup_layout", "_pool", "_param_keys", "_model",
                 "_ddp", "_nodes", "_verified", "_total", "_last", "_current", "_warned", "_sequencer", "_checks",
                 "_device_counts", "policy", "remeasure_every", "trial_steps", "_decision", "_timings", "elastic",
                 "_plan_counts", "_shape")

    def __init__(self, spec: str = "topk", *, process_group: dist.ProcessGroup | None = None, scheme: str = "auto",
                 start_iter: int | None = None, start_codec: str | None = None, min_bucket_ratio: float = 1.0,
                 log_every: int = 0, node_size: int | None = None, policy: str = "codec", remeasure_every: int = 0,
                 trial_steps: int | None = None, elastic: bool = False, model: torch.nn.Module | None = None,
                 **codec_params: Any):
        if start_iter is None:  # one warm-up step's window scatters; policy="time" takes the median of several
            start_iter = time_policy.WARMUP_STEPS if policy == "time" else 2
        for name, value in (("start_iter", start_iter), ("log_every", log_every), ("remeasure_every", remeasure_every)):
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
        if log_every:
            _show_logs()
        self.node_size = node_layout.check_node_size(node_size)
        self.policy = time_policy.check_policy(policy, start_iter, start_codec, self.min_bucket_ratio)
        if remeasure_every and policy != "time":
            raise ValueError(f"gradcomp: remeasure_every={remeasure_every} re-takes the decision of policy='time'; "
                             f"this state has policy={policy!r}")
        self.remeasure_every = remeasure_every
        default_trial = policy_trial.DEFAULT_STEPS if policy == "time" else 0
        self.trial_steps = policy_trial.check_trial_steps(default_trial if trial_steps is None else trial_steps,
                                                          policy)
        if not isinstance(elastic, bool):
            raise ValueError(f"gradcomp: elastic={elastic!r} must be True or False")
        self.elastic = elastic  # load_state_dict spreads an every-rank state of another world size (gradcomp.elastic)
        self._decision: dict | None = None  # policy="time": the choice per bucket, and what it was predicted from
        self.iter = 0
        self._plans: dict[int, Any] = {}  # bucket index -> its plan, an instance of one of schemes.PLANS
        self._start_plans: dict[int, Any] = {}  # the same under the start codec, for steps < start_iter
        # The buckets as DDP laid them out (once final) in the steps before start_iter: the run's codec starts on
        # them, so that a run resumed at start_iter, whose fresh DDP starts with other buckets, does as well.
        self._warmup_layout: dict[int, BucketLayout] = {}
        self._pool: dict[int, dict[str, torch.Tensor]] = {}  # per-parameter state waiting for its new bucket
        self._verified = False
        self._total, self._last, self._current = empty_stats(), empty_stats(), empty_stats()
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
        self._sequencer = Sequencer()
        self._checks = DecodeChecks()
        self._device_counts = DeviceCounts()
        self._timings = measure.WarmupTimings()
        self._plan_counts = weakref.WeakKeyDictionary()  # plan -> (world, rank, nodes, what its step adds to stats)
        self._shape = None  # (group, world size, rank): _group_shape

    # -- configuration ---------------------------------------------------------------------------------------------

    @property
    def spec(self) -> str:
        return self.codec.spec()

    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _group_shape(self) -> tuple:
        """(group, its world size, this rank in it), asked of torch.distributed once per group: the hook needs them
        for every bucket."""
        group = self._group()
        if self._shape is None or self._shape[0] is not group:
            self._shape = (group, dist.get_world_size(group), dist.get_rank(group))
        return self._shape

    def config(self) -> dict[str, Any]:
        """What every rank must agree on (compared at the first step) and what a checkpoint must match."""
        world = dist.get_world_size(self._group()) if dist.is_initialized() else None
        scheme = self.scheme if self.scheme in ("hierarchical", "flat") else fixed_scheme(self.codec) or self.scheme
        return {"codec": self.spec, "scheme": scheme, "start_iter": self.start_iter,
                "start_codec": None if self.start_codec is None else self.start_codec.spec(),
                "min_bucket_ratio": self.min_bucket_ratio, "node_size": self.node_size, "policy": self.policy,
                "world_size": world, "wire_format": _ops._C.format_version}

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

    def _meet_model(self, params: list) -> tuple:
        """The keys of a bucket's parameters (params), after binding to the registered DDP model (and taking its
        process group unless one was given) when the state has not met one, or when params are another model's (the
        state moved to a new one)."""
        bound = self._model is not None and self._model() is not None
        keys = tuple(map(self._param_keys.get, map(id, params))) if bound else (None,)
        if None not in keys:
            if self._ddp is None:  # built with model=: its DDP's options matter too (find_unused_parameters)
                ddp = self._find_ddp()
                self._ddp = weakref.ref(ddp) if ddp is not None else _no_ddp
            return keys
        ddp = self._find_ddp()
        if ddp is None:
            raise RuntimeError("gradcomp: this CompressionState does not know the model it is registered on; "
                               "register it with gradcomp.register(ddp_model, state) (or build it with "
                               "CompressionState(spec, model=ddp_model.module))")
        if self.process_group is None:
            self.process_group = ddp.process_group
        self.bind(ddp.module, ddp)
        return tuple(self._param_keys[id(p)] for p in params)

    def _verify(self) -> None:
        """All ranks compare their configuration and step, and the rank and world size their residuals were built
        on (a pickled state registered elsewhere): a mismatch raises on every rank, no hang."""
        mine = json.dumps({**self.config(), "step": self.iter, "remeasure_every": self.remeasure_every,
                           "trial_steps": self.trial_steps}, sort_keys=True)
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
        entered, launch_seconds, marked = time.perf_counter(), None, None
        try:
            keys = self._meet_model(bucket.parameters())
            if not self._verified:
                self._verify()
            self._checks.poll(self.iter)
            group, world, rank = self._group_shape()
            step = Step(group, world, rank, self.iter, self._current, self._total, self._sequencer, STATS_LOCK,
                        self._device_counts.current, self._nodes)
            buffer = bucket.buffer()
            step.add_bucket(buffer.numel() * buffer.element_size())
            starting, compressible = self.iter < self.start_iter, self._compressible(buffer)
            timed = starting and compressible and self._layout_is_final() and self.policy == "time"
            if starting and compressible and self._layout_is_final():
                self._record_layout(bucket, keys, buffer)
            if timed:
                self._timings.bucket_called(self.iter, bucket.index(), buffer.device)
                marked = self.iter
            if self._current["buckets"] == 1 and self.policy == "time" and not starting:
                self._follow_trial(step, buffer)
            trial_option = self._timed_in_trial(step, bucket, buffer) if compressible and not starting else None
            marked = self.iter if trial_option is not None else marked
            launching = time.perf_counter()
            if not compressible:
                future = self._plain(step, buffer)
            elif starting and self.start_codec is None:
                completed = self._timings.allreduce_launched(self.iter) if timed else None
                launched = time.perf_counter()
                future = self._plain_as_recorded(step, bucket, keys, buffer)
                launch_seconds = time.perf_counter() - launched
                if completed is not None:
                    future = future.then(lambda done: (completed(), done.value())[1])
            elif starting:
                self._warn_if_resumed_on_other_buckets(known=self.iter >= 2 and bool(self._start_plans))
                future = self._compressed(step, bucket, keys, buffer, self._start_plans, self._new_start_plan)
            else:
                if not self._plans:
                    self._warn_if_resumed_on_other_buckets(known=bool(self._warmup_layout))
                    if self.policy == "time" and self._decision is None:
                        self._decide(step, buffer, list(self._warmup_layout.values()))
                    self._first_plans(step, buffer)
                elif self._remeasures_now(step) and not self._trial_running():
                    self._decide(step, buffer, list(self._plans.values()))
                    self._replace_changed_plans(step, buffer.device)
                future = self._compressed(step, bucket, keys, buffer, self._plans, self._new_plan)
            if trial_option not in (None, PlainBucket.scheme) and buffer.device.type == "cpu":
                self._timings.plan_launched(trial_option, bucket.index(), time.perf_counter() - launching)
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
        if timed and launch_seconds is not None and buffer.device.type == "cpu":
            self._timings.hook_called(time.perf_counter() - entered - launch_seconds)
        if marked is not None:  # the step's, though the last bucket's call has ended it
            self._timings.bucket_returned(marked, bucket.index())
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

    def _record_layout(self, bucket: dist.GradBucket, keys: tuple, buffer: torch.Tensor) -> None:
        for old in _overlapping(self._warmup_layout, bucket.index(), keys):
            del self._warmup_layout[old]
        self._warmup_layout[bucket.index()] = BucketLayout(bucket.index(), keys,
                                                           tuple(g.shape for g in bucket.gradients()), buffer.dtype)

    def _first_plans(self, step: Step, buffer: torch.Tensor) -> None:
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
    def _plain(step: Step, tensor: torch.Tensor) -> torch.futures.Future:
        step.add_ring_bytes(tensor.numel() * tensor.element_size())
        tensor.div_(step.world)
        return step.allreduce(tensor).then(lambda done: value_or_raise(done)[0])

    def _compressed(self, step: Step, bucket: dist.GradBucket, keys: tuple, buffer: torch.Tensor, plans: dict,
                    new_plan) -> torch.futures.Future:
        """The bucket under the codec of `plans` (the run's, or the start codec's): by its plan; as the saved plans
        that together make it up (a bucket made of whole earlier or saved buckets, such as a fresh DDP's first one,
        goes as those, so a resumed run repeats the uninterrupted one); else by new_plan's."""
        plan = plans.get(bucket.index())
        if plan is not None and plan.keys == keys:
            return self._launch(step, plan, buffer)
        views = bucket.gradients()
        saved = self._saved_buckets_covering(plans, keys, views, buffer.dtype)
        if saved:
            return self._launch_saved(step, saved, dict(zip(keys, views)), buffer)
        plan = new_plan(step, bucket.index(), keys, [v.shape for v in views], buffer.dtype, buffer.device)
        return self._launch(step, plan, buffer, views)

    def _launch(self, step: Step, plan, flat: torch.Tensor, views=None) -> torch.futures.Future:
        """The bucket (flat) by its plan. views: its parameters' gradients as views of flat, or None: then made
        here, only where used (PowerSGD's plans, find_unused_parameters' counts): the hook's time is the step's."""
        if self.policy == "codec" and not self._gains(step, plan, flat):
            return self._plain(step, flat)
        if plan.device is not None and plan.device != flat.device:  # a loaded checkpoint, kept on the CPU
            plan.to(flat.device)
        plain = isinstance(plan, PlainBucket)
        if plain:
            plan.release_if_spent()
        step.add_counts(self._counts_of(step, plan))
        if not plain:
            step.decode_status = self._checks.word(step.step, flat.device)
        ddp = self._ddp_model()
        counting = ddp is not None and ddp.find_unused_parameters and not (plain and plan.residual is None)
        if views is None and (counting or isinstance(plan, PowerSGDBucket)):
            views = views_of(flat, plan.shapes)
        if not counting:
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

    def _counts_of(self, step: Step, plan) -> tuple:
        """step.plan_counts(plan), worked out once per plan, world size, rank and node layout: the hook asks for every
        bucket of every step, where the time it takes is the step's."""
        known = self._plan_counts.get(plan)
        if known is None or known[:2] != (step.world, step.rank) or known[2] is not step.nodes:
            known = self._plan_counts[plan] = (step.world, step.rank, step.nodes, step.plan_counts(plan))
        return known[3]

    @staticmethod
    def _nonzero_counts(step: Step, views) -> torch.Tensor:
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

    def _plain_as_recorded(self, step: Step, bucket: dist.GradBucket, keys: tuple,
                           buffer: torch.Tensor) -> torch.futures.Future:
        """A plain step. On a fresh DDP's first buckets (a run resumed during the first steps) as the buckets DDP
        laid out for good before, when the state recorded them: a ring allreduce sums in an order that follows the
        tensor's size, so this repeats the uninterrupted run's sums bit for bit at any world size."""
        if self._warmup_layout and not self._layout_is_final():
            views = bucket.gradients()
            parts = self._saved_buckets_covering(self._warmup_layout, keys, views, buffer.dtype)
            if parts:
                return self._in_parts(parts, dict(zip(keys, views)), buffer,
                                      lambda part, flat, views: self._plain(step, flat))
        return self._plain(step, buffer)

    def _launch_saved(self, step: Step, plans, views_by_key, buffer: torch.Tensor) -> torch.futures.Future:
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
            flat_views = views_of(flat, [v.shape for v in views])
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

    def _gains(self, step: Step, plan, flat: torch.Tensor) -> bool:
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

    def _new_plan(self, step: Step, index: int, keys, shapes, dtype: torch.dtype, device: torch.device):
        """A bucket laid out anew: the old state of its parameters moves over, nothing is misapplied."""
        for old in _overlapping(self._plans, index, keys):
            self._retire(self._plans.pop(old))
        plan = self._make_plan(self.codec, step, index, keys, shapes, dtype, device)
        plan.take(self._pool)
        self._plans[index] = plan
        return plan

    def _new_start_plan(self, step: Step, index: int, keys, shapes, dtype: torch.dtype, device: torch.device):
        """A bucket laid out anew during the start steps: the start codec keeps no state, so the plans it replaces
        are dropped."""
        for old in _overlapping(self._start_plans, index, keys):
            del self._start_plans[old]
        plan = self._make_plan(self.start_codec, step, index, keys, shapes, dtype, device)
        self._start_plans[index] = plan
        return plan

    def _make_plan(self, codec, step: Step, index: int, keys, shapes, dtype: torch.dtype, device: torch.device):
        numel = sum(torch.Size(s).numel() for s in shapes)
        grouped = self._nodes if self._nodes is not None and self._nodes.inside is not None else None
        if self.policy == "time" and codec is self.codec:
            plan_type = PLANS[self._chosen_scheme(index, keys)]
        else:
            plan_type = plan_class(codec, self.scheme, numel, dtype, step.world, grouped)
        return make_plan(plan_type, codec, index, keys, shapes, dtype, device, world=step.world, rank=step.rank,
                         node_size=None if grouped is None else grouped.node_size)

    # -- policy="time" ----------------------------------------------------------------------------------------------

    def _decide(self, step: Step, buffer: torch.Tensor, layouts) -> None:
        """Measures (every rank, the same collectives in the same order), combines the measurements by one allreduce
        and takes the decision for the buckets laid out as `layouts` (plans or BucketLayouts), the same on every rank
        (gradcomp.policy)."""
        layouts = sorted(layouts, key=lambda layout: layout.index)
        buckets = [{"index": b.index, "shapes": b.shapes, "dtype": b.dtype} for b in layouts]
        two_levels = self._nodes is not None and self._nodes.inside is not None
        options = time_policy.candidates(self.codec, self.scheme, two_levels)
        needed = measure.needed_links(options, self.codec)
        groups = {"world": step.group, **({"inside": self._nodes.inside, "across": self._nodes.across}
                                          if two_levels else {})}
        largest = max((sum(torch.Size(s).numel() for s in b["shapes"]) * b["dtype"].itemsize for b in buckets),
                      default=0)
        clock = measure.Clock(buffer.device)
        self._timings.step_started(self.iter, buffer.device)  # the end of the last plain step
        clock.sync()  # on a GPU, the warm-up's events are read now: the decision's one wait for the device
        plain_steps = list(self._timings.step_seconds().values())
        plain_step = statistics.median(plain_steps) if plain_steps else \
            ((self._decision or {}).get("trial") or {}).get("plain_step_s")  # re-measured: as the warm-up showed
        if self._decision is None:
            links = measure.measure_links(needed, groups, largest, buffer.device, clock)
            paced = self._timings.ready_offsets([b["index"] for b in buckets])
            ready, plain_calls = paced if paced is not None else (None, [0.0] * len(buckets))
            by_step, computes = self._timings.plain_windows(), self._timings.computes()
            windows = [(by_step.get(s), computes.get(s)) for s in range(1, self.start_iter)]  # alike on every rank
        else:  # re-measured: the links and kernels anew, the backward's pace and plain's window as the warm-up showed
            links = measure.measure_links(needed, groups, largest, buffer.device, clock)
            saved = {b["index"]: b["ready_s"] for b in self._decision["buckets"]}
            ready = [saved[b["index"]] for b in buckets] if all(b["index"] in saved for b in buckets) and \
                self._decision["overlap_measured"] else None
            calls = {b["index"]: b["predicted_s"][PlainBucket.scheme][0] for b in self._decision["buckets"]}
            plain_calls = [calls.get(b["index"], 0.0) for b in buckets]
            windows = None
        node_size = self._nodes.node_size if two_levels else None
        dry_runs = self._time_plans(step, buffer, buckets, [o for o in options if o != "plain"], clock)
        # plain's encode: its own calls' time in the warm-up (its division and launch, on backward's thread)
        measured = [{**per_option, PlainBucket.scheme: (seconds, 0.0, 0.0)}
                    for per_option, seconds in zip(dry_runs, plain_calls)]
        hook = self._timings.hook_seconds() if self._decision is None else \
            time_policy.saved_hook_seconds(self._decision)  # re-measured: as the warm-up showed
        model, ready, measured, window, skew = measure.combine(
            time_policy.CostModel(links, {"hook": time_policy.Line(hook, 0.0)}), ready, len(buckets), step.group,
            buffer.device, measured, windows)
        if self._decision is not None:
            window, skew = self._decision.get("plain_window_s"), self._decision.get("backward_skew_s")
        self._decision = time_policy.decide(model, ready, buckets, self.codec, self.scheme, step.world, node_size,
                                            self.iter, measured, window, skew)
        plain_step = policy_trial.max_over_ranks(plain_step, step.group, buffer.device)
        self._decision["trial"] = policy_trial.plan(self._decision, self.trial_steps, plain_step)
        self._timings = measure.WarmupTimings()
        if self._trial_running():  # the trial's first step is this one: its switch, which the verdict looks for
            self._timings.step_started(self.iter, buffer.device)
        logger.info("%s", time_policy.explain(self._decision, self.spec))

    @property
    def deciding(self) -> bool:
        """policy='time': True until its decision stands (before it is taken, and during its trial)."""
        return self.policy == "time" and (self._decision is None or self._trial_running())

    def _trial_running(self) -> bool:
        trial = (self._decision or {}).get("trial")
        return trial is not None and trial["chosen"] is None

    def _follow_trial(self, step: Step, buffer: torch.Tensor) -> None:
        """policy='time''s trial (gradcomp.trial), at the first bucket of each step while it runs: the step's candidate
        sends every bucket; at the first step after it, the verdict, the same on every rank."""
        if not self._trial_running():
            return
        trial = self._decision["trial"]
        self._timings.step_started(self.iter, buffer.device)
        name = policy_trial.candidate_at(trial, self.iter)
        if name is None:
            measure.Clock(buffer.device).sync()  # on a GPU, the trial's events are read now: one wait per verdict
            trial = policy_trial.verdict(trial, self._timings.step_seconds(), step.group, buffer.device, self.iter)
            self._decision["trial"] = trial
            name = trial["chosen"] or policy_trial.candidate_at(trial, self.iter)  # a close call: one more round
            if trial["chosen"] is not None:
                self._decision["in_step"] = self._in_step(step, buffer.device)
                self._timings = measure.WarmupTimings()
        for bucket, choice in zip(self._decision["buckets"], trial["choices"][name]):
            bucket["choice"] = choice
        self._replace_changed_plans(step, buffer.device)
        if trial["chosen"] is not None:
            logger.info("%s", time_policy.explain(self._decision, self.spec))

    def _timed_in_trial(self, step: Step, bucket: dist.GradBucket, buffer: torch.Tensor) -> str | None:
        """In a counted step of policy='time''s trial, a bucket's option, with its hook call marked (the plain
        window) and its collectives timed (step.times); the caller times its plan's launch: _in_step's loads. None
        elsewhere."""
        if self.policy != "time" or not self._trial_running() or \
                not policy_trial.counted(self._decision["trial"], self.iter):
            return None
        option = next((b["choice"] for b in self._decision["buckets"] if b["index"] == bucket.index()),
                      PlainBucket.scheme)
        step.times = functools.partial(self._timings.collective_launched, option)
        self._timings.bucket_called(self.iter, bucket.index(), buffer.device)
        return option

    def _in_step(self, step: Step, device: torch.device) -> dict:
        """The decision's predictions at the loads that the trial's own steps showed: the compressed options' by
        their collectives, option by option and kind by kind, and by their plans' launches, bucket by bucket (on the
        CPU); plain's by the window of the steps that sent every bucket plain (the least over the ranks: the last rank
        through backward waits least for the others). The same on every rank."""
        mine = self._timings.trial_loads(time_policy.world_links(self._decision), self._decision)
        compressed = [o for o in self._decision["options"] if o != PlainBucket.scheme]  # plain: its window, below
        buckets = len(self._decision["buckets"])
        names = [(option, kind) for option in compressed for kind in time_policy.KINDS] + \
            [(option, "encode", at) for option in compressed for at in range(buckets)]
        least = measure.least_over_ranks(measure.flat_loads(mine), names, step.group, device)
        loads = measure.nested_loads(least, buckets)
        trial = self._decision["trial"]
        plain = policy_trial.all_plain(trial)
        plain_steps = [s for s in range(trial["start"], trial["start"] + policy_trial.length(trial))
                       if policy_trial.counted(trial, s) and policy_trial.candidate_at(trial, s) == plain]
        window = measure.last_ranks_window(self._timings.trial_windows(plain_steps), plain_steps, step.group, device)
        return time_policy.in_step(self._decision, loads, window)

    def _time_plans(self, step: Step, buffer: torch.Tensor, buckets: list[dict], options: list[str], clock) -> list:
        """Per bucket, {option: (encode, middle, decode) seconds} of a scratch plan of that scheme launched on this step's
        gradient (tiled to the bucket's size) with local collectives: the codec's kernels and all the hook does
        around them, on this device and dtype. Buckets timed as the same shapes are timed once."""
        two_levels = self._nodes is not None and self._nodes.inside is not None
        def timed_shapes(bucket):
            """The shapes a bucket is timed as: its own for powersgd; else one vector padded to a multiple of the world
            size, so that the chunks are all alike (each rank's dry run decodes its own chunk as every rank's)."""
            if isinstance(self.codec, PowerSGD):
                return tuple(map(tuple, bucket["shapes"]))
            numel = sum(torch.Size(s).numel() for s in bucket["shapes"])
            return ((-(-numel // step.world) * step.world,),)

        timed: dict = {}
        for bucket in buckets:
            shapes = timed_shapes(bucket)
            key = (shapes, bucket["dtype"])
            if key in timed:
                continue
            timed[key] = {}
            for option in options:
                plan_type = HierarchicalBucket if option == "hierarchical" else PLANS[option]
                plan = make_plan(plan_type, self.codec, bucket["index"], range(len(shapes)), shapes, bucket["dtype"],
                                 buffer.device, world=step.world, rank=step.rank,
                                 node_size=self._nodes.node_size if two_levels else None)
                timed[key][option] = measure.time_plan(plan, buffer, step.world, step.rank, self._nodes, clock)
        clock.sync()
        seconds = {key: {o: measure.plan_seconds(runs, clock) for o, runs in per_option.items()}
                   for key, per_option in timed.items()}
        return [seconds[(timed_shapes(b), b["dtype"])] for b in buckets]

    def _chosen_scheme(self, index: int, keys) -> str:
        """The scheme the decision chose for bucket index; plain for a bucket it did not see (DDP laid its buckets
        out otherwise since: plain is never slower than plain DDP)."""
        for bucket in (self._decision or {}).get("buckets", []):
            if bucket["index"] == index:
                return bucket["choice"]
        self._warn_once("undecided", f"gradcomp: bucket {index} (parameters {list(keys)[:4]}...) was laid out after "
                        f"policy='time' decided: it goes plain (set remeasure_every to decide again)")
        return PlainBucket.scheme

    def _remeasures_now(self, step: Step) -> bool:
        """Whether policy='time' re-takes its decision now: at the first compressible bucket of a step every
        remeasure_every (the decision then bears this step, so no later bucket of it does; the first bucket may be one
        that cannot be compressed, sparse or of another dtype, whose branch never asks)."""
        return (self.remeasure_every > 0 and self._decision is not None and self.iter > self._decision["step"]
                and (self.iter - self.start_iter) % self.remeasure_every == 0)

    def _replace_changed_plans(self, step: Step, device: torch.device) -> None:
        """Each plan whose bucket the decision now sends otherwise, replaced by one of the chosen scheme over the same
        parameters, which takes over their state (through the pool). Now, not at the bucket's next call: a fresh
        DDP's first bucket (a resumed run's) goes as the saved plans that make it up, and needs every one of them."""
        chosen = {b["index"]: b["choice"] for b in self._decision["buckets"]}
        for index, plan in list(self._plans.items()):
            if chosen.get(index, PlainBucket.scheme) != plan.scheme:
                self._new_plan(step, index, plan.keys, plan.shapes, plan.dtype, device)

    def _retire(self, plan) -> None:
        """A plan whose bucket is laid out or sent anew: its state waits, per parameter, for the plan that takes it
        over (every scheme's pieces hold all that its error feedback held back, in a flat scheme's units)."""
        self._pool.update(plan.pieces())

    def explain(self) -> str:
        """policy='time': per bucket its size, each option's predicted time and the choice, and the predicted
        communication per step of each fixed option and of the policy (a table; stats()["decision"] holds it)."""
        if self.policy != "time":
            return f"gradcomp {self.spec}: policy={self.policy!r} sends every bucket under the codec (no decision)"
        return time_policy.explain(self._decision, self.spec)

    def _end_step(self) -> None:
        self.iter += 1
        if self.iter >= self.start_iter:
            self._start_plans.clear()
        if not self._sequencer.unused():
            self._sequencer = Sequencer()
        self._device_counts.end_step()
        self._last, self._current = self._current, empty_stats()
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
        hierarchical scheme too); encode and decode seconds; buckets, compressed buckets and non-finite buckets;
        "decision": policy="time"'s decision (explain() prints it), else None."""

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
        return {"step": self.iter, "world_size": world, "schemes": schemes, "decision": self._decision,
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


def _describe(stats: dict[str, Any]) -> str:
    return (f"{stats['wire_bytes'] / 1e6:.2f} MB on the wire for {stats['raw_bytes'] / 1e6:.2f} MB "
            f"({stats['ratio']:.1f}x), encode {stats['encode_s']:.3f}s, decode {stats['decode_s']:.3f}s")


