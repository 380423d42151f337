"""gradcomp under Lightning, Fabric, Accelerate and Hugging Face Trainer, each on 2 CPU ranks launched as its
users launch it: a run stopped halfway and resumed from the framework's own checkpoint ends with the weights of
the uninterrupted run, bit for bit (the jobs are in framework_jobs/); and torch.compile of a DDP model, whose
compiled-autograd mode gradcomp refuses. CI installs the frameworks, and
tools/test.sh sets GRADCOMP_REQUIRE_OPTIONAL=1, so that there these tests fail rather than skip when one
is missing (conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import gradcomp

JOBS = os.path.join(os.path.dirname(__file__), "framework_jobs")
CODECS = ["topk", "powersgd", "qsgd"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _launch(launcher: list[str], job: str, out_dir, phase: str, codecs: list[str], expect_ok: bool = True) -> str:
    command = [*launcher, job, str(out_dir), phase, *codecs]
    done = subprocess.run(command, cwd=JOBS, capture_output=True, text=True, timeout=420,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    log = done.stdout + done.stderr
    if expect_ok:
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{log[-6000:]}"
    return log


def _refusals(out_dir, phase: str, world: int, cases: int) -> list[list[str]]:
    """Per rank, the outcome of each of the cases that trainer_job.py's refused() ran in that phase, in order."""
    paths = [out_dir / f"refusals-{phase}-rank{rank}.txt" for rank in range(world)]
    assert all(p.exists() for p in paths), f"ranks without a refusals file: {[str(p) for p in paths if not p.exists()]}"
    outcomes = [p.read_text().splitlines() for p in paths]
    assert all(len(lines) == cases for lines in outcomes), outcomes
    return outcomes


def _assert_resumed_equals_straight(out_dir, codecs):
    for codec in codecs:
        straight, resumed, half = (torch.load(os.path.join(out_dir, f"{codec}-{name}.pt"))
                                   for name in ("straight", "resumed", "half"))
        assert not all(torch.equal(straight[k], half[k]) for k in straight), f"{codec}: the epochs 3-4 did nothing"
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), (
                f"{codec}: {name} after resuming differs from 4 uninterrupted epochs by "
                f"{(straight[name] - resumed[name]).abs().max().item():.3g}")


@pytest.mark.needs("lightning")
def test_lightning_resumes_from_model_checkpoint_bit_for_bit(tmp_path):
    python = [sys.executable]  # Lightning starts rank 1 itself
    _launch(python, "lightning_job.py", tmp_path, "first", CODECS)
    _launch(python, "lightning_job.py", tmp_path, "resume", CODECS)
    _assert_resumed_equals_straight(tmp_path, CODECS)

    # ModelCheckpoint wrote rank 0's file; it holds both ranks' states, each with its own residuals.
    checkpoint = torch.load(tmp_path / "topk-ckpt" / "last.ckpt", weights_only=True)
    saved = checkpoint["callbacks"]["GradcompCallback"]
    assert saved["world_size"] == 2 and [entry["rank"] for entry in saved["ranks"]] == [0, 1]
    # The stats reach Lightning's logger.
    with open(tmp_path / "topk-straight" / "version_0" / "metrics.csv") as f:
        header, *rows = f.read().splitlines()
    assert "gradcomp/ratio" in header.split(",") and rows

    # Another codec refuses the checkpoint, naming both.
    log = _launch(python, "lightning_job.py", tmp_path, "mismatch", ["topk"], expect_ok=False)
    assert "the state was saved for another configuration (codec: saved 'topk" in log


@pytest.mark.needs("lightning")
def test_fabric_trains_with_gradcomp_and_resumes_bit_for_bit(tmp_path):
    _launch([sys.executable], "fabric_job.py", tmp_path, "first", CODECS)
    _launch([sys.executable], "fabric_job.py", tmp_path, "resume", CODECS)
    _assert_resumed_equals_straight(tmp_path, CODECS)


@pytest.mark.needs("accelerate")
def test_accelerate_resumes_from_save_state_bit_for_bit(tmp_path):
    _launch(TORCHRUN, "accelerate_job.py", tmp_path, "first", CODECS)
    _launch(TORCHRUN, "accelerate_job.py", tmp_path, "resume", CODECS)
    _assert_resumed_equals_straight(tmp_path, CODECS)


