# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO checkpoint resumes on the ranks that saved it, into an optimizer whose parameter groups
hold the same parameters in another order or in other groups: groups built from a set, or a recipe
that no longer decays the input embeddings. Each parameter gets its own fp32 weights and optimizer
states, each group the saved group's hyperparameters; with the order alone changed, the next losses
are those of the run that went on uninterrupted. ZeRO-2 and -3 with tied input and output embeddings,
and ZeRO-1 in bf16 (the BF16 optimizer), on 2 ranks.

Before, the load of the optimizer states was refused, the flat partitions laying the parameters out
otherwise (on deepspeed 0.19.8, every parameter took other parameters' weights and moments,
silently).
"""

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.autotp_common import param_group_hyperparameters, train_engine, trainer_param_groups
from unit.checkpoint.zero_load_common import (SAVE_STEPS, TAG, assert_states_saved, initialize, load_and_train, save)

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer, and "tied" for tied input and output
# embeddings.
SOURCES = {
    "stage2-tp1dp2-tied": (2, 1, 2, torch.float32, "adam", "tied"),
    "stage3-tp1dp2-tied": (3, 1, 2, torch.float32, "adam", "tied"),
    "stage1-tp1dp2-bf16": (1, 1, 2, torch.bfloat16, "adam"),
}


def reversed_param_groups(model):
    """The Trainer's groups, each with its parameters in the reverse order."""
    return [dict(group, params=group["params"][::-1]) for group in trainer_param_groups(model)]


def embeddings_without_decay(model):
    """The Trainer's groups with the input embeddings moved to the group without weight decay."""
    decay, no_decay = trainer_param_groups(model)
    embeddings = model.get_input_embeddings().weight
    decay["params"] = [param for param in decay["params"] if param is not embeddings]
    no_decay["params"].insert(0, embeddings)
    return [decay, no_decay]


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_reordered(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=2, param_groups=reversed_param_groups)

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-tied", "stage3-tp1dp2-tied"])
    def test_regrouped(self, source, saved):
        stage, tp_size, _, dtype, optimizer, *model = SOURCES[source]
        engine = initialize(stage,
                            tp_size,
                            dtype,
                            optimizer,
                            tied="tied" in model,
                            param_groups=embeddings_without_decay)
        engine.load_checkpoint(saved, tag=TAG)
        expected = assert_states_saved(engine, saved, optimizer, tp_size)
        assert param_group_hyperparameters(engine) == expected["param_groups"]
        train_engine(engine, tp_size, 1, first_step=SAVE_STEPS)
        engine.destroy()
