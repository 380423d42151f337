"""What each rank runs in the two-phase scheme's tests (test_two_phase.py). See ddp_harness.run_ranks."""

from __future__ import annotations

import warnings

import torch

import gradcomp
from ddp_scenarios import gradients, make_model, train, wrap


def _tensors(state, index):
    plan = state._plans.get(index)
    return {} if plan is None else {k: t.cpu().clone() for k, t in plan.tensors().items() if t is not None}


def recorded_steps(rank, world, configs, steps, device="cpu"):
    """configs: {name: (model kind, spec or None for plain DDP, register kwargs)}; device "cuda": every rank
    on cuda:0 (over gloo), with what is returned copied to the CPU. Per name: the gradients
    after every step, and per compressed step and bucket what this rank put in and got out: the bucket's
    gradient, the plan's tensors (residual, owner_residual) before and after, the averaged output, the
    plan's scheme."""
    results = {}
    for name, (kind, spec, kwargs) in configs.items():
        model = make_model(kind).to(device)
        ddp = wrap(model, **({"device_ids": [0]} if device == "cuda" else {}))
        state = None
        records = []
        if spec is not None:
            state = gradcomp.CompressionState(spec, model=model, **kwargs)

            def recording_hook(state, bucket, records=records):
                step, index, grad = state.iter, bucket.index(), bucket.buffer().detach().to("cpu", copy=True)
                before = _tensors(state, index)
                future = gradcomp.hook(state, bucket)
                if step < state.start_iter:  # warm-up: plain allreduce
                    return future

                def record(done):
                    out = done.value()
                    out = out[0] if isinstance(out, list) else out
                    plan = state._plans.get(index)
                    records.append({"step": step, "bucket": index, "grad": grad,
                                    "out": out.detach().to("cpu", copy=True),
                                    "before": before, "after": _tensors(state, index),
                                    "scheme": None if plan is None else plan.scheme})
                    return out

                return future.then(record)

            ddp.register_comm_hook(state, recording_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps_grads = []
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            losses = train(ddp, optimizer, steps, rank, device=device,
                           record=lambda _: steps_grads.append([g.cpu() for g in gradients(model)]))
        results[name] = {"grads": steps_grads, "records": records, "losses": losses,
                         "warnings": [str(w.message) for w in warned if "gradcomp" in str(w.message)],
                         "stats": None if state is None else state.stats(),
                         "state_schemes": None if state is None else
                         [b["scheme"] for b in state.state_dict()["buckets"]]}
    return results
