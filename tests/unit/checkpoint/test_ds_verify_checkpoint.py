# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_verify_checkpoint`` checks a checkpoint without loading it, as a job does before it deletes
its previous checkpoint, or a user after copying checkpoints between storage systems.

A 2-rank ZeRO-3 job saves two tags. The command prints one line per tag and exits with 0; then, one
bit flipped in a record of the other rank's optimizer file of the second tag, a rank file of the
first tag removed and another cut short, it names each problem on its tag's line and exits with 1.
"""

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout

import deepspeed.comm as dist
from deepspeed.checkpoint.verify_checkpoint import main as verify_checkpoint

from unit.checkpoint.test_checkpoint_crc32 import flip_bit
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest


def run(*args):
    output = io.StringIO()
    with redirect_stdout(output):
        returncode = verify_checkpoint(list(args))
    return returncode, output.getvalue().splitlines()


class TestVerifyCheckpoint(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_verify_checkpoint(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(3)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="global_step1")
        engine.save_checkpoint(save_dir, tag="global_step2")
        dist.barrier()
        if dist.get_rank() != 0:
            return

        returncode, lines = run(save_dir)
        assert returncode == 0, lines
        assert [line.split(":")[0] for line in lines] == ["global_step1", "global_step2"]
        assert all(": OK, 4 files" in line for line in lines), lines
        # The command as users run it.
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.verify_checkpoint", save_dir],
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              text=True)
        assert proc.returncode == 0 and proc.stdout.count(": OK, 4 files") == 2, proc.stdout

        changed = os.path.join(save_dir, "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        record = flip_bit(changed)
        missing = os.path.join(save_dir, "global_step1", "zero_pp_rank_1_mp_rank_00_model_states.pt")
        os.remove(missing)
        truncated = os.path.join(save_dir, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        with open(truncated, "r+b") as fd:
            fd.truncate(os.path.getsize(truncated) // 2)

        returncode, lines = run(save_dir)
        assert returncode == 1, lines
        step1, step2 = lines
        assert step1.startswith("global_step1: FAILED: ")
        assert f"{missing} (missing)" in step1 and f"{truncated} (truncated)" in step1, step1
        assert step2.startswith("global_step2: FAILED: ")
        assert re.search(re.escape(f"{changed} (record '{record}', holding ") + ".* fails its CRC-32 check",
                         step2), step2

        returncode, lines = run(save_dir, "--tag", "global_step2")
        assert returncode == 1 and len(lines) == 1 and lines[0].startswith("global_step2: FAILED"), lines
        # The folder of one tag.
        returncode, lines = run(os.path.join(save_dir, "global_step2"))
        assert returncode == 1 and len(lines) == 1 and changed in lines[0], lines
        # A folder that is not there, such as a mistyped one.
        nowhere = os.path.join(save_dir, "nowhere")
        assert run(nowhere) == (1, [f"{nowhere}: no such folder"])
