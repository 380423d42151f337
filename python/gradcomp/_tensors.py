"""Small tensor helpers the bucket plans share: keeping a step's new state only when its data is finite, a
bucket's parameters as views of its flat gradient, and checking saved state against what a configuration
expects."""

from __future__ import annotations

import torch


def keep_if_finite(finite: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(state, spare): the state holds new when finite (a 0-d bool) is true, else old's values; the spare is
    old, untouched: the state before the step, which the hook puts back for a parameter no rank used.

    On the CPU the verdict is read (old's values are copied into new when it is false); on CUDA a
    device-side select writes the kept values into new, so the host never waits for the GPU."""
    if new.is_cuda:
        torch.where(finite, new, old, out=new)
    elif not bool(finite):
        new.copy_(old)
    return new, old


def views_of(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of flat, the bucket's gradients back to back (what DDP's
    bucket.gradients() gives for its buffer, made only where a plan needs them)."""
    return [part.view(shape) for part, shape in zip(flat.split([torch.Size(s).numel() for s in shapes]), shapes)]


def idle_elements(idle: torch.Tensor, shapes, numel: int) -> torch.Tensor | None:
    """A bool per element of a bucket's flat gradient (its parameters' shapes back to back): its parameter's
    entry of idle. None on the CPU when no parameter is idle (on CUDA that would take a sync to know)."""
    if not idle.is_cuda and not bool(idle.any()):
        return None
    parts = [idle[j].expand(torch.Size(shape).numel()) for j, shape in enumerate(shapes)]
    return torch.cat(parts) if parts else torch.zeros(numel, dtype=torch.bool, device=idle.device)


def check_saved_tensors(tensors, expected: dict, index: int) -> None:
    """Refuses a bucket's saved tensors unless each is the expected (shape, dtype), or None where (None, None)."""
    if not isinstance(tensors, dict) or set(tensors) - set(expected):
        found = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise ValueError(f"gradcomp: bucket {index}'s saved tensors are {found}; this configuration keeps "
                         f"{sorted(expected)}")
    for name, (shape, dtype) in expected.items():
        check_tensor(f"{name} of bucket {index}", tensors.get(name), shape, dtype)


def check_tensor(what: str, tensor, shape, dtype) -> None:
    """Refuses a saved tensor that is not the expected shape and dtype (shape None: none expected)."""
    if shape is None and tensor is None:
        return
    found = "none" if tensor is None else (f"{list(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor)
                                           else type(tensor).__name__)
    wanted = "none" if shape is None else f"{list(shape)} {dtype}"
    if found != wanted:
        raise ValueError(f"gradcomp: the saved {what} is {found}; this configuration expects {wanted}")
