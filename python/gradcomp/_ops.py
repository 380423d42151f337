"""Loads the native extension (which registers torch.ops.gradcomp.*) and the ops' fake kernels."""

import torch

from . import _C

DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@torch.library.register_fake("gradcomp::encode")
def _encode_fake(grad, residual, codec, param0=0, param1=0, seed=0, step=0, bucket=0, rank=0):
    numel = grad.numel()
    if isinstance(numel, int) and grad.dtype in DTYPE_IDS:
        nbytes = _C.payload_nbytes(codec, DTYPE_IDS[grad.dtype], numel, param0, param1)
    else:  # symbolic shapes: the size is a function of numel that the fake cannot evaluate
        nbytes = torch.library.get_ctx().new_dynamic_size()
    return grad.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("gradcomp::decode_sum")
def _decode_sum_fake(payloads, out, alpha=1.0, vote=False, codec=None, param0=0, param1=0, status=None):
    return None


@torch.library.register_fake("gradcomp::encode_chunks")
def _encode_chunks_fake(grad, residual, codec, param0s, param1=0, seed=0, step=0, bucket=0, first_rank=0):
    numel, count = grad.numel(), len(param0s)
    if isinstance(numel, int) and grad.dtype in DTYPE_IDS:
        base, extra = divmod(numel, count)
        nbytes = sum(_C.payload_nbytes(codec, DTYPE_IDS[grad.dtype], base + (j < extra), p0, param1)
                     for j, p0 in enumerate(param0s))
    else:
        nbytes = torch.library.get_ctx().new_dynamic_size()
    return grad.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("gradcomp::reencode_sum")
def _reencode_sum_fake(payloads, average, residual, alpha, vote, codec, param0=0, param1=0, seed=0, step=0,
                       bucket=0, rank=0, status=None):
    return _encode_fake(average, residual, codec, param0, param1)


@torch.library.register_fake("gradcomp::decode_chunks")
def _decode_chunks_fake(rows, out, vote, codec, param0s, param1=0, status=None):
    return None


@torch.library.register_fake("gradcomp::orthogonalize_")
def _orthogonalize_fake(matrix, eps=0.0):
    return None


@torch.library.register_fake("gradcomp::low_rank_product")
def _low_rank_product_fake(p, q, out):
    return None