@pytest.mark.needs("transformers")
def test_hugging_face_trainer_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """A tiny GPT-2 under Trainer: 12 steps straight, and 6 then resume_from_checkpoint, end alike for topk (with
    gradient accumulation), powersgd and signsgd. Checkpoints every 3 steps, 2 kept: Trainer's rotation deletes
    folders that hold gradcomp's files."""
    codecs = ["topk", "powersgd", "signsgd"]
    _launch(TORCHRUN, "trainer_job.py", tmp_path, "first", codecs)
    assert sorted(p.name for p in (tmp_path / "topk-straight").iterdir()) == ["checkpoint-12", "checkpoint-9"]
    assert {"gradcomp_state_rank0.pt", "gradcomp_state_rank1.pt"} <= {
        p.name for p in (tmp_path / "topk-half" / "checkpoint-6").iterdir()}
    _launch(TORCHRUN, "trainer_job.py", tmp_path, "resume", codecs)
    _assert_resumed_equals_straight(tmp_path, codecs)

    # Another codec refuses the checkpoint (found by resume_from_checkpoint=True), naming both. Without gradcomp's
    # files the resume is refused, unless asked for; then the residuals start empty and the run no longer repeats
    # the uninterrupted one (what the files carried mattered). Every rank raises each refusal.
    _launch(TORCHRUN, "trainer_job.py", tmp_path, "refusals", ["topk"])
    for mismatch, missing in _refusals(tmp_path, "refusals", 2, cases=2):
        assert mismatch.startswith("refused: ") and "the state was saved for another configuration (codec: saved " \
            "'topk" in mismatch and "now 'signsgd" in mismatch, mismatch
        assert missing.startswith("refused: ") and "checkpoint-6 holds no gradcomp state" in missing and \
            "missing_state='fresh'" in missing, missing
    assert not any(p.name.startswith("gradcomp_state") for p in (tmp_path / "topk-half" / "checkpoint-6").iterdir())
    straight, fresh = (torch.load(tmp_path / f"topk-{name}.pt") for name in ("straight", "fresh"))
    assert not all(torch.equal(straight[k], fresh[k]) for k in straight)

    # On 3 ranks: refused, naming the option; with elastic=True each rank takes the 2 saved ranks' average and trains.
    _launch([*TORCHRUN[:-1], "3"], "trainer_job.py", tmp_path, "elsewhere", ["signsgd"])
    for (other_world,) in _refusals(tmp_path, "elsewhere", 3, cases=1):
        assert other_world.startswith("refused: ") and "world_size: saved 2, now 3" in other_world and \
            "elastic=True" in other_world, other_world
    assert (tmp_path / "signsgd-elastic" / "checkpoint-12" / "gradcomp_state_rank2.pt").exists()

    log = _launch([sys.executable], "trainer_job.py", tmp_path, "single", ["topk"], expect_ok=False)
    assert "this Trainer's model is a GPT2LMHeadModel on 1 process(es)" in log and "torchrun" in log


@pytest.mark.needs("lightning")
def test_the_lightning_callback_refuses_a_single_process_and_other_strategies():
    import lightning as L
    from lightning.pytorch.strategies import SingleDeviceStrategy

    callback = gradcomp.lightning.GradcompCallback("topk")
    with pytest.raises(ValueError, match="runs a single process .*devices=N, strategy='ddp'"):
        L.Trainer(accelerator="cpu", devices=1, callbacks=[callback], logger=False, enable_progress_bar=False,
                  enable_checkpointing=False, enable_model_summary=False).fit(_tiny_module())
    not_ddp = types.SimpleNamespace(world_size=2, strategy=SingleDeviceStrategy(torch.device("cpu")))
    with pytest.raises(ValueError, match="works with Lightning's DDP strategy .*runs SingleDeviceStrategy"):
        callback.setup(not_ddp, None, "fit")
    with pytest.raises(ValueError, match="ratio=2"):
        gradcomp.lightning.GradcompCallback("topk", ratio=2)  # bad specs fail in the constructor


@pytest.mark.needs("accelerate")
def test_accelerate_register_refuses_a_single_process():
    from accelerate.utils import DistributedType
    single = types.SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO)
    with pytest.raises(ValueError, match="single process; launch 2 or more"):
        gradcomp.accelerate.register(single, torch.nn.Linear(2, 2), "topk")
    fsdp = types.SimpleNamespace(num_processes=2, distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match="works with Accelerate's DDP .*runs FSDP"):
        gradcomp.accelerate.register(fsdp, torch.nn.Linear(2, 2), "topk")


def _tiny_module():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)

    return Tiny()



def test_torch_compile_of_ddp_trains_with_gradcomp_as_eager_does(tmp_path):
    """torch.compile(ddp) under optimize_ddp's default: the hook compresses every bucket, and 6 steps of topk end
    with the eager run's weights, bit for bit."""
    log = _launch(TORCHRUN, "compile_job.py", tmp_path, "default", [])
    assert log.count("compiled: 1 buckets, 1 compressed") == 2, log[-3000:]
    eager, compiled = torch.load(tmp_path / "eager.pt"), torch.load(tmp_path / "compiled.pt")
    for name in eager:
        assert torch.equal(eager[name], compiled[name]), name


def test_compiled_autograds_python_reducer_is_refused_with_what_works():
    """DDP under optimize_ddp='python_reducer' calls hooks per parameter and drops their result: register refuses
    such a model, and a hook registered by hand refuses the call, naming the mode and what works."""
    log = _launch(TORCHRUN, "compile_job.py", "unused", "python_reducer", [])
    assert log.count("register refused: gradcomp.register: DDP built under torch._dynamo.config.optimize_ddp="
                     "'python_reducer' (compiled autograd)") == 2, log[-3000:]
    assert log.count("hook refused: gradcomp's hook was called with a tuple of Tensor, Parameter, not a "
                     "GradBucket") == 2, log[-3000:]
    assert "torch.compile(ddp_model) with the default optimize_ddp ('ddp_optimizer') works with gradcomp" in log
