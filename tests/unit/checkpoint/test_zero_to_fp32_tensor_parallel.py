# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``zero_to_fp32`` on a checkpoint of AutoTP training (tensor-parallel size 2, a small Llama): it
returns the whole model, with the keys and shapes of the model's own ``state_dict()``, or it refuses
the checkpoint before reading it, naming tensor parallelism as the cause.

On deepspeed 0.19.8 it raises ``Expected 1 of '*_optim_states.pt' ... but found 2 files. Possibly
due to an overwrite of an old checkpoint, or a checkpoint didn't get saved by one or more
processes``: it blames damage that is not there for a complete checkpoint.
"""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest

TAG = "step1"


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=8,
                    tie_word_embeddings=False))


@pytest.mark.parametrize("stage", [1, 3])
class TestZeroToFp32TensorParallel(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, stage, tmpdir):
        config = {
            "train_batch_size": 2,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-2,
                    "torch_adam": True
                }
            },
            "zero_optimization": {
                "stage": stage
            },
            "tensor_parallel": {
                "autotp_size": 2
            },
        }
        model = build_model()
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        # The ranks of one tensor-parallel group see the same batch.
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(str(tmpdir), tag=TAG)
        dist.barrier()
        if dist.get_rank() == 0:
            expected = {name: tuple(tensor.shape) for name, tensor in build_model().state_dict().items()}
            try:
                state_dict = get_fp32_state_dict_from_zero_checkpoint(str(tmpdir), tag=TAG)
            except ValueError as error:
                assert "tensor-parallel" in str(error) and "overwrite" not in str(error), str(error)
            else:
                assert {name: tuple(tensor.shape) for name, tensor in state_dict.items()} == expected
        dist.barrier()
        engine.destroy()
