# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A job resumes straight from a checkpoint on S3-compatible object storage: ``load_checkpoint`` takes
the URL of the folder (``s3://bucket/run``), reads ``latest`` there, checks the tag's record and the
CRC-32s of the objects it reads, and loads them, with no local copy. A run whose checkpoints are
synced to a bucket resumes on another cluster without downloading them first.

A 2-rank job saves at ZeRO-2 and at ZeRO-3 and its checkpoint folder is uploaded; a new job, given the
endpoint in ``"checkpoint": {"storage_options": ...}`` (credentials from the environment), loads it by
URL: the weights are those saved, and its next step gives the weights of the step after the save. A
bit flipped in an object is refused on every rank, naming the object, with the weights unchanged. A
1-rank job loads the ZeRO-3 checkpoint of the 2 ranks from the objects as well.

A wrong endpoint is refused, naming it, where it would otherwise look like a folder without a
checkpoint, from which the job would start afresh. Credentials in ``storage_options`` are refused,
without repeating them: DeepSpeed logs its config and saves it in every checkpoint.
"""

import os
import socket

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

from unit.checkpoint.test_checkpoint_crc32 import flip_bit
from unit.checkpoint.test_checkpoint_killed_save import full_weights, initialize, train_step
from unit.checkpoint.test_checkpoint_weights_only import assert_weights_equal
from unit.common import DistributedTest

# The s3_endpoint fixture (its helpers are imported where they run, in the ranks: a plugin module is
# imported by pytest first).
pytest_plugins = ["unit.checkpoint.s3_server"]


def run_url(s3_endpoint, stage):
    # One bucket for the session's server: the 1-rank job loads what the 2-rank job uploaded.
    return f"s3://resume-{s3_endpoint.rsplit(':', 1)[1]}-stage{stage}/run"


@pytest.mark.parametrize("stage", [2, 3])
class TestLoadFromObjectStorage(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test_resume_from_s3(self, stage, s3_endpoint, tmpdir):
        import s3fs
        from unit.checkpoint.s3_server import s3_environment, upload_folder
        save_dir = str(tmpdir)
        engine = initialize(stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="global_step1")
        saved = full_weights(engine)
        train_step(engine)
        stepped = full_weights(engine)
        url = run_url(s3_endpoint, stage)

        with s3_environment(s3_endpoint):
            if dist.get_rank() == 0:
                fs = s3fs.S3FileSystem()
                fs.mkdir(url.split("/")[2])
                upload_folder(save_dir, url)
                with fs.open(f"{url}.weights.pt", "wb") as fd:
                    torch.save(saved, fd)
            dist.barrier()
            # The endpoint from the engine's config only.
            del os.environ["AWS_ENDPOINT_URL_S3"]
            options = {"storage_options": {"endpoint_url": s3_endpoint}}
            fresh = initialize(stage, **options)
            load_path, _ = fresh.load_checkpoint(url)
            assert load_path is not None and load_path.startswith(f"{url}/global_step1/"), load_path
            assert_weights_equal(fresh, saved)
            train_step(fresh)
            assert_weights_equal(fresh, stepped)

            optim_file = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
            if dist.get_rank() == 1:
                local = os.path.join(save_dir, "global_step1", optim_file)
                record = flip_bit(local)
                s3fs.S3FileSystem(endpoint_url=s3_endpoint).put_file(local, f"{url}/global_step1/{optim_file}")
            dist.barrier()
            other = initialize(stage, **options)
            weights = full_weights(other)
            with pytest.raises(ValueError) as refusal:
                other.load_checkpoint(url)
            assert f"{url}/global_step1/{optim_file} (record '" in str(refusal.value), refusal.value
            assert_weights_equal(other, weights)
            dist.barrier()
            if dist.get_rank() == 1:
                flip_bit(local)
                s3fs.S3FileSystem(endpoint_url=s3_endpoint).put_file(local, f"{url}/global_step1/{optim_file}")
            dist.barrier()


class TestLoadFromObjectStorageOnFewerRanks(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    def test_resume_from_s3_on_one_rank(self, s3_endpoint):
        import s3fs
        from unit.checkpoint.s3_server import s3_environment
        url = run_url(s3_endpoint, 3)
        with s3_environment(s3_endpoint):
            with s3fs.S3FileSystem().open(f"{url}.weights.pt", "rb") as fd:
                saved = torch.load(fd, weights_only=True)
            engine = initialize(3)
            engine.load_checkpoint(url)
            assert_weights_equal(engine, saved)


def test_credentials_in_the_config_are_refused():
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "checkpoint": {
            "storage_options": {
                "endpoint_url": "https://s3.example.com",
                "key": "AKIAIOSFODNN7EXAMPLE",
                "secret": secret
            }
        }
    }
    with pytest.raises(DeepSpeedConfigError) as refusal:
        DeepSpeedConfig(config)
    assert "storage_options holds credentials (key, secret)" in str(refusal.value), refusal.value
    assert secret not in str(refusal.value) and "AKIA" not in str(refusal.value)


class TestLoadFromUnreachableObjectStorage(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    def test_wrong_endpoint_is_refused(self, s3_endpoint):
        from unit.checkpoint.s3_server import s3_environment
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            # Nothing listens there.
            wrong_endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with s3_environment(s3_endpoint):
            engine = initialize(3,
                                storage_options={
                                    "endpoint_url": wrong_endpoint,
                                    "config_kwargs": {
                                        "retries": {
                                            "max_attempts": 1
                                        }
                                    }
                                })
            weights = full_weights(engine)
            with pytest.raises(Exception) as refusal:
                engine.load_checkpoint(run_url(s3_endpoint, 3))
            assert f'Could not connect to the endpoint URL: "{wrong_endpoint}/' in str(refusal.value), refusal.value
            assert_weights_equal(engine, weights)
