# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint restores each optimizer parameter group's own hyperparameters. The model
is trained with the two groups the Hugging Face Trainer builds (weight decay on matrices, none on
norm weights), the second one with a lower learning rate, saved, converted with ``ds_to_universal``
and restored with ``load_universal``: every group holds the hyperparameters it was saved with, and
the next steps' losses are those of the run that went on uninterrupted, as after a load of the
checkpoint itself at the same size.

On deepspeed 0.19.8 the ZeRO-3 universal loader gives every group the hyperparameters of the first
one: the norm weights are decayed from then on, at the matrices' learning rate.
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import groups

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import (LR, build_model, convert_to_universal_checkpoint, ds_config,
                                           param_group_hyperparameters, train_engine, trainer_param_groups)

SAVE_STEPS = 2
RESUME_STEPS = 2
TAG = "step2"


def initialize(stage, dtype, load_universal=False, one_group=False):
    groups._release_process_group_references(None)
    model = build_model(dtype=dtype)
    param_groups = list(model.parameters()) if one_group else trainer_param_groups(model, no_decay_lr=LR / 2)
    config = ds_config(stage, tp_size=1, dtype=dtype, load_universal=load_universal)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=param_groups)
    return engine


class TestUniversalCheckpointParamGroups(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32),
                                             (3, torch.bfloat16)])
    def test_param_groups(self, stage, dtype, tmpdir):
        folder = str(tmpdir)
        engine = initialize(stage, dtype)
        train_engine(engine, 1, SAVE_STEPS)
        engine.save_checkpoint(folder, tag=TAG)
        saved = param_group_hyperparameters(engine)
        assert [group["weight_decay"] for group in saved] == [0.1, 0.0]
        uninterrupted = train_engine(engine, 1, RESUME_STEPS, first_step=SAVE_STEPS)
        engine.destroy()
        if dist.get_rank() == 0:
            convert_to_universal_checkpoint(os.path.join(folder, TAG), os.path.join(folder, f"{TAG}_universal"))
        dist.barrier()

        # The universal checkpoint, and the checkpoint itself as a load at the same size reads it.
        for load_universal, tag in ((True, f"{TAG}_universal"), (False, TAG)):
            engine = initialize(stage, dtype, load_universal=load_universal)
            engine.load_checkpoint(folder, tag=tag)
            assert param_group_hyperparameters(engine) == saved
            losses = train_engine(engine, 1, RESUME_STEPS, first_step=SAVE_STEPS)
            assert losses == pytest.approx(uninterrupted, rel=1e-5 if dtype == torch.float32 else 1e-2)
            engine.destroy()

        # An optimizer whose groups are not the saved ones is refused, not loaded into the first groups.
        engine = initialize(stage, dtype, load_universal=True, one_group=True)
        with pytest.raises(ValueError, match="has 2 parameter groups, this optimizer has 1"):
            engine.load_checkpoint(folder, tag=f"{TAG}_universal")
        engine.destroy()
