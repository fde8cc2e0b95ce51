# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)`` of a ZeRO-1/2 checkpoint returns
pseudo tensors that read each parameter from the rank files when it is used, as it does for ZeRO-3:
the call itself does not build the model's fp32 weights in memory, and every parameter read is the
one the eager call returns.

On deepspeed 0.19.8 the ZeRO-1/2 reader concatenates every parameter group's partitions first, so
the lazy call holds all of the model's fp32 weights.
"""

import pytest
import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest

HIDDEN = 1024  # 8 layers of 1024 x 1024: 32 MB of fp32 weights


def rss_anon_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("stage", [1, 2])
class TestZeroToFp32LazyZero2(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(8)])
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "torch_adam": True
                }
            },
            "zero_optimization": {
                "stage": stage
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        save_dir = str(tmpdir)
        engine.save_checkpoint(save_dir, tag="step0")
        dist.barrier()
        if dist.get_rank() == 0:
            before = rss_anon_bytes()
            lazy = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step0", lazy_mode=True)
            grown = rss_anon_bytes() - before
            weights = sum(p.numel() * 4 for p in model.parameters())
            assert grown < weights // 4, f"the lazy state dict took {grown} bytes for {weights} bytes of weights"
            eager = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step0")
            assert sorted(lazy) == sorted(eager)
            for name, value in eager.items():
                assert not isinstance(lazy[name], torch.Tensor), name
                assert torch.equal(lazy[name].contiguous(), value), name
        dist.barrier()
        engine.destroy()
