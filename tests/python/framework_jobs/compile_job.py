"""torch.compile and gradcomp on 2 CPU ranks (torchrun --nproc-per-node 2 compile_job.py OUT_DIR MODE).

    compile_job.py OUT_DIR default          # DDP + gradcomp, eager and under torch.compile(ddp) (optimize_ddp's
                                            # default), from one start on the same data: both weights to OUT_DIR
    compile_job.py OUT_DIR python_reducer   # DDP built under optimize_ddp="python_reducer" (compiled autograd):
                                            # register refuses it; the hook registered by hand refuses its call
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import gradcomp
from common import end_process_group, save_weights

SPEC, STEPS = "topk:ratio=0.1", 6


def make_ddp() -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.parallel.DistributedDataParallel(model)


def train(ddp, forward) -> gradcomp.CompressionState:
    state = gradcomp.register(ddp, SPEC)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 10, (16,), generator=data)
        loss = F.cross_entropy(forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return state


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if mode == "default":
        eager = make_ddp()
        eager_state = train(eager, eager)
        compiled = make_ddp()
        compiled_state = train(compiled, torch.compile(compiled))
        for name, state in (("eager", eager_state), ("compiled", compiled_state)):
            last = state.stats()["last"]
            print(f"{name}: {last['buckets']} buckets, {last['compressed_buckets']} compressed", flush=True)
        if dist.get_rank() == 0:
            save_weights(eager.module, out_dir, "eager")
            save_weights(compiled.module, out_dir, "compiled")
    else:
        torch._dynamo.config.optimize_ddp = "python_reducer"
        torch._dynamo.config.compiled_autograd = True
        ddp = make_ddp()
        try:
            gradcomp.register(ddp, SPEC)
        except ValueError as refused:
            print(f"register refused: {refused}", flush=True)
        ddp.register_comm_hook(gradcomp.CompressionState(SPEC), gradcomp.hook)
        try:
            # aot_eager: the refusal comes before any kernel is generated (inductor would only add its compile time)
            forward = torch.compile(ddp, backend="aot_eager")
            F.cross_entropy(forward(torch.randn(4, 32)), torch.zeros(4, dtype=torch.long)).backward()
        except TypeError as refused:
            print(f"hook refused: {refused}", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
