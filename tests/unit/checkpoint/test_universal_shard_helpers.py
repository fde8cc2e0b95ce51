# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Each rank cuts its part out of a whole tensor of a universal checkpoint in three steps.

``_universal_tp_shards()`` (``deepspeed/checkpoint/universal_checkpoint.py``) takes, for each state
of a parameter: this expert-parallel rank's experts of an expert parameter (``_expert_partition()``),
a vocabulary padded for the tensor-parallel size (``_padded_vocab()``), and this rank's
tensor-parallel slice (``_tp_slice()``). Here: the fused QKV weight of a GPT layer at
tensor-parallel size 2, whose query, key and value are each split; an embedding of 10 tokens at
tensor-parallel size 4, padded to 12; and 4 experts at expert-parallel size 2.
"""

import torch

from deepspeed.checkpoint.constants import CAT_DIM, EP_NUM_EXPERTS, PARAM, PARAM_N_SUB_PARAMS
from deepspeed.checkpoint.universal_checkpoint import _expert_partition, _padded_vocab, _tp_slice

HIDDEN = 4


def test_fused_qkv_slice_holds_each_ranks_part_of_query_key_and_value():
    query, key, value = (torch.randn(2 * HIDDEN, HIDDEN) for _ in range(3))
    full = torch.cat([query, key, value])
    ckpt_dict = {PARAM: full, CAT_DIM: 0, PARAM_N_SUB_PARAMS: 3}
    rank_param = torch.empty(3 * HIDDEN, HIDDEN)
    for tp_rank in range(2):
        rows = slice(tp_rank * HIDDEN, (tp_rank + 1) * HIDDEN)
        expected = torch.cat([query[rows], key[rows], value[rows]]).flatten()
        assert torch.equal(_tp_slice(rank_param, "qkv.pt", ckpt_dict, full, tp_rank, 2), expected)


def test_vocabulary_is_padded_for_the_tensor_parallel_size():
    full = torch.randn(10, HIDDEN)
    padded = _padded_vocab(torch.empty(3, HIDDEN), full, tp_world_size=4)
    assert padded.shape == (12, HIDDEN)
    assert torch.equal(padded[:10], full) and not padded[10:].any()


def test_expert_parallel_rank_takes_its_experts():
    full = torch.arange(4 * 2 * HIDDEN, dtype=torch.float32).view(4, 2, HIDDEN)
    rank_param = torch.empty(2, 2, HIDDEN)
    assert torch.equal(_expert_partition(rank_param, "w1.pt", {EP_NUM_EXPERTS: 4}, full, 1, 2), full[2:])
    assert torch.equal(_expert_partition(rank_param, "w1.pt", {EP_NUM_EXPERTS: 4}, full, 0, 1), full)
