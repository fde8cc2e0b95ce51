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
import deepspeed.comm as dist
from deepspeed.utils import safe_get_full_optimizer_state

from unit.common import DistributedTest

LR = 1e-2
STEPS = 3


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1234)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=128,
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=16))


def trainer_param_groups(model):
    """The groups the Hugging Face Trainer builds: weight decay on matrices, none on norm weights."""
    return [{
        "params": [param for param in model.parameters() if param.dim() >= 2],
        "weight_decay": 0.1
    }, {
        "params": [param for param in model.parameters() if param.dim() < 2],
        "weight_decay": 0.0
    }]


def ds_config(stage):
    # The reference does not clip, and trains with torch.optim.Adam (not AdamW).
    return {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "torch_adam": True,
                "adam_w_mode": False
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }


def batches():
    generator = torch.Generator().manual_seed(1235)
    return [torch.randint(0, 128, (4, 8), generator=generator) for _ in range(STEPS)]


def train(engine, steps):
    """Each of the 2 ranks trains on its half of every batch; the losses of the whole batches."""
    losses = []
    for batch in batches()[:steps]:
        ids = batch.chunk(2)[dist.get_rank()].to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().float()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / 2)
    return losses


def train_reference(optimizer_class, steps, lr=LR):
    """The same model and batches in this process alone; the optimizer, and the losses."""
    model = build_model()
    optimizer = optimizer_class(trainer_param_groups(model), lr=lr)
    losses = []
    for batch in batches()[:steps]:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, optimizer, losses


class TestOptimizerParamGroups(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2])
    def test_safe_get_full_optimizer_state(self, stage):
        model = build_model()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               config=ds_config(stage),
                                               model_parameters=trainer_param_groups(model))
        train(engine, 1)
        reference, optimizer, _ = train_reference(torch.optim.Adam, 1)

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
        model = build_model()
        config = ds_config(stage)
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
                for group in engine.optimizer.optimizer.param_groups] == [(LR / 2, 0.1), (LR / 2, 0.0)]
        losses = train(engine, STEPS)

        _, _, expected = train_reference(torch.optim.Adagrad, STEPS, lr=LR / 2)
        assert losses == pytest.approx(expected, rel=1e-4)
        engine.destroy()
