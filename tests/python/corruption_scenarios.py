"""What each rank runs in test_corruption.py: the silent-corruption cases (a Q that collapses, finite
gradients that overflow a codec, state that does not follow its model, a process group ignored, state
loaded unchecked) and the collectives a compressed step issues. See ddp_harness.run_ranks."""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
import torch.nn as nn

from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
import gradcomp.step
from ddp_scenarios import BUCKET_CAP_MB, batch, gradients, make_model, train, wrap
from reliability_scenarios import Branchy


def _q_per_matrix(state):
    return {key: piece["q"].clone() for plan in state._plans.values() for key, piece in plan.pieces().items()}


def _state_tensors(state):
    return {(index, name): t.clone() for index, plan in state._plans.items()
            for name, t in plan.tensors().items() if t is not None}


def collapsed_q(rank, world, spec, steps):
    """Branchy under find_unused_parameters: the odd head is unused at the first compressed step (step 2),
    so its gradient and residual are zero on every rank then. Returns the odd head's averaged gradient after
    every step, and Q after the last."""
    model = Branchy()
    ddp = wrap(model, find_unused_parameters=True)
    state = gradcomp.register(ddp, spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    odd = []
    for step in range(steps):
        x, y = batch(step, 0, rank)
        nn.functional.cross_entropy(ddp(x, step), y).backward()
        grad = model.odd.weight.grad
        odd.append(torch.zeros_like(model.odd.weight) if grad is None else grad.detach().clone())
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {"odd": odd, "q": _q_per_matrix(state)}


def nan_column_in_loaded_q(rank, world, steps):
    """Trains powersgd, saves, puts a NaN into one column of every saved Q, loads that into a fresh run and
    trains on. Returns Q after every step of the resumed run and the gradients."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, "powersgd:rank=2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(ddp, optimizer, 4, rank)
    saved = state.state_dict()
    for bucket in saved["buckets"]:
        bucket["tensors"]["q"].view(-1, 2)[:, 1] = float("nan")  # column 1 of each rank-2 Q (rows of 2 values)
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, "powersgd:rank=2")
    state.load_state_dict(saved)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    qs, grads = [], []

    def record(step):
        qs.append(_q_per_matrix(state))
        grads.append(gradients(model))

    train(ddp, optimizer, steps, rank, first_step=4, record=record)
    return {"q": qs, "grads": grads}


def large_finite_gradients(rank, world, case, steps):
    """Gradients that are finite but at the edge of their dtype: case is (spec, model dtype, {(layer, index):
    value per rank}) set into the middle layer's weight gradient every step. Returns per step the averaged
    gradients and the state's tensors, and the stats."""
    spec, dtype, values = case
    model = make_model().to(dtype)
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec)

    def inject(grad):
        grad = grad.clone()
        for index, per_rank in values.items():
            grad[index] = per_rank[rank]
        return grad

    model[2].weight.register_hook(inject)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the same batch statistics every step
    averaged, held = [], []

    def record(step):
        averaged.append(gradients(model))
        held.append(_state_tensors(state))

    train(ddp, optimizer, steps, rank, dtype=dtype, record=record)
    return {"averaged": averaged, "held": held, "stats": state.stats()["total"]}


