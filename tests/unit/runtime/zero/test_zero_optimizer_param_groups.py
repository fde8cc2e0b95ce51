# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO keeps every optimizer parameter group apart. The model is trained with the two groups the
Hugging Face Trainer builds (weight decay on matrices, none on norm weights):

- at ZeRO-1 and -2, ``safe_get_full_optimizer_state`` returns every parameter's Adam moments, those
  of ``torch.optim.Adam`` trained with the same groups in one process. On deepspeed 0.19.8 the
  optimizer states were linked to the parameters right after the first group's first step, before
  the other groups had any: every parameter of the second group raised "exp_avg not found in
  optimizer state fragment".
- with ``torch.optim.Adagrad`` as the client optimizer, at ZeRO-1, -2 and -3, each group keeps its
  hyperparameters, an LR scheduler built on the client optimizer (as the Trainer builds it) sets
  their learning rates, and the losses are those of ``torch.optim.Adagrad`` in one process at that
  learning rate. On deepspeed 0.19.8 ZeRO rebuilt Adagrad (which creates its states at
  construction) as a new optimizer of one group with the optimizer's defaults: the groups'
  hyperparameters and the schedule were lost, and the first step failed with an ``IndexError`` on
  the second group.
"""

import pytest
import torch

import deepspeed
from deepspeed.utils import groups, safe_get_full_optimizer_state

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import (LR, build_model, ds_config, global_batches, param_group_hyperparameters,
                                           train_engine, train_reference, trainer_param_groups)


class TestOptimizerParamGroups(DistributedTest):
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

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_adagrad(self, stage):
        groups._release_process_group_references(None)
        model = build_model()
        config = ds_config(stage, tp_size=1)
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
        optimizer = torch.optim.Adagrad(trainer_param_groups(model), lr=LR)
        # As the Hugging Face Trainer hands its schedule over: built on the client optimizer.
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            config=config,
            optimizer=optimizer,
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda _: 0.5))
        assert [(group["lr"], group["weight_decay"])
                for group in param_group_hyperparameters(engine)] == [(LR / 2, 0.1), (LR / 2, 0.0)]
        losses = train_engine(engine, 1, 3)

        _, expected = train_reference(3,
                                      make_optimizer=lambda m: torch.optim.Adagrad(trainer_param_groups(m), lr=LR / 2))
        assert losses == pytest.approx(expected, rel=1e-4)
        engine.destroy()
