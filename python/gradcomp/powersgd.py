"""PowerSGD (Vogels et al. 2019): rank-r approximation of each gradient matrix by one power step.

For a gradient tensor viewed as a matrix G (rows = shape[0]) and error-feedback residual E:
    M = G + E                      (E fp32)
    P = M Q / W                    -> allreduce (sum) P
    P = orthogonalize(P)           (torch.ops.gradcomp.orthogonalize_, Gram-Schmidt)
    Q = M^T P / W                  -> allreduce (sum) Q; Q stays for the next step (warm start)
    out = P Q^T,   E = M - out
Dividing by the world size W before each sum, as plain DDP does, keeps the sums within range.
A column of Q that is zero or not finite is drawn anew before it is used (redraw_dead_columns).
What travels per matrix: P (rows x r) and Q (cols x r) in fp32. Tensors that are 1-D, or whose
compression rate rows*cols / ((rows + cols) * r) is below min_compression_rate, travel whole.
M Q and M^T P go through ATen (BLAS / cuBLAS). P Q^T, which every rank computes from the same sums,
goes through torch.ops.gradcomp.low_rank_product, whose CPU bits do not depend on the thread count
(a BLAS product's do, and the ranks would apply different averages). With batch_same_shape, the
matrices of one bucket that share a shape go through one batched product and one batched
orthogonalization.
"""

from __future__ import annotations

import torch

from .codecs import Codec, _check_range, _check_seed, _register


@_register("powersgd", {"rank": 2, "min_compression_rate": 2.0, "warm_start": True, "batch_same_shape": False,
                       "seed": 0, "error_feedback": True},
           "P (m x r) and Q (n x r) fp32 per matrix, small and 1-D tensors whole; allreduce x2")
class PowerSGD(Codec):
    collective = "allreduce"

    def __init__(self, rank: int = 2, min_compression_rate: float = 2.0, warm_start: bool = True,
                 batch_same_shape: bool = False, seed: int = 0, error_feedback: bool = True):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd: rank={rank!r} must be an integer >= 1")
        _check_range("powersgd", "min_compression_rate", min_compression_rate, 0, float("inf"))
        for flag, value in (("warm_start", warm_start), ("batch_same_shape", batch_same_shape)):
            if not isinstance(value, bool):
                raise ValueError(f"powersgd: {flag} must be True or False, got {value!r}")
        super().__init__(error_feedback, rank=rank, min_compression_rate=float(min_compression_rate),
                         warm_start=warm_start, batch_same_shape=batch_same_shape, seed=seed)
        self.rank, self.min_compression_rate, self.warm_start = rank, float(min_compression_rate), warm_start
        self.batch_same_shape = batch_same_shape
        self.seed = _check_seed(self.name, seed)

    @staticmethod
    def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        rows = shape[0] if len(shape) else 1
        numel = 1
        for s in shape:
            numel *= s
        return rows, numel // rows if rows else 0

    def effective_rank(self, shape) -> int:
        rows, cols = self.matrix_shape(shape)
        return min(self.rank, rows, cols)

    def compresses(self, shape) -> bool:
        """Whether a tensor of this shape travels as P and Q rather than whole."""
        if len(shape) < 2:
            return False
        rows, cols = self.matrix_shape(shape)
        r = self.effective_rank(shape)
        return r > 0 and rows * cols >= self.min_compression_rate * (rows + cols) * r

    def payload_nbytes(self, shape, dtype: torch.dtype = torch.float32) -> int:
        """Bytes this tensor puts on the wire in one step (P and Q, or the whole tensor)."""
        if not self.compresses(shape):
            rows, cols = self.matrix_shape(shape)
            return rows * cols * torch.empty((), dtype=dtype).element_size()
        rows, cols = self.matrix_shape(shape)
        return (rows + cols) * self.effective_rank(shape) * 4

    def initial_q(self, shape, *, bucket: int = 0, index: int = 0, step: int = 0, device=None) -> torch.Tensor:
        """The starting Q (cols x r): N(0, 1), identical on every rank for the same (seed, bucket, index, step).

        Drawn by the generator of `device` (the CPU's by default): on a GPU no host copy is needed, and
        every rank draws the same numbers as long as all ranks use the same kind of device."""
        rows, cols = self.matrix_shape(shape)
        key = (self.seed * 1_000_003 + bucket * 10_007 + index + step * 998_244_353) % 2**63
        generator = torch.Generator(device=device if device is not None else "cpu").manual_seed(key)
        return torch.randn(cols, self.effective_rank(shape), generator=generator, device=generator.device)

    def redrawn_q(self, numel: int, *, bucket: int, step: int, device=None) -> torch.Tensor:
        """N(0, 1) values, the same on every rank for (seed, bucket, step), for the columns of Q that must be
        drawn anew (see PowerSGDBucket.redraw_dead_columns)."""
        key = (self.seed * 1_000_003 + bucket * 10_007 + step * 998_244_353 + 0x9E3779B9) % 2**63
        generator = torch.Generator(device=device if device is not None else "cpu").manual_seed(key)
        return torch.randn(numel, generator=generator, device=generator.device)

    def compute_p(self, grad: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor):
        """Returns (M, P): M = grad + residual as an fp32 matrix (held in residual when given)."""
        rows, cols = self.matrix_shape(grad.shape)
        if residual is not None:
            if residual.dtype != torch.float32 or residual.numel() != grad.numel():
                raise ValueError(f"powersgd: the residual must be float32 with {grad.numel()} elements, "
                                 f"got {residual.dtype} with {residual.numel()}")
            m = residual.view(rows, cols)
            m.add_(grad.reshape(rows, cols))
        else:
            m = grad.reshape(rows, cols).float()
        return m, m @ q

    @staticmethod
    def orthogonalize(p: torch.Tensor) -> torch.Tensor:
        """Orthonormalizes P's columns in place (after P's allreduce; [rows, r] or [batch, rows, r]); returns p."""
        torch.ops.gradcomp.orthogonalize_(p, 0.0)
        return p

    def compute_q(self, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Q = M^T P (P orthogonalized), written into q: it stays there for the next step's warm start.
        Matrices or batches of them."""
        return torch.matmul(m.transpose(-2, -1), p, out=q)

    def decompress(self, p: torch.Tensor, q: torch.Tensor, m: torch.Tensor, out: torch.Tensor,
                   residual: torch.Tensor | None, alpha: float = 1.0) -> torch.Tensor:
        """out = alpha * P Q^T (after Q's allreduce); the residual becomes M - out."""
        approx = torch.empty(p.shape[0], q.shape[0], device=q.device)
        torch.ops.gradcomp.low_rank_product(p, q, approx)  # the same bits on every rank, whatever its threads
        if alpha != 1.0:
            approx.mul_(alpha)
        out.copy_(approx.view(out.shape))
        if residual is not None:
            m.sub_(out.reshape(m.shape))  # what was delivered, after rounding to out's dtype
        return out

    def roundtrip(self, grad: torch.Tensor, residual: torch.Tensor | None, q: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """One step on a single process (no communication): what a world of one would compute."""
        out = torch.empty_like(grad) if out is None else out
        m, p = self.compute_p(grad, residual, q)
        self.compute_q(m, self.orthogonalize(p), q)
        return self.decompress(p, q, m, out, residual)
