"""What each rank runs in test_hierarchical.py: the hierarchical scheme on emulated nodes (node_size=), with what
each rank sent, what DDP applied, and every level's residual, per parameter."""

from __future__ import annotations

import warnings

import torch

import gradcomp
from ddp_scenarios import batch, make_model, train, wrap
from reliability_scenarios import residuals_per_parameter


def recorded(rank, world, configs, steps, node_size, poison_step=None, device="cpu", replay=None):
    """configs: {name: (model kind, spec or None for plain DDP, register's options, and DDP's bucket_cap_mb)}.
    Returns per config: per step, this rank's gradient going into the hook and the gradient DDP applied, per
    parameter; at the end, each level's residual per parameter, the stats, and the residuals right before and after
    poison_step (when given: rank 0's gradient then holds a NaN). device: where the model lives (gloo either way);
    what comes back is on the CPU. replay: per rank, per config, an earlier run's "sent": the hook is handed those
    gradients instead of this backward's."""
    out = {}
    for name, (kind, spec, options) in configs.items():
        options = dict(options)
        model = make_model(kind).to(device)
        ddp = wrap(model, **({"bucket_cap_mb": options.pop("bucket_cap_mb")} if "bucket_cap_mb" in options else {}))
        state = None
        sent: list[dict] = []
        if spec is not None:
            state = gradcomp.CompressionState(spec, model=model, **{"node_size": node_size, "start_iter": 1,
                                                                   "min_bucket_ratio": 0, **options})

            def hook(state, bucket, name=name):
                keys = [state._param_keys[id(p)] for p in bucket.parameters()]
                if replay is not None:
                    for k, g in zip(keys, bucket.gradients()):
                        g.copy_(replay[rank][name][len(sent) - 1][k])
                sent[-1].update({k: g.detach().cpu().clone() for k, g in zip(keys, bucket.gradients())})
                return gradcomp.hook(state, bucket)

            ddp.register_comm_hook(state, hook)
        if poison_step is not None and rank == 0:
            first = next(model.parameters())
            first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan"))
                                if len(sent) - 1 == poison_step else g)
        applied, around_poison = [], {}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                sent.append({})
                if state is not None and step in (poison_step, (poison_step or 0) + 1):
                    around_poison[step] = residuals_per_parameter(state)
                x, y = batch(step, 0, rank)
                torch.nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
                applied.append([p.grad.detach().cpu().clone() for p in model.parameters()])
                optimizer.step()
                optimizer.zero_grad()
        count = len(list(model.parameters()))
        residual, owner = residuals_per_parameter(state) if state is not None else ({}, {})
        out[name] = {"sent": [[s.get(k) for k in range(count)] for s in sent], "applied": applied,
                     "residual": [residual.get(k) for k in range(count)], "owner": [owner.get(k) for k in range(count)],
                     "stats": state.stats() if state is not None else None, "around_poison": around_poison,
                     "poisoned_bucket": [] if state is None else
                     next((list(p.keys) for p in state._plans.values() if 0 in p.keys), []),
                     "warnings": [str(w.message) for w in caught]}
    return out


def refusals(rank, world, cases):
    """cases: {name: register's options}; each trains 2 steps. Returns per case the error text or None, the warnings,
    and the schemes its buckets took."""
    out = {}
    for name, options in cases.items():
        model = make_model()
        ddp = wrap(model)
        error, state = None, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                state = gradcomp.register(ddp, **{"spec": "topk", **options})
                train(ddp, torch.optim.SGD(model.parameters(), lr=0.1), 3, rank)
            except (RuntimeError, ValueError) as failure:
                error = str(failure)
        out[name] = {"error": error, "warnings": [str(w.message) for w in caught],
                     "schemes": state.stats()["schemes"] if state is not None else None}
    return out
