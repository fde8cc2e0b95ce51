# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""With the comms logger on, ``all_gather_object`` and ``monitored_barrier`` run and are logged.

A training job with ``"comms_logger": {"enabled": true}`` (which times every collective) gathers a
metric from every rank with ``deepspeed.comm.all_gather_object`` and then waits for every rank with
``deepspeed.comm.monitored_barrier``, as scripts do around evaluation. Both must return, and the
log must hold one record of each. Before, the logger knew no bandwidth formula for either and
called ``exit(0)``: the job ended with status 0 at the first of them.
"""

import torch

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest


class TestCommsLogger(DistributedTest):
    world_size = 2

    def test_object_collectives_are_logged(self):
        model = torch.nn.Linear(8, 8)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3,
                    "torch_adam": True
                }
            },
            "comms_logger": {
                "enabled": True
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        loss = engine(torch.randn(1, 8)).sum()
        engine.backward(loss)
        engine.step()
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, loss.item())
        dist.monitored_barrier()
        records = dist.comms_logger.comms_dict
        assert losses[dist.get_rank()] == loss.item()
        assert sum(count for count, *_ in records["all_gather_object"].values()) == 1
        assert sum(count for count, *_ in records["monitored_barrier"].values()) == 1
