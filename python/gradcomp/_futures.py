"""Futures that fail with gradcomp's own message."""

from __future__ import annotations

import torch

_CALLBACK_PREFIX = "Got the following error when running the callback: RuntimeError: "


def value_or_raise(done: torch.futures.Future):
    """done's value; if it failed, its root error as a RuntimeError.

    torch prefixes an error with "Got the following error when running the callback" at each callback it
    passes through, and a future failed by set_exception() holds the exception as its value, which DDP
    would try to read as a tensor ("Unable to cast ... to Tensor"). Called from the last callback of a
    chain, this leaves the one prefix of that callback and gradcomp's message after it."""
    try:
        return done.wait()
    except Exception as error:  # noqa: BLE001 - re-raised with its root message
        message = str(error)
        while message.startswith(_CALLBACK_PREFIX):
            message = message[len(_CALLBACK_PREFIX):]
        raise RuntimeError(message) from None