def pickled_state(rank, world, spec, split, total, phase, path, how="by hand"):
    """torch's documented pattern: pickle the hook's state with the model and optimizer, and register the
    unpickled state on a fresh DDP model. phase "full": the uninterrupted run's parameters after every step,
    and the pickle after `split` steps (written to path); "same process": the continuation registered in
    this process on a fresh model; "spawned": the continuation in fresh processes, from path. how: the
    unpickled state is registered "by hand" (ddp.register_comm_hook(state, gradcomp.hook)) or with
    gradcomp.register(ddp, state). spec: a codec spec, or (spec, register's options)."""
    spec, options = (spec, {}) if isinstance(spec, str) else spec
    params = []
    if phase in ("full", "same process"):
        model = make_model()
        ddp = wrap(model)
        state = gradcomp.register(ddp, spec, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(ddp, optimizer, split, rank)
        blob = pickle.dumps({"comm_hook_state": state, "model": model.state_dict(),
                             "optimizer": optimizer.state_dict()})
        if phase == "full":
            train(ddp, optimizer, total - split, rank, first_step=split,
                  record=lambda _: params.append([p.detach().clone() for p in model.parameters()]))
            with open(f"{path}.rank{rank}", "wb") as f:
                f.write(blob)
            return params
        del ddp, state, optimizer
    else:
        with open(f"{path}.rank{rank}", "rb") as f:
            blob = f.read()
    saved = pickle.loads(blob)
    model = make_model()
    model.load_state_dict(saved["model"])
    ddp = wrap(model)
    if how == "by hand":
        ddp.register_comm_hook(saved["comm_hook_state"], gradcomp.hook)
    else:
        gradcomp.register(ddp, saved["comm_hook_state"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    train(ddp, optimizer, total - split, rank, first_step=split,
          record=lambda _: params.append([p.detach().clone() for p in model.parameters()]))
    return params


def subgroup(rank, world, specs, steps):
    """Ranks 0 and 1 train DDP on a subgroup of the two of them; the last rank trains nothing. Per spec
    (None: plain DDP): the averaged gradients of every step, or the error."""
    group = dist.new_group([0, 1])
    out = {}
    for spec in specs:
        if rank >= 2:
            continue
        model = make_model()
        ddp = wrap(model, process_group=group)
        if spec is not None:
            gradcomp.register(ddp, spec, start_iter=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        train(ddp, optimizer, steps, rank, record=lambda _: grads.append(gradients(model)))
        out[spec] = grads
    dist.barrier()
    return out


def tampered_checkpoints(rank, world, spec, tamperings):
    """Trains a few steps, saves, and loads each tampered copy into a fresh state of the same model, both
    after registering (the state knows its model) and before (it learns it at register). Returns the error
    text of each (None: loaded)."""
    model = make_model()
    ddp = wrap(model)
    state = gradcomp.register(ddp, spec)
    train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 4, rank)
    errors = {}
    for name, tamper in tamperings.items():
        for when in ("after register", "before register"):
            saved = state.state_dict()
            tamper(saved)
            fresh = make_model()
            try:
                if when == "after register":
                    gradcomp.register(wrap(fresh), spec).load_state_dict(saved)
                else:
                    loaded = gradcomp.CompressionState(spec)
                    loaded.load_state_dict(saved)
                    gradcomp.register(wrap(fresh), loaded)
                errors[name, when] = None
            except ValueError as error:
                errors[name, when] = str(error)
    return errors


def counted_collectives(rank, world, specs, steps):
    """Per spec: the collectives each compressed step issued (by name) and its compressed buckets."""
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
             "broadcast", "barrier", "reduce", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor",
             "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv")
    counts = {}
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name, original):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    out = {}
    try:
        for spec in specs:
            model = make_model()
            ddp = wrap(model)
            state = gradcomp.register(ddp, spec)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            per_step = []

            def record(step, state=state):
                per_step.append({"collectives": dict(counts), "compressed": state.stats()["last"]["compressed_buckets"],
                                 "buckets": state.stats()["last"]["buckets"]})
                counts.clear()

            counts.clear()
            train(ddp, optimizer, steps, rank, record=record)
            out[spec] = per_step
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return out


def no_host_sync(rank, world, specs, steps):
    """World size 1 on NCCL, one GPU: per spec, DDP steps whose backward (every bucket's hook and its
    callbacks) runs under torch.cuda.set_sync_debug_mode("error"), which raises at any host-device sync.
    A spec may end with " two-phase" (that scheme). Returns per spec the error text, or None, and the stats."""
    group = dist.new_group([0], backend="nccl")
    device = torch.device("cuda", 0)
    out = {}
    for spec in specs:
        model = make_model().to(device)
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=BUCKET_CAP_MB, process_group=group)
        codec_spec, _, scheme = spec.partition(" ")
        state = gradcomp.register(ddp, codec_spec, start_iter=1, scheme=scheme or "auto")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        error = None
        for step in range(steps):
            x, y = batch(step, 0, rank)
            loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
            try:
                torch.cuda.set_sync_debug_mode("error" if step >= 1 else "default")
                loss.backward()
            except RuntimeError as failure:
                error = f"step {step}: {failure}"
                break
            finally:
                torch.cuda.set_sync_debug_mode("default")
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        out[spec] = {"error": error, "stats": state.stats()["total"]}
    return out


__all__ = ["no_host_sync", "collapsed_q", "nan_column_in_loaded_q", "large_finite_gradients", "pickled_state",
           "subgroup", "tampered_checkpoints", "counted_collectives"]


def pickled_elsewhere(rank, world, path, mapping):
    """A pickled state registered on another rank or world size. Phase 1 (mapping None): 2 ranks train signsgd
    (the allgather scheme at 2 ranks) and pickle their states to path.rank{r}. Else this rank registers the
    state pickled by rank mapping[rank] and trains: returns the error, or None."""
    if mapping is None:
        model = make_model()
        ddp = wrap(model)
        state = gradcomp.register(ddp, "signsgd")
        train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 4, rank)
        with open(f"{path}.rank{rank}", "wb") as f:
            pickle.dump(state, f)
        return None
    with open(f"{path}.rank{mapping[rank]}", "rb") as f:
        state = pickle.load(f)
    model = make_model()
    ddp = wrap(model)
    gradcomp.register(ddp, state)
    try:
        train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 2, rank, first_step=4)
    except RuntimeError as error:
        return str(error)
    return None


def owner_fails(rank, world, failing_owner, steps):
    """Two-phase signsgd on `world` ranks; at the last step the all-to-all delivers a payload whose header was
    corrupted in flight to failing_owner, whose re-encode then fails. Returns this rank's error text."""
    model = make_model()
    ddp = wrap(model)
    gradcomp.register(ddp, "signsgd", scheme="two-phase", start_iter=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train(ddp, optimizer, steps - 1, rank)
    step_class = gradcomp.step.Step
    original = step_class.all_to_all

    def corrupting(self, out, tensor, out_splits, in_splits):
        future = original(self, out, tensor, out_splits, in_splits)
        return future.then(lambda done: (out.view(-1)[:4].zero_(), done.value())[1])

    if rank == failing_owner:
        step_class.all_to_all = corrupting
    try:
        train(ddp, optimizer, 1, rank, first_step=steps - 1)
    except RuntimeError as error:
        return str(error)
    finally:
        step_class.all_to_all = original
    return None
