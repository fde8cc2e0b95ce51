# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``ds_to_universal`` streams each parameter from the rank files into the universal layout: no
temporary fragment files, every parameter in its logical shape, the same output with several
worker processes and read threads, a ZeRO-3 ``optimizer_state.pt`` without the flat partitions
that the per-parameter files hold, and a checkpoint that restores and trains on as the original.

On deepspeed 0.19.8 the conversion writes ``<output>/tmp`` fragment files beside the output, and
ZeRO-3's ``optimizer_state.pt`` holds rank 0's flat partitions.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.checkpoint.test_ds_to_universal_output import (assert_same, convert_args, make_engine, run_cli, train,
                                                         trained_checkpoint, universal_files)
from unit.common import DistributedTest


@pytest.mark.parametrize("stage", [2, 3])
class TestDsToUniversalStreaming(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        folder = str(tmpdir)
        engine = trained_checkpoint(stage, folder)
        next_losses = train(engine, 2, seed=2)
        dist.barrier()
        checkpoint = os.path.join(folder, "step2")
        universal = os.path.join(folder, "step2_universal")
        if dist.get_rank() == 0:
            convert_to_universal(convert_args(checkpoint, universal))
            # No fragment pass: nothing but the output was written, and nothing is left beside it.
            assert not os.path.exists(os.path.join(universal, "tmp"))
            assert not [name for name in os.listdir(folder) if name.endswith(".tmp")]
            # Every parameter in its logical shape, holding the consolidated fp32 weights.
            fp32 = get_fp32_state_dict_from_zero_checkpoint(folder, tag="step2")
            files = universal_files(universal)
            for name, value in fp32.items():
                assert torch.equal(files[os.path.join("zero", name, "fp32.pt")]["param"], value), name
                for state in ("exp_avg", "exp_avg_sq"):
                    assert files[os.path.join("zero", name, f"{state}.pt")]["param"].shape == value.shape
            if stage == 3:
                # The flat partitions are in the per-parameter files: the global state leaves them out.
                optimizer_state = torch.load(os.path.join(universal, "zero", "optimizer_state.pt"), weights_only=False)
                assert "fp32_flat_groups" not in optimizer_state
                for param_state in optimizer_state["optimizer_state_dict"]["state"].values():
                    assert not [
                        key for key, value in param_state.items() if torch.is_tensor(value) and value.numel() > 1
                    ]

            # The worker options parallelize the same work: the same files, bit for bit.
            parallel = os.path.join(folder, "parallel", "step2_universal")
            proc = run_cli(checkpoint, parallel, workers=2)
            assert proc.returncode == 0, proc.stdout
            assert "Merging slices" in proc.stdout and "Done in" in proc.stdout
            assert_same(universal_files(parallel), files)
        dist.barrier()

        # The streamed checkpoint restores and trains on as the original engine did.
        restored = make_engine(stage, load_universal=True)
        restored.load_checkpoint(folder, tag="step2_universal")
        assert train(restored, 2, seed=2) == pytest.approx(next_losses, rel=1e-5)
