# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""docs/resume-other-topology.md, run as a user would: the Hugging Face Trainer trains on 2 ranks
and saves, then resumes on 1 rank with the same script and config, from exactly the saved weights,
and trains on to its next save; at ZeRO-3 also by the offline path (ds_to_universal, then
``load_universal``), and from a ZeRO-2 checkpoint with a ZeRO-3 config, which is refused with
another optimizer (Adagrad) than the Trainer's AdamW that saved it. With
``"checkpoint": {"async_save": true}`` in the Trainer's config the same script saves in the
background and resumes the same way (docs/checkpoint-safety.md).

On deepspeed 0.19.8 the direct resume fails in ``load_checkpoint`` ("Automatic adjustment of
ZeRO's optimizer state partitioning with a new world size is not currently supported").
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unit.common import get_master_port

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "trainer_resume_other_world_size" / "train.py"


def run(*command, succeeds=True):
    proc = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert (proc.returncode == 0) == succeeds, proc.stdout
    return proc.stdout


def deepspeed_launcher(num_ranks, *args, succeeds=True):
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", str(num_ranks)]
    return run(*launcher, "--master_port", str(get_master_port()), str(TRAIN), *args, succeeds=succeeds)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """The output folder of a 2-rank run at a ZeRO stage, saved at step 2: run once for every resume of it."""
    runs = {}

    def saved(zero_stage):
        if zero_stage not in runs:
            runs[zero_stage] = tmp_path_factory.mktemp(f"zero{zero_stage}")
            deepspeed_launcher(2, "--output_dir", runs[zero_stage], "--zero_stage", str(zero_stage), "--max_steps",
                               "2")
        return runs[zero_stage] / "checkpoint-2"

    return saved


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_trainer_resumes_on_another_world_size(tmp_path, saved_run, zero_stage):
    out = tmp_path / "out"
    checkpoint = saved_run(zero_stage)
    log = deepspeed_launcher(1, "--output_dir", out, "--zero_stage", str(zero_stage), "--max_steps", "4",
                             "--resume_from_checkpoint", checkpoint, "--check_resumed_weights")
    assert "saved at data-parallel size 2 into data-parallel size 1" in log, log
    assert "resumed weights match" in log, log
    assert (out / "checkpoint-4" / "latest").read_text() == "global_step4"
    assert os.path.isdir(out / "checkpoint-4" / "global_step4")
    if zero_stage < 3:
        return

    # The offline path, for what a load cannot reshard: the same resume from the converted checkpoint.
    run(sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", checkpoint / "global_step2",
        "--output_folder", checkpoint / "global_step2_universal")
    offline = tmp_path / "offline"
    log = deepspeed_launcher(1, "--output_dir", offline, "--zero_stage", str(zero_stage), "--max_steps", "4",
                             "--resume_from_checkpoint", checkpoint, "--load_universal", "--check_resumed_weights")
    assert "saved at data-parallel size" not in log, log
    assert "resumed weights match" in log, log
    assert (offline / "checkpoint-4" / "latest").read_text() == "global_step4"


def test_trainer_resumes_at_another_zero_stage(tmp_path, saved_run):
    # A ZeRO-2 run resumed with a ZeRO-3 config (to fit a longer context), on another number of ranks.
    out = tmp_path / "out"
    log = deepspeed_launcher(1, "--output_dir", out, "--zero_stage", "3", "--max_steps", "4",
                             "--resume_from_checkpoint", saved_run(2), "--check_resumed_weights")
    assert "Loading ZeRO-2 checkpoint" in log and "into ZeRO-3 at data-parallel size 1" in log, log
    assert "resumed weights match" in log, log
    assert (out / "checkpoint-4" / "latest").read_text() == "global_step4"
    assert os.path.isfile(out / "checkpoint-4" / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt")

    # The same resume with another optimizer: refused, as the saved moments would not go on.
    other = tmp_path / "adagrad"
    resume = ["--zero_stage", "3", "--max_steps", "4", "--resume_from_checkpoint", saved_run(2)]
    log = deepspeed_launcher(1, "--output_dir", other, *resume, "--optim", "adagrad", succeeds=False)
    assert ("Cannot load the checkpoint's optimizer states into this Adagrad optimizer: for each element of parameter "
            "group 0 the checkpoint holds exp_avg, exp_avg_sq, and Adagrad keeps sum") in log, log
    assert not os.path.exists(other / "checkpoint-4")


def test_trainer_saves_in_the_background_and_resumes(tmp_path):
    # "async_save" in the Trainer's DeepSpeed config, and nothing else: the script ends right after
    # the last save, and destroys the process group, which waits for the save to be committed.
    out = tmp_path / "out"
    deepspeed_launcher(2, "--output_dir", out, "--zero_stage", "2", "--max_steps", "2", "--async_save")
    assert (out / "checkpoint-2" / "latest").read_text() == "global_step2"
    log = deepspeed_launcher(1, "--output_dir", out, "--zero_stage", "2", "--max_steps", "4",
                             "--resume_from_checkpoint", out / "checkpoint-2", "--check_resumed_weights",
                             "--async_save")
    assert "resumed weights match" in log, log
    assert (out / "checkpoint-4" / "latest").read_text() == "global_step4"
