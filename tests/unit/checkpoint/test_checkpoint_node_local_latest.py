# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""With node-local storage every node reads its own ``latest``: a load refuses them when they differ.

Two nodes of one rank each (each rank its own node's local rank 0, each saving to a folder of its
own) save ``global_step1`` and ``global_step2`` with ``"use_node_local_storage": true``. The second
node's ``latest`` is then left on ``global_step1``, as a job killed between the two nodes' writes of
it leaves it, or removed, as on a node that never wrote one. ``load_checkpoint(dir)`` must raise on
every rank, naming each node's tag, with the weights unchanged: before, the first node loaded
``global_step2`` and the second ``global_step1`` (or nothing), without a word. Nodes that agree load
the tag as before, and so does a load from a shared filesystem; ``latest_universal`` is checked the
same way.
"""

import os

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.test_checkpoint_killed_save import full_weights as weights
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest


def make_engine(node_local, load_universal=False):
    if node_local:
        # Every rank is the first (and only) rank of a node of its own.
        os.environ["LOCAL_RANK"] = "0"
    return initialize(1, node_local=node_local, load_universal=load_universal)


def save_two_tags(save_dir, node_local):
    engine = make_engine(node_local)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step1")
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step2")
    return weights(engine)


def node_folder(tmpdir):
    """This rank's node's disk."""
    folder = os.path.join(str(tmpdir), f"node{dist.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    return folder


class TestNodeLocalLatest(DistributedTest):
    world_size = 2
    reuse_dist_env = True
    # A rank left waiting for another that did not raise fails the test here, not after 600 s.
    exec_timeout = 120

    @pytest.mark.parametrize("second_node_latest", ["global_step1", None])
    def test_disagreement_is_refused_on_every_rank(self, second_node_latest, tmpdir):
        save_dir = node_folder(tmpdir)
        save_two_tags(save_dir, node_local=True)
        latest = os.path.join(save_dir, "latest")
        with open(latest) as fd:
            assert fd.read() == "global_step2"
        dist.barrier()
        if dist.get_rank() == 1:
            if second_node_latest is None:
                os.remove(latest)
            else:
                with open(latest, "w") as fd:
                    fd.write(second_node_latest)
        dist.barrier()

        fresh = make_engine(node_local=True)
        before = weights(fresh)
        with pytest.raises(ValueError, match="does not name the same tag on every node") as err:
            fresh.load_checkpoint(save_dir)
        message = str(err.value)
        assert "'global_step2' on the node of rank 0" in message, message
        second = "no latest" if second_node_latest is None else f"'{second_node_latest}'"
        assert f"{second} on the node of rank 1" in message, message
        assert fresh.global_steps == 0
        for name, tensor in weights(fresh).items():
            assert torch.equal(tensor, before[name]), name

    @pytest.mark.parametrize("node_local", [True, False], ids=["node-local", "shared"])
    def test_latest_that_agrees_is_loaded(self, node_local, tmpdir):
        save_dir = node_folder(tmpdir) if node_local else str(tmpdir)
        saved = save_two_tags(save_dir, node_local)
        fresh = make_engine(node_local)
        load_path, _ = fresh.load_checkpoint(save_dir)
        assert os.path.basename(os.path.dirname(load_path)) == "global_step2", load_path
        for name, tensor in weights(fresh).items():
            assert torch.equal(tensor, saved[name]), name

    def test_latest_universal_disagreement_is_refused(self, tmpdir):
        save_dir = node_folder(tmpdir)
        # What ds_to_universal leaves on each node; no node reads further than its latest_universal.
        with open(os.path.join(save_dir, "latest_universal"), "w") as fd:
            fd.write(f"global_step{2 - dist.get_rank()}_universal")
        engine = make_engine(node_local=True, load_universal=True)
        with pytest.raises(ValueError, match="does not name the same tag on every node") as err:
            engine.load_checkpoint(save_dir)
        message = str(err.value)
        assert ("'global_step2_universal' on the node of rank 0, "
                "'global_step1_universal' on the node of rank 1") in message, message
