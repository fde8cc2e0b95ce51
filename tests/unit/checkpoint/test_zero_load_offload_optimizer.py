# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO checkpoint resumes with the optimizer offloaded to the CPU, or no longer offloaded, as users
switch ``offload_optimizer`` on to fit a larger model, or off for speed, between runs: DeepSpeed's CPU
Adam resumes the checkpoint of torch's Adam on the same 2 ranks, and torch's Adam that of CPU Adam on
1 rank, at ZeRO-2 and -3, with the Hugging Face Trainer's two parameter groups (and at ZeRO-3 in
bf16 with tied input and output embeddings, into CPU Adam). Right after the load the gathered
optimizer states, the step counts and each group's saved hyperparameters are the saved ones, and
the next losses are those of the run that went on uninterrupted.

Before, each of these loads succeeded and the next step failed. On the same ranks (deepspeed 0.19.8
too) torch's ``load_state_dict`` put torch's Adam's groups in place of CPU Adam's, which then had no
``bias_correction`` (``KeyError``). On another number of ranks the load restored CPU Adam's step
count, a number, where torch's Adam keeps a tensor (``RuntimeError: ... `state_steps` argument must
contain a list of singleton tensors``).
"""

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint import zero_load_common
from unit.checkpoint.zero_load_common import load_and_train, save

# The fixtures: the folder the source checkpoints are saved in, once per session, and a test's source.
cache = zero_load_common.cache
saved = zero_load_common.saved

# Each source checkpoint: stage, tp, dp, dtype, optimizer (torch's Adam, or DeepSpeed's CPU Adam
# with the optimizer offloaded).
SOURCES = {
    f"stage{stage}-tp1dp2-{optimizer}": (stage, 1, 2, torch.float32, optimizer)
    for stage in (2, 3)
    for optimizer in ("adam", "cpu_adam")
}
# bf16, with the output embeddings tied to the input embeddings.
SOURCES["stage3-tp1dp2-adam-tied-bf16"] = (3, 1, 2, torch.bfloat16, "adam", "tied")


class TestSave(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws2(self, source, cache):
        save(cache, source, SOURCES[source])

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-adam", "stage3-tp1dp2-adam", "stage3-tp1dp2-adam-tied-bf16"])
    def test_offload_on(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=2, optimizer="cpu_adam")


class TestLoad(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("source", ["stage2-tp1dp2-cpu_adam", "stage3-tp1dp2-cpu_adam"])
    def test_offload_off(self, source, saved):
        load_and_train(saved, SOURCES[source], dp_size=1, optimizer="adam")
