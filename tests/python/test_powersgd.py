"""PowerSGD: the power step against a plain-torch reference, error feedback, lossless full rank."""

import pytest
import torch

import gradcomp


def reference_gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt in float64, column by column, written with plain torch ops; a column
    that (nearly) lies in the span of the earlier ones becomes zero."""
    q = p.double().clone()
    original = q.norm(dim=0)
    for i in range(q.shape[1]):
        norm = q[:, i].norm()
        q[:, i] = q[:, i] / norm if norm > original[i] / 65536 else 0
        q[:, i + 1:] -= torch.outer(q[:, i], q[:, i] @ q[:, i + 1:])
    return q.float()


def reference_step(grad, residual, q):
    """One PowerSGD step on one process: returns (decoded, new residual, new q)."""
    m = grad.reshape(grad.shape[0], -1).float() + residual.reshape(grad.shape[0], -1)
    p = reference_gram_schmidt(m @ q)
    new_q = m.t() @ p
    decoded = p @ new_q.t()
    return decoded.reshape(grad.shape), (m - decoded).reshape(-1), new_q


@pytest.mark.parametrize("shape, rank", [((64, 48), 4), ((32, 8, 3, 3), 2), ((20, 30), 1)])
def test_step_matches_reference(shape, rank):
    torch.manual_seed(0)
    codec = gradcomp.codec("powersgd", rank=rank)
    grad = torch.randn(shape)
    residual = torch.randn(grad.numel()) * 0.1
    q = codec.initial_q(shape)
    expected, expected_residual, expected_q = reference_step(grad, residual.clone(), q.clone())
    out = codec.roundtrip(grad, residual, q)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(residual, expected_residual, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(q, expected_q, rtol=1e-4, atol=1e-4)


def test_error_feedback_invariant():
    codec = gradcomp.codec("powersgd:rank=2")
    grad = torch.randn(50, 40)
    old = torch.randn(2000) * 0.3
    residual = old.clone()
    out = codec.roundtrip(grad, residual, codec.initial_q(grad.shape))
    torch.testing.assert_close(grad.reshape(-1) + old, out.reshape(-1) + residual, rtol=0, atol=1e-5)


def test_full_rank_is_lossless():
    codec = gradcomp.codec("powersgd:rank=16,min_compression_rate=0")
    grad = torch.randn(16, 40)
    out = codec.roundtrip(grad, None, codec.initial_q(grad.shape))
    torch.testing.assert_close(out, grad, rtol=1e-4, atol=1e-4)


def test_warm_start_converges_to_the_best_rank_r_approximation():
    torch.manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(60, 60))
    v, _ = torch.linalg.qr(torch.randn(40, 40))
    s = torch.tensor([10.0, 5.0] + [0.1] * 38)
    grad = (u[:, :40] * s) @ v.t()
    codec = gradcomp.codec("powersgd:rank=2")
    q = codec.initial_q(grad.shape)
    for _ in range(10):  # the same matrix each step, no error feedback: power iteration
        out = codec.roundtrip(grad, None, q)
    best = (u[:, :2] * s[:2]) @ v[:, :2].t()
    torch.testing.assert_close(out, best, rtol=1e-3, atol=1e-3)


def test_initial_q_is_shared_by_ranks_and_differs_by_tensor():
    codec = gradcomp.codec("powersgd:rank=3,seed=5")
    a = codec.initial_q((30, 20), bucket=1, index=2)
    assert torch.equal(a, codec.initial_q((30, 20), bucket=1, index=2))
    assert not torch.equal(a, codec.initial_q((30, 20), bucket=1, index=3))
    assert a.shape == (20, 3)


def test_which_tensors_are_compressed():
    codec = gradcomp.codec("powersgd:rank=4")
    assert codec.compresses((256, 128))
    assert not codec.compresses((256,))
    assert not codec.compresses((4, 4))  # 16 elements vs 32 for P and Q
    assert codec.effective_rank((3, 100)) == 3


def test_half_precision_gradients():
    codec = gradcomp.codec("powersgd:rank=2")
    grad = torch.randn(30, 20).half()
    residual = torch.zeros(600)
    out = codec.roundtrip(grad, residual, codec.initial_q(grad.shape))
    assert out.dtype == torch.float16
    torch.testing.assert_close(grad.float().reshape(-1), out.float().reshape(-1) + residual, rtol=0, atol=1e-2)
    with pytest.raises(ValueError, match="residual must be float32"):
        codec.roundtrip(grad, torch.zeros(600, dtype=torch.float16), codec.initial_q(grad.shape))


def test_low_rank_product_is_p_q_transposed_with_the_same_bits_whatever_the_threads():
    """PowerSGD's decode: every rank computes P Q^T from the same sums and must apply the same bits, also when
    its thread count differs (a BLAS product's bits follow its threads, which MKL lowers on a busy machine)."""
    p, q = torch.randn(3, 700, 4), torch.randn(3, 500, 4)  # enough rows for several tasks
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = torch.empty(3, 700, 500)
            torch.ops.gradcomp.low_rank_product(p, q, out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], other) for other in outs[1:])
    expected = torch.einsum("brk,bck->brc", p.double(), q.double()).float()
    torch.testing.assert_close(outs[0], expected, rtol=1e-5, atol=1e-5)
    matrix = torch.empty(700, 500)
    torch.ops.gradcomp.low_rank_product(p[1], q[1], matrix)
    assert torch.equal(matrix, outs[0][1])
    for args, message in (((p.double(), q.double(), out.double()), "takes float32"),
                          ((p, q[:, :, :3].contiguous(), out), r"cannot fill out"),
                          ((p[0], q, out), "matrices or batches of them, alike"),
                          ((p.transpose(1, 2), q, out), "needs contiguous tensors, not p")):
        with pytest.raises(ValueError, match=message):
            torch.ops.gradcomp.low_rank_product(*args)


def test_orthogonalize_matches_reference_and_zeroes_dependent_columns():
    p = torch.randn(100, 5)
    expected = reference_gram_schmidt(p)
    torch.ops.gradcomp.orthogonalize_(p, 0.0)
    torch.testing.assert_close(p, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p.t() @ p, torch.eye(5), rtol=0, atol=1e-5)
    dependent = torch.randn(10, 1).repeat(1, 2)
    torch.ops.gradcomp.orthogonalize_(dependent, 1e-4)
    assert torch.all(dependent[:, 1] == 0)
    rank_two = torch.randn(30, 2) @ torch.randn(2, 4)  # columns 2 and 3 depend on 0 and 1
    torch.ops.gradcomp.orthogonalize_(rank_two, 0.0)
    assert torch.all(rank_two[:, 2:] == 0)
    torch.testing.assert_close(rank_two[:, :2].t() @ rank_two[:, :2], torch.eye(2), rtol=0, atol=1e-5)
    batched = torch.randn(3, 20, 4)
    expected = torch.stack([reference_gram_schmidt(m) for m in batched])
    torch.ops.gradcomp.orthogonalize_(batched, 0.0)
    torch.testing.assert_close(batched, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="takes float32"):
        torch.ops.gradcomp.orthogonalize_(torch.randn(4, 2).double(), 0.0)
