"""The DDP communication hook: any gradcomp codec on every gradient bucket, with its state.

    state = gradcomp.register(ddp_model, "topk:ratio=0.01")       # or, by hand:
    ddp_model.register_comm_hook(gradcomp.CompressionState("qsgd"), gradcomp.hook)

One bucket, one step:
    warm-up (step < start_iter) without a start codec, a bucket too small to gain, a sparse or float64
        bucket -> plain allreduce of grad / world, exactly what DDP does without a hook;
    warm-up with a start codec (say qsgd:levels=127, about 4x smaller than plain and as good under AdamW's
        first steps): the bucket under that codec, which keeps no state between steps, so nothing is
        carried over when the run's codec takes over at step start_iter;
    otherwise the bucket's plan, by its scheme (a module each in gradcomp.schemes):
    allreduce (none, fp16, bf16, randomk): encode, divide the payload's values by world, allreduce
        them, decode in place;
    allgather or two-phase (signsgd, terngrad, qsgd, topk; the state's scheme option, by default
        the one that sends fewer bytes at this world size): all-gather the payloads and decode-and-sum
        them, or send chunks to their owners, which re-encode the chunk's average for an all-gather;
    powersgd: per tensor, P then Q allreduced;
    hierarchical (where the ranks form several nodes of several ranks): a reduce-scatter inside the node, the
        codec's flat exchange of this rank's shard between nodes, an all-gather inside the node.
Everything is asynchronous: collectives return futures and the next stage runs in a callback.

Stats count the bytes this rank sends and receives under each bucket's scheme (plain allreduce as a
ring: 2(W-1)/W of the bucket), and as raw what plain DDP's ring allreduce would send, so that
raw / wire is the saving against plain DDP at this world size.

Non-finite gradients: no extra collective and no host-device sync decide them. A NaN or Inf in a
rank's gradient + residual, or one the codec's own arithmetic would make, shows in that rank's payload
(a scale, norm or value; randomk adds one flag value to its allreduce) and survives the collective, so
every rank sees the same verdict in the data it receives. Such a bucket arrives non-finite on every
rank (AMP's GradScaler skips the step everywhere), and every rank keeps the residuals and PowerSGD's Q
it had before the step: each step writes its residual and Q into a second buffer, which becomes the
state only when the bucket's data is finite (on CUDA by a device-side select).

The state and its dispatch: gradcomp.state; registration: gradcomp.registration.
"""

from .state import CompressionState  # noqa: F401  (states pickled before the split name gradcomp.hook's classes)
from .state_io import BucketLayout, PayloadBucket  # noqa: F401

COMPILED_AUTOGRAD = (
    "DDP built under torch._dynamo.config.optimize_ddp='python_reducer' (compiled autograd) calls a communication "
    "hook once per parameter with a (grad, param) tuple and ignores what it returns, so no bucket reaches gradcomp "
    "and nothing it computed would reach the gradients. torch.compile(ddp_model) with the default optimize_ddp "
    "('ddp_optimizer') works with gradcomp: build DDP without 'python_reducer' (and without compiled autograd), "
    "then register")


def gradcomp_hook(state, bucket):  # DDP checks the annotations, which this module's string annotations would fail
    """The communication hook: ddp_model.register_comm_hook(state, gradcomp.hook).

    state: a CompressionState; bucket: a torch.distributed.GradBucket; returns a Future holding the
    bucket's averaged gradient (written in place into bucket.buffer())."""
    if isinstance(bucket, tuple):  # DDP's python reducer (compiled autograd) calls per parameter
        raise TypeError(f"gradcomp's hook was called with a {type(bucket).__name__} of "
                        f"{', '.join(type(b).__name__ for b in bucket)}, not a GradBucket: {COMPILED_AUTOGRAD}")
    return state.communicate(bucket)


hook = gradcomp_hook  # DDP's logs (_get_ddp_logging_data()["comm_hook"]) name a hook by its function's name
