# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A job that resumes a ZeRO checkpoint with another optimizer than the one that saved it, on the
ranks that saved it. A 2-rank job of a small Llama trains two steps with a client optimizer of torch
(SGD with momentum, or Adagrad) and saves; a job with the other optimizer loads the checkpoint. The
load must be refused before the optimizer states are loaded, naming the states each optimizer keeps
per element, and the optimizer must keep its own states and hyperparameters. ZeRO-1 in bf16 (the
BF16 optimizer), ZeRO-2 and ZeRO-3. The same optimizer with other settings (SGD without momentum)
loads, and the saved hyperparameters come back.

Before, torch's ``load_state_dict`` put the saved states in place of the optimizer's own, and the
load or the next step failed with a ``KeyError`` (``'step'``, ``'sum'``, ``'momentum'``) that did not
say why.
"""

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from unit.common import DistributedTest

TAG = "step2"
LR = 1e-2
# The states each optimizer keeps per element.
STATE_NAMES = {"SGD": "momentum_buffer", "Adagrad": "sum"}


def initialize(stage, optimizer_name, dtype=torch.float32, momentum=0.9):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=8)).to(dtype)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": stage
        },
        "zero_allow_untested_optimizer": True,
        "bf16": {
            "enabled": dtype == torch.bfloat16
        },
    }
    if dtype == torch.bfloat16 and stage == 1:
        # ZeRO-1 runs the BF16 optimizer for bf16 weights with fp32 gradient accumulation.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    param_groups = model.parameters()
    if optimizer_name == "SGD":
        optimizer = torch.optim.SGD(param_groups, lr=LR, momentum=momentum)
    else:
        optimizer = torch.optim.Adagrad(param_groups, lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, optimizer=optimizer)
    return engine


def hyperparameters(engine):
    return [{
        key: value
        for key, value in group.items() if key != "params"
    } for group in engine.optimizer.optimizer.param_groups]


def base_optimizer_states(engine):
    """The tensors the torch optimizer under ZeRO keeps for each of its parameters (flat partitions)."""
    return [{
        key: value.clone()
        for key, value in state.items() if torch.is_tensor(value)
    } for state in engine.optimizer.optimizer.state.values()]


def save(stage, optimizer_name, dtype, folder):
    engine = initialize(stage, optimizer_name, dtype)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7)).to(engine.device)
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(folder, tag=TAG)
    saved = hyperparameters(engine)
    engine.destroy()
    return saved


class TestLoadOtherOptimizer(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage,dtype,saved_optimizer,optimizer_name", [
        (2, torch.float32, "SGD", "Adagrad"),
        (3, torch.float32, "Adagrad", "SGD"),
        (1, torch.bfloat16, "SGD", "Adagrad"),
    ])
    def test_refused(self, stage, dtype, saved_optimizer, optimizer_name, tmpdir):
        save(stage, saved_optimizer, dtype, str(tmpdir))
        engine = initialize(stage, optimizer_name, dtype)
        own_hyperparameters = hyperparameters(engine)
        own_states = base_optimizer_states(engine)
        with pytest.raises(ZeRORuntimeException,
                           match=rf"into this {optimizer_name} optimizer: for each element of parameter group 0 the "
                           rf"checkpoint holds {STATE_NAMES[saved_optimizer]}, and {optimizer_name} keeps "
                           rf"{STATE_NAMES[optimizer_name]}, so the saved run would not go on\. .* The optimizer "
                           r"states were not loaded"):
            engine.load_checkpoint(str(tmpdir), tag=TAG)
        assert hyperparameters(engine) == own_hyperparameters
        # Its own states: none before its first step but Adagrad's, created with it.
        states = base_optimizer_states(engine)
        assert len(states) == len(own_states)
        for state, own_state in zip(states, own_states):
            assert sorted(state) == sorted(own_state)
            assert all(torch.equal(value, own_state[key]) for key, value in state.items())
        engine.destroy()

    def test_other_settings(self, tmpdir):
        # SGD without momentum keeps no state: it loads, and the saved hyperparameters come back with the
        # states, which the next steps use.
        saved = save(2, "SGD", torch.float32, str(tmpdir))
        engine = initialize(2, "SGD", momentum=0.0)
        engine.load_checkpoint(str(tmpdir), tag=TAG)
        assert hyperparameters(engine) == saved
        engine.destroy()
