"""A CompressionState's checkpoints and pickles: state_dict / load_state_dict (with the checks that refuse a
state saved for another configuration, rank or model), and what pickling keeps and drops."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _ops
from ._tensors import check_tensor
from . import elastic
from .checkpoint import STATE_FORMAT, every_rank_world_size, is_every_rank, this_ranks_entry
from .schemes import GATHERED, PLANS, AllgatherBucket, AllreduceBucket, HierarchicalBucket, PlainBucket, \
    PowerSGDBucket, fixed_scheme, make_plan
from .step import empty_stats


def _saved_dtype(name) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in _ops.DTYPE_IDS:
        raise ValueError(f"gradcomp: the state names dtype {name!r}; valid: "
                         f"{', '.join(str(d).removeprefix('torch.') for d in _ops.DTYPE_IDS)}")
    return dtype


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




class StateCheckpoints:
    """CompressionState's checkpoint and pickling methods (a mixin: the attributes are the state's)."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of this rank's state: config, step, per-bucket residuals and Q, stats; during a start codec's
        steps, its buckets' layout; policy="time"'s decision."""
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
            "decision": copy.deepcopy(self._decision),  # policy="time": a resumed run sends each bucket as this one
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what state_dict() saved, after checking it was saved for this configuration and rank; from
        what every_rank(state).state_dict() saved, this rank's entry."""
        rank = dist.get_rank(self._group()) if dist.is_initialized() else None
        if is_every_rank(state):  # its entries can be told apart only on the world size that saved them
            world = self.config()["world_size"]
            if self.elastic and world is not None and every_rank_world_size(state) != world:
                first = this_ranks_entry(state, 0)
                if isinstance(first, dict) and isinstance(first.get("config"), dict):  # else refused as not a state
                    self._refuse_other_configuration({"scheme": self._scheme_before_schemes(), "policy": "codec",
                                                      **first["config"], "world_size": world})
                state = elastic.spread(self, state, world, rank)
            else:
                self._refuse_other_configuration({**self.config(), "world_size": every_rank_world_size(state)})
                state = this_ranks_entry(state, rank)
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else None
            raise ValueError(f"gradcomp: not a gradcomp state (format {STATE_FORMAT}); got "
                             f"{type(state).__name__} with format {found}")
        saved_config = {"scheme": self._scheme_before_schemes(), "policy": "codec", **state["config"]}
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
        self._decision = copy.deepcopy(state.get("decision"))
        for plan in plans.values():
            if isinstance(plan, PowerSGDBucket):
                plan.redraw_dead_columns(self.iter)
        self._total = {**empty_stats(), **state["total"]}
        self._last, self._current = empty_stats(), empty_stats()
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
            hint = ("; residuals belong to the ranks that built them: a run on another number of ranks loads "
                    "every rank's state (gradcomp.every_rank(state)) with elastic=True, which gives each new rank "
                    "the saved residuals' average (gradcomp.elastic), or starts from a fresh CompressionState (the "
                    "residuals are dropped, training goes on)" if "world_size" in differing else "")
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

    def _saved_plan_type(self, scheme, codec) -> type:
        """The plan class of a saved bucket's scheme, refused where codec does not travel by it."""
        fixed = fixed_scheme(codec)
        allowed = ([fixed] if fixed else [plan.scheme for plan in GATHERED]) + [HierarchicalBucket.scheme]
        if self.policy == "time" and codec is self.codec:
            allowed.append(PlainBucket.scheme)
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
                                "_device_counts", "_timings", "_plan_counts", "_shape")}

    def __setstate__(self, state):
        self.process_group = None
        self.start_codec, self._start_plans = None, {}  # states pickled before start codecs have neither
        self.node_size = None  # nor before nodes
        self.policy, self.remeasure_every, self._decision = "codec", 0, None  # nor before policy="time"
        self.trial_steps = 0  # nor before its trial
        self.elastic = False  # nor before elastic resumes
        self._warmup_layout = {}  # nor before the buckets' layout was kept during the first steps
        self._unbind()  # parameters are matched anew when the state meets its model
        for name, value in state.items():
            setattr(self, name, value)
        self._verified = False  # the ranks it meets compare their configurations, and where its residuals came from
        if "scheme" not in state:  # pickled before there were schemes to choose from
            self.scheme = "auto" if fixed_scheme(self.codec) else AllgatherBucket.scheme


