# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Hugging Face accelerate's ``save_state`` / ``load_state`` with a DeepSpeed ZeRO config, as an
accelerate user runs them (examples/accelerate_resume/train.py, under ``torch.distributed.run``, on
the CPU with gloo). ZeRO-2 and ZeRO-3 train 4 steps on 2 ranks, saving the state at step 2; resumed
from it on 2 ranks (ZeRO-2) and on 1 (ZeRO-3), steps 3 and 4 have the losses, and the weights end
as, those of the uninterrupted run.

With ``"checkpoint": {"async_save": true}`` the same saves write in the background: a job that calls
``accelerator.end_training()`` (which destroys the process group) right after its last
``save_state`` exits 0 with that checkpoint complete (``latest`` names accelerate's tag
``pytorch_model``), and a job that keeps only its last checkpoint (``ProjectConfiguration(total_limit=1)``,
which deletes the previous checkpoint folder while its background save may still be writing it)
exits 0 with exactly that one folder left; each checkpoint resumes.

Before, the job that called ``end_training()`` failed in the background save ("AssertionError:
DeepSpeed backend not set"), and the one with ``total_limit=1`` failed deleting the previous folder
(``OSError: [Errno 39] Directory not empty``) or writing into it (``FileNotFoundError``).
"""

import pytest

from example_jobs import REPO, torchrun

pytest.importorskip("accelerate")

TRAIN = REPO / "examples" / "accelerate_resume" / "train.py"


def train(num_ranks, out, stage, steps, *args):
    log = torchrun(TRAIN, num_ranks, "--output_dir", out, "--stage", stage, "--steps", steps, *args)
    assert f"distributed type DEEPSPEED, world size {num_ranks}" in log, log
    return log


def losses(log):
    """The loss of each step the run trained, by step."""
    return {int(line.split()[1]): float(line.split()[3]) for line in log.splitlines() if line.startswith("step ")}


def resumed(log):
    """The step the run resumed at, and the loss of the next step with the resumed weights."""
    (line, ) = [line for line in log.splitlines() if line.startswith("resumed at step ")]
    return int(line.split()[3].rstrip(",")), float(line.split()[-1])


def checksum(log):
    (line, ) = [line for line in log.splitlines() if line.startswith("parameter checksum ")]
    return float(line.split()[-1])


@pytest.mark.parametrize("stage, resume_ranks", [(2, 2), (3, 1)])
def test_accelerate_resumes(tmp_path, stage, resume_ranks):
    out = tmp_path / "out"
    log = train(2, out, stage, 4)
    assert (out / "step2" / "latest").read_text() == "pytorch_model"
    assert sorted(losses(log)) == [1, 2, 3, 4], log
    resumed_log = train(resume_ranks, out, stage, 4, "--resume", str(out / "step2"))
    step, next_loss = resumed(resumed_log)
    assert step == 2, resumed_log
    # On 1 rank the step's batch is summed in another order than on 2.
    assert next_loss == pytest.approx(losses(log)[3], rel=1e-6), resumed_log
    assert losses(resumed_log) == pytest.approx({step: losses(log)[step] for step in (3, 4)}, rel=1e-6), resumed_log
    assert checksum(resumed_log) == pytest.approx(checksum(log), rel=1e-6), resumed_log


def test_accelerate_async_save_then_end_training(tmp_path):
    out = tmp_path / "out"
    train(2, out, 2, 4, "--async_save", "--end_training")
    assert (out / "step4" / "latest").read_text() == "pytorch_model"
    log = train(1, out, 2, 5, "--resume", str(out / "step4"))
    assert resumed(log)[0] == 4, log
    assert sorted(losses(log)) == [5], log


def test_accelerate_async_save_keeps_the_last_checkpoint(tmp_path):
    out = tmp_path / "out"
    train(2, out, 3, 4, "--async_save", "--total_limit", "1", "--save_every", "1")
    checkpoints = out / "checkpoints"
    assert [path.name for path in checkpoints.iterdir()] == ["checkpoint_3"]
    assert (checkpoints / "checkpoint_3" / "latest").read_text() == "pytorch_model"
    log = train(1, out, 3, 5, "--resume", str(checkpoints / "checkpoint_3"))
    assert resumed(log)[0] == 4, log
    assert sorted(losses(log)) == [5], log
