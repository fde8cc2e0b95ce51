# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A universal checkpoint loaded into a model whose parameters are not those saved: a fine-tuning job
that resized the vocabulary (``resize_token_embeddings``) and resumes from the universal checkpoint
of the run before. A 2-rank job of a small Llama trains two steps and saves, the checkpoint is
converted with ``ds_to_universal``, and a job of the same Llama with 8 more tokens loads it with
``"load_universal": true``. The load must be refused on every rank before anything is loaded,
naming the parameters and both shapes; the module and its fp32 weights stay as they were. ZeRO
stages 1, 2 and 3.

Before, at ZeRO-3 the load went through without a word, each rank cutting its partition out of the
saved whole as if it had the model's size; at ZeRO-1/2 it failed half way with a bare
``AssertionError``, after other parameters were loaded.
"""

import os
from types import SimpleNamespace

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils import safe_get_full_fp32_param

from unit.common import DistributedTest

TAG = "step2"
VOCAB = 64


def initialize(stage, vocab_size, load_universal=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=vocab_size,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=8))
    config = {
        "train_micro_batch_size_per_gpu": 2,
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
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def weights(engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        module = {name: param.detach().clone() for name, param in params.items()}
    fp32 = {name: safe_get_full_fp32_param(param).clone() for name, param in params.items()}
    return module, fp32


class TestUniversalLoadOtherParams(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("stage", [1, 2, 3])
    def test_resized_vocabulary(self, stage, tmpdir):
        engine = initialize(stage, VOCAB)
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(7)).to(engine.device)
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(str(tmpdir), tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
        engine.destroy()
        if dist.get_rank() == 0:
            convert_to_universal(
                SimpleNamespace(input_folder=os.path.join(str(tmpdir), TAG),
                                output_folder=os.path.join(str(tmpdir), f"{TAG}_universal"),
                                num_extract_workers=1,
                                num_merge_workers=1,
                                keep_temp_folder=False,
                                strict=True,
                                inject_missing_state=False))
        dist.barrier()

        engine = initialize(stage, VOCAB + 8, load_universal=True)
        before = weights(engine)
        with pytest.raises(ZeRORuntimeException,
                           match=r"Cannot load the universal checkpoint .* into this model, whose parameters are not "
                           r"those saved: .*model\.embed_tokens\.weight \(saved \(.*\), now \(72, 32\)\).* Nothing "
                           r"was loaded"):
            engine.load_checkpoint(str(tmpdir), tag=f"{TAG}_universal")
        for now, then in zip(weights(engine), before):
            assert all(torch.equal(now[name], value) for name, value in then.items())
        engine.destroy()
