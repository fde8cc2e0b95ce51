# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_verify_checkpoint`` checks a checkpoint where it is stored, on S3-compatible object storage
too: a run's checkpoints uploaded to a bucket (as ``aws s3 sync`` does) are checked there, before
the local copies are deleted, without downloading them first.

A ZeRO-3 job saves three tags, uploaded to an S3 API server on 127.0.0.1. Given the URL
``s3://bucket/run``, the command says OK for each tag, reading the endpoint from the environment as
the storage client does; a tag saved without a record of its files (by 0.19.8) is checked from its
model states file, read from the bucket. Then, with one bit flipped in a record of an object of the
second tag and a recorded object of the first tag removed, it names both problems and exits with 1.
"""

import os
import re
import subprocess
import sys

from deepspeed.checkpoint.constants import CHECKPOINT_MANIFEST

from unit.checkpoint.test_checkpoint_crc32 import flip_bit
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.checkpoint.test_ds_verify_checkpoint import run
from unit.common import DistributedTest

# The s3_endpoint fixture (its helpers are imported where they run, in the ranks: a plugin module is
# imported by pytest first).
pytest_plugins = ["unit.checkpoint.s3_server"]


class TestVerifyCheckpointOnObjectStorage(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    def test_verify_checkpoint_on_s3(self, s3_endpoint, tmpdir):
        from unit.checkpoint.s3_server import new_bucket, s3_environment, upload_folder
        save_dir = str(tmpdir)
        engine = initialize(3)
        train_step(engine)
        for step in (1, 2, 3):
            engine.save_checkpoint(save_dir, tag=f"global_step{step}")
        # The third tag as 0.19.8 saves it: without the record of its files.
        os.remove(os.path.join(save_dir, "global_step3", CHECKPOINT_MANIFEST))

        with s3_environment(s3_endpoint) as environment:
            import s3fs
            url = f"s3://{new_bucket()}/run"
            upload_folder(save_dir, url)

            returncode, lines = run(url)
            assert returncode == 0, lines
            assert [line.split(":")[0] for line in lines] == [f"global_step{step}" for step in (1, 2, 3)], lines
            assert all(": OK, 2 files" in line and "every record's CRC-32 verified" in line for line in lines), lines
            # The command as users run it, configured by the environment alone.
            proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.verify_checkpoint", url],
                                  env={
                                      **os.environ,
                                      **environment
                                  },
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  text=True)
            assert proc.returncode == 0 and proc.stdout.count(": OK, 2 files") == 3, proc.stdout

            optim_file = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
            record = flip_bit(os.path.join(save_dir, "global_step2", optim_file))
            changed = f"{url}/global_step2/{optim_file}"
            s3fs.S3FileSystem().put_file(os.path.join(save_dir, "global_step2", optim_file), changed)
            missing = f"{url}/global_step1/zero_pp_rank_0_mp_rank_00_model_states.pt"
            s3fs.S3FileSystem().rm(missing)

            returncode, lines = run(url)
            assert returncode == 1, lines
            step1, step2, step3 = lines
            assert step1 == f"global_step1: FAILED: {missing} (missing)", step1
            assert re.fullmatch(
                re.escape(f"global_step2: FAILED: {changed} (record '{record}', holding ") + ".* fails its CRC-32 .*",
                step2), step2
            assert step3.startswith("global_step3: OK"), step3

            returncode, lines = run(f"{url}/nothing")
            assert returncode == 1 and lines == [f"{url}/nothing: no such folder"], lines
        engine.destroy()
