# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint whose ranks read files that other ranks do not is refused on every rank before
anything is loaded when one of its files is bad.

Pipeline stages read their own layers' files, and expert-parallel ranks their own experts' files, so
a bad file is read by some ranks only. Each case flips one bit in a file that only rank 1 reads; a
job that loads the checkpoint must raise on both ranks, naming the file and its record, with the
module's weights unchanged, well within the test's timeout (and, unchanged, it loads). Before, each rank verified the files it
read as it read them: rank 1 raised, after it had loaded some layers, and rank 0 loaded the
checkpoint and went on.

With node-local storage each node reads copies of its own: a universal checkpoint staged onto the
disks of two nodes (of one rank each), with one bit flipped in the second node's copy of a
parameter's states, must be refused on both. Before, the ranks shared the files to verify across
nodes, and the second node loaded its bad copy unchecked.
"""

import os
import shutil

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.moe.layer import MoE
from deepspeed.pipe import LayerSpec, PipelineModule

from unit.checkpoint.autotp_common import convert_to_universal_checkpoint
from unit.checkpoint import test_checkpoint_node_local_verify as node_local
from unit.checkpoint.test_checkpoint_crc32 import flip_bit
from unit.checkpoint.test_checkpoint_killed_save import full_weights
from unit.common import DistributedTest

HIDDEN = 16


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
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
    }


def batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, HIDDEN, generator=generator), torch.randn(2, HIDDEN, generator=generator)


def pipeline_engine():
    torch.manual_seed(0)
    layers = [LayerSpec(torch.nn.Linear, HIDDEN, HIDDEN) for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(1))
    return engine


class MoEModel(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN,
                       expert=torch.nn.Linear(HIDDEN, HIDDEN),
                       num_experts=2,
                       ep_size=2,
                       k=1,
                       min_capacity=0)

    def forward(self, x, y):
        hidden, _, _ = self.moe(self.linear(x))
        return torch.nn.functional.mse_loss(hidden, y)


def moe_engine():
    torch.manual_seed(0)
    model = MoEModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(2))
    return engine


def train_step(engine):
    if isinstance(engine.module, PipelineModule):
        engine.train_batch(iter([batch()]))
    else:
        engine.backward(engine(*batch()))
        engine.step()


class TestPipelineMoEFileCheck(DistributedTest):
    world_size = 2
    reuse_dist_env = True
    # A rank left waiting for another that raised fails the test here, not after the default 600 s.
    exec_timeout = 120

    @pytest.mark.parametrize("kind, changed_name", [("pipeline", "layer_03-model_states.pt"),
                                                    ("moe", "layer_0_expert_1_mp_rank_00_model_states.pt")])
    def test_bad_file_is_refused_on_every_rank(self, kind, changed_name, tmpdir):
        make_engine = pipeline_engine if kind == "pipeline" else moe_engine
        save_dir = str(tmpdir)
        engine = make_engine()
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="step1")
        # Checked whole, the checkpoint loads as it did.
        loaded = make_engine()
        loaded.load_checkpoint(save_dir, tag="step1")
        for name, tensor in full_weights(engine).items():
            assert torch.equal(loaded.module.state_dict()[name], tensor), name
        dist.barrier()

        changed = os.path.join(save_dir, "step1", changed_name)
        if dist.get_rank() == 0:
            flip_bit(changed)
        dist.barrier()

        fresh = make_engine()
        weights = full_weights(fresh)
        with pytest.raises(ValueError, match=f"{changed} \\(record '.*fails its CRC-32 check"):
            fresh.load_checkpoint(save_dir, tag="step1")
        for name, tensor in full_weights(fresh).items():
            assert torch.equal(tensor, weights[name]), name


def test_each_node_verifies_its_own_universal_copies(tmp_path):
    for node_rank in range(2):
        (tmp_path / f"node{node_rank}" / "ckpt").mkdir(parents=True)
    node_local.run_nodes(tmp_path, "save")
    # Every node's disk gets the whole checkpoint, and the universal checkpoint converted from it.
    folders = [tmp_path / f"node{node_rank}" / "ckpt" for node_rank in range(2)]
    shutil.copytree(folders[1], folders[0], dirs_exist_ok=True)
    convert_to_universal_checkpoint(str(folders[0] / "step1"), str(folders[0] / "universal"))
    shutil.copytree(folders[0], folders[1], dirs_exist_ok=True)
    # The first of the states' files: the first node's share when the ranks shared the world's files.
    changed = min((folders[1] / "universal" / "zero").rglob("*.pt"))
    flip_bit(str(changed))

    outputs = node_local.run_nodes(tmp_path, "load-universal")
    for node_rank, output in enumerate(outputs):
        refusal = next((line for line in output.splitlines() if f"rank {node_rank}: refused: " in line), output)
        assert f"ckpt/universal/zero/{changed.parent.name}/{changed.name} (record " in refusal, refusal
        assert "fails its CRC-32 check" in refusal, refusal
