# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared pieces of the AutoTP x ZeRO checkpoint tests: a small ``transformers`` Llama built from a
config, a DeepSpeed config with AutoTP, the data every topology sees, and a single-process
reference trained with the same seed and data, and the subprocess that saves a test's source
checkpoint when the test is selected without the test that saves it.

Every test trains the same model on the same global batches: each data-parallel rank takes its
slice of the global batch (the ranks of one tensor-parallel group take the same slice), so after
``steps`` steps every topology holds the weights that one process training on the whole batch
holds, up to the rounding of the different reduction order.
"""

import argparse
import os
import subprocess
import sys

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

SEED = 1234
SEQ_LEN = 8
GLOBAL_BATCH = 4
LR = 1e-2


def llama_config(uneven=False):
    """2 layers, hidden 64, 4 attention heads over 2 key-value heads (GQA). ``uneven`` makes the
    vocabulary and the MLP width odd (129), so a 2-way split gives shards of 65 and 64 rows."""
    from transformers import LlamaConfig
    width = 129 if uneven else 128
    return LlamaConfig(vocab_size=width,
                       hidden_size=64,
                       intermediate_size=width,
                       num_hidden_layers=2,
                       num_attention_heads=4,
                       num_key_value_heads=2,
                       max_position_embeddings=2 * SEQ_LEN,
                       tie_word_embeddings=False)


def build_model(uneven=False, dtype=torch.float32):
    from transformers import LlamaForCausalLM
    torch.manual_seed(SEED)
    return LlamaForCausalLM(llama_config(uneven)).to(dtype)


def trainer_param_groups(model, no_decay_lr=None):
    """The optimizer parameter groups the Hugging Face Trainer builds: weight decay on matrices, none
    on norm weights and biases; ``no_decay_lr`` gives the second group a learning rate of its own."""
    no_decay = {"params": [param for param in model.parameters() if param.dim() < 2], "weight_decay": 0.0}
    if no_decay_lr is not None:
        no_decay["lr"] = no_decay_lr
    return [{"params": [param for param in model.parameters() if param.dim() >= 2], "weight_decay": 0.1}, no_decay]


def param_group_hyperparameters(engine):
    """Each optimizer parameter group's hyperparameters (all but its parameters)."""
    return [{
        key: value
        for key, value in group.items() if key != "params"
    } for group in engine.optimizer.optimizer.param_groups]


def ds_config(stage, tp_size, dtype=torch.float32, load_universal=False):
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1,
        # The default (1.0) would clip differently per topology: the reference does not clip.
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "torch_adam": True,
                # DeepSpeed's "Adam" is AdamW (torch's default weight decay 0.01) unless this is off;
                # the reference trains with torch.optim.Adam.
                "adam_w_mode": False
            }
        },
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True
        },
        "tensor_parallel": {
            "autotp_size": tp_size
        },
        "checkpoint": {
            "load_universal": load_universal
        },
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    return config


def global_batches(steps, vocab_size):
    generator = torch.Generator().manual_seed(SEED + 1)
    return [torch.randint(0, vocab_size, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(steps)]


def dp_slice(batch, dp_rank, dp_size):
    per_rank = batch.shape[0] // dp_size
    return batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def initialize(stage, tp_size, uneven=False, dtype=torch.float32, load_universal=False):
    model = build_model(uneven)
    config = ds_config(stage, tp_size, dtype=dtype, load_universal=load_universal)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def dp_rank_and_size(tp_size):
    """AutoTP groups consecutive ranks into one tensor-parallel group."""
    return dist.get_rank() // tp_size, dist.get_world_size() // tp_size


def train_engine(engine, tp_size, steps, uneven=False, first_step=0):
    """Runs ``steps`` steps on the global batches ``first_step`` onwards; returns the losses of the
    whole global batch (averaged over the data-parallel ranks)."""
    dp_rank, dp_size = dp_rank_and_size(tp_size)
    batches = global_batches(first_step + steps, llama_config(uneven).vocab_size)[first_step:]
    losses = []
    for batch in batches:
        ids = dp_slice(batch, dp_rank, dp_size).to(get_accelerator().current_device_name())
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().float().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / dist.get_world_size())
    return losses


def train_reference(steps, uneven=False, make_optimizer=None):
    """The same model trained in this process alone, on the whole global batches, with torch's Adam
    (what ``torch_adam: True`` with ``adam_w_mode: False`` runs inside DeepSpeed), or the optimizer
    ``make_optimizer(model)`` builds. Returns the model and its losses."""
    model = build_model(uneven)
    optimizer = make_optimizer(model) if make_optimizer else torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(steps, llama_config(uneven).vocab_size):
        # The mean of the per-rank mean losses: every rank holds the same number of tokens.
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def convert_to_universal_checkpoint(input_folder, output_folder, inject_missing_state=False):
    """``ds_to_universal --input_folder input_folder --output_folder output_folder``, in this process
    (with ``--inject_missing_state``, which deepspeed 0.19.8 needs for a checkpoint without
    ``universal_checkpoint_info``, if ``inject_missing_state``)."""
    from deepspeed.checkpoint.ds_to_universal import main
    main(
        argparse.Namespace(input_folder=input_folder,
                           output_folder=output_folder,
                           num_extract_workers=1,
                           num_merge_workers=1,
                           keep_temp_folder=False,
                           strict=True,
                           inject_missing_state=inject_missing_state))


def forget_saved_files(tag_dir):
    """Remove the record of which files the save of the tag in ``tag_dir`` wrote, if it has one, as for
    a checkpoint whose files were changed by hand: loads refuse a file that is not the one saved."""
    manifest = os.path.join(tag_dir, "checkpoint_manifest.json")
    if os.path.exists(manifest):
        os.remove(manifest)


def run_source_test(request, node, cache_env, cache, done_file):
    """Run the test ``node`` of this test's file (one that saves a source checkpoint into the session's
    ``cache``) in a pytest subprocess, for a test selected without it; ``done_file`` is what it writes
    last."""
    test_id = f"{request.node.path}::{node}"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
                          cwd=str(request.config.invocation_params.dir),
                          env=dict(os.environ, **{cache_env: cache}),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    assert proc.returncode == 0 and os.path.isfile(done_file), proc.stdout
