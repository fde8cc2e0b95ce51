# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``safe_get_full_optimizer_state`` returns the optimizer state of every parameter at ZeRO-1 and -2,
whatever its parameter group. The model is trained with the two groups the Hugging Face Trainer
builds (weight decay on matrices, none on norm weights); after one step every parameter's Adam
moments are those of ``torch.optim.Adam`` trained with the same groups in one process.

On deepspeed 0.19.8 the optimizer states were linked to the parameters right after the first
group's first step, before the other groups had any: every parameter of the second group raised
"exp_avg not found in optimizer state fragment".
"""

import pytest
import torch

import deepspeed
from deepspeed.utils import groups, safe_get_full_optimizer_state

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import LR, build_model, ds_config, global_batches, train_engine, trainer_param_groups


class TestOptimizerStateOfEveryGroup(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2])
    def test_safe_get_full_optimizer_state(self, stage):
        groups._release_process_group_references(None)
        model = build_model()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               config=ds_config(stage, tp_size=1),
                                               model_parameters=trainer_param_groups(model))
        train_engine(engine, 1, 1)

        reference = build_model()
        optimizer = torch.optim.Adam(trainer_param_groups(reference), lr=LR)
        batch = global_batches(1, reference.config.vocab_size)[0]
        reference(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

        reference_params = dict(reference.named_parameters())
        for name, param in engine.module.named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                expected = optimizer.state[reference_params[name]][key]
                torch.testing.assert_close(safe_get_full_optimizer_state(param, key),
                                           expected,
                                           rtol=1e-4,
                                           atol=1e-9,
                                           msg=lambda m: f"{name} {key}: {m}")
        engine.destroy()
