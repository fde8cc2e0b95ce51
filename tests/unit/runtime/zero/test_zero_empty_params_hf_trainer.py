# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A Hugging Face ``transformers`` model with zero-element parameters trains under the ``Trainer``
with a ZeRO-3 DeepSpeed config, and the model it saves loads back with the same keys and shapes.

The model is a tiny Llama built from a config (no download) whose attention projections carry a
LoRA adapter at rank 0 (``Linear(h, 0)`` and ``Linear(0, h)``, both in the forward) and a 1-D
quantization placeholder. On deepspeed 0.19.8 the first forward stops at ZeRO-3's fetch assert
(``'status': 'NOT_AVAILABLE'``, ``'numel': 0``).
"""

import os

import pytest
import torch
import torch.nn as nn

import deepspeed.comm as dist

from unit.common import DistributedTest

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 32
HIDDEN = 16
SEQ_LEN = 8


class RankZeroLoRALinear(nn.Module):
    """A linear layer with a LoRA adapter of rank 0 and a quantization scale placeholder."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, 0, bias=False)
        self.lora_B = nn.Linear(0, base.out_features, bias=False)
        self.scales = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x))


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB,
                                      hidden_size=HIDDEN,
                                      intermediate_size=2 * HIDDEN,
                                      num_hidden_layers=2,
                                      num_attention_heads=2,
                                      num_key_value_heads=1,
                                      max_position_embeddings=SEQ_LEN,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        layer.self_attn.q_proj = RankZeroLoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = RankZeroLoRALinear(layer.self_attn.v_proj)
    return model


class TokenDataset(torch.utils.data.Dataset):

    def __init__(self, size=16):
        generator = torch.Generator().manual_seed(1)
        self.input_ids = torch.randint(0, VOCAB, (size, SEQ_LEN), generator=generator)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        return {"input_ids": self.input_ids[index], "labels": self.input_ids[index]}


DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "weight_decay": "auto",
            "torch_adam": True
        }
    },
    "zero_optimization": {
        "stage": 3,
        "stage3_gather_16bit_weights_on_model_save": True
    },
}


def shapes(state_dict):
    return {name: tuple(t.shape) for name, t in state_dict.items()}


class TestZeroEmptyParamsHFTrainer(DistributedTest):
    world_size = [1, 2]

    def test(self, tmpdir):
        output_dir = str(tmpdir.join("trainer"))
        args = transformers.TrainingArguments(output_dir=output_dir,
                                              use_cpu=True,
                                              deepspeed=DS_CONFIG,
                                              per_device_train_batch_size=2,
                                              max_steps=3,
                                              learning_rate=1e-2,
                                              save_strategy="no",
                                              logging_steps=1,
                                              report_to=[])
        trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset())
        result = trainer.train()
        assert torch.isfinite(torch.tensor(result.training_loss))
        trainer.save_model(output_dir)
        dist.barrier()

        if dist.get_rank() == 0:
            expected = tiny_llama().state_dict()
            saved = safetensors_torch.load_file(os.path.join(output_dir, "model.safetensors"))
            assert shapes(saved) == shapes(expected)
            assert any(t.numel() == 0 for t in saved.values())
            tiny_llama().load_state_dict(saved, strict=True)
        dist.barrier()
