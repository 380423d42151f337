"""Runs a function on N local ranks (gloo, CPU) in fresh processes and returns what each rank returned.

    results = run_ranks(scenario, world=2, args=(...,), timeout=120)

The scenario runs as scenario(rank, world, *args) inside an initialized gloo process group; its
return value (tensors allowed) comes back through torch.save. An exception in a rank comes back
as RankError text. If the ranks do not all finish within `timeout`, they are killed and
TimeoutError is raised: a hang is a test failure, never a stuck test run.

The ranks are forked from a server process that has imported torch and gradcomp once (multiprocessing's
forkserver): importing torch costs a process about 2.5 s of CPU, and the suite starts hundreds of ranks.
Nothing of the test process is inherited: a rank holds what the server imported (with the environment of the
first run_ranks) and takes the test's environment before the scenario runs; a module that reads the environment
at import would see the server's, so pass such values as arguments. Where CUDA is available the ranks are
spawned instead (a process that has touched CUDA must not fork).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import traceback

import torch


class RankError:
    def __init__(self, kind: str, message: str, text: str):
        self.kind, self.message, self.text = kind, message, text

    def __repr__(self):
        return f"RankError({self.kind}: {self.message})\n{self.text}"


PRELOADED = ["torch", "torch.distributed", "gradcomp"]


def _context():
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts: at the first run_ranks
    return context


def _rank_main(scenario, rank, world, args, workdir, pg_timeout_s, environment):
    import torch.distributed as dist

    os.environ.clear()  # the server's environment is the one it started with: take the test's, as spawn would
    os.environ.update(environment)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = scenario(rank, world, *args)
    except BaseException as error:  # noqa: BLE001 - reported to the test
        result = RankError(type(error).__name__, str(error), traceback.format_exc())
    torch.save(result, f"{workdir}/result.{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(scenario, world: int = 2, args: tuple = (), timeout: float = 240, pg_timeout_s: float = 60,
              wait_for: list[int] | None = None):
    """wait_for: the ranks whose results are awaited (default: all). The others (a rank a fault test
    kills or stalls) are killed once those have finished, and their result is None."""
    context = _context()
    awaited = list(range(world)) if wait_for is None else list(wait_for)
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as workdir:
        processes = [context.Process(target=_rank_main,
                                     args=(scenario, rank, world, args, workdir, pg_timeout_s, environment))
                     for rank in range(world)]
        for process in processes:
            process.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for rank in awaited:
            processes[rank].join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [rank for rank in awaited if processes[rank].is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world} did not finish within {timeout}s")
        results = []
        for rank in range(world):
            path = f"{workdir}/result.{rank}.pt"
            if not os.path.exists(path):
                if rank not in awaited:
                    results.append(None)
                    continue
                raise RuntimeError(f"rank {rank} died (exit code {processes[rank].exitcode}) without a result")
            results.append(torch.load(path, weights_only=False))
        return results


def unwrap(results):
    """The ranks' results, raising if any rank failed."""
    failed = [r for r in results if isinstance(r, RankError)]
    if failed:
        raise AssertionError("a rank failed:\n" + "\n".join(map(repr, failed)))
    return results
