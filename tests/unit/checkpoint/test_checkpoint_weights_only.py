# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Loading a checkpoint never runs code from it.

A checkpoint is a set of pickles. ``load_checkpoint`` and ``zero_to_fp32`` load them with
``weights_only=True``, admitting only what DeepSpeed itself saves (and what Megatron-DeepSpeed-style
scripts put in ``client_state``). A checkpoint whose model-state or optimizer file carries a pickled
object whose ``__reduce__`` creates a file (a stand-in for any code) is refused, naming the global,
before anything is loaded: the file is never created and the engine keeps its weights.
``"checkpoint": {"weights_only": false}`` and ``--no_weights_only`` load a checkpoint the user
trusts as before (upstream issue #8500: DeepSpeed's own checkpoints did not load under
``weights_only=True``).

On deepspeed 0.19.8 every reader unpickles with ``weights_only=False``, and the payload runs.
"""

import argparse
import io
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.common import DistributedTest

SEQ_LEN = 8


class Payload:
    """What a hostile checkpoint carries: unpickling it creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(42)
    config = LlamaConfig(vocab_size=64,
                         hidden_size=32,
                         intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2,
                         max_position_embeddings=SEQ_LEN)
    return LlamaForCausalLM(config)


def initialize(zero_stage, weights_only=True):
    model = build_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": zero_stage
        },
        "checkpoint": {
            "weights_only": weights_only
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


def train_step(engine):
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 64, (2, SEQ_LEN), generator=generator).to(get_accelerator().current_device_name())
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def full_weights(engine):
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().cpu().clone() for name, param in params.items()}


def assert_weights_equal(engine, expected):
    actual = full_weights(engine)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def megatron_client_state():
    """What Megatron-DeepSpeed saves beside the model: its arguments and every RNG state (the same
    on every rank: at ZeRO-1/2 only rank 0 writes the model-state file)."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    return {
        "args":
        argparse.Namespace(seq_length=SEQ_LEN, lr=1e-2, tokenizer_type="GPT2BPETokenizer"),
        "iteration":
        1,
        "rng_state": [{
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
        }],
    }


def plant_payload(tag_dir, file_name, marker):
    """Add a pickled payload to one rank file of a copy of a checkpoint tag."""
    path = os.path.join(tag_dir, file_name)
    state = torch.load(path, weights_only=False)
    state["payload"] = Payload(marker)
    torch.save(state, path)
    # A tag that records which files its save wrote refuses a file changed since: forget the record.
    manifest = os.path.join(tag_dir, "checkpoint_manifest.json")
    if os.path.exists(manifest):
        os.remove(manifest)


def rank_file_names(zero_stage):
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
    return {"model": model_file, "optimizer": "zero_pp_rank_0_mp_rank_00_optim_states.pt"}


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
class TestCheckpointWeightsOnly(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test_payload_is_refused_before_anything_is_loaded(self, tmpdir, zero_stage):
        save_dir = str(tmpdir)
        marker = os.path.join(save_dir, "payload_ran")
        engine = initialize(zero_stage)
        train_step(engine)
        client_state = megatron_client_state()
        engine.save_checkpoint(save_dir, tag="good", client_state=client_state)
        saved = full_weights(engine)

        files = rank_file_names(zero_stage)
        if dist.get_rank() == 0:
            for kind, file_name in files.items():
                shutil.copytree(os.path.join(save_dir, "good"), os.path.join(save_dir, kind))
                plant_payload(os.path.join(save_dir, kind), file_name, marker)
        dist.barrier()

        fresh = initialize(zero_stage)
        initial = full_weights(fresh)
        for kind, file_name in files.items():
            # The tag with the payload is the one `latest` names, as a downloaded checkpoint's is.
            if dist.get_rank() == 0:
                with open(os.path.join(save_dir, "latest"), "w") as fd:
                    fd.write(kind)
            dist.barrier()
            with pytest.raises(pickle.UnpicklingError, match=f"{file_name} needs io.open"):
                fresh.load_checkpoint(save_dir, tag=kind)
            if kind == "model" or zero_stage == 3:
                # ZeRO-3 rebuilds the weights from the optimizer files when it loads no optimizer states.
                with pytest.raises(pickle.UnpicklingError, match="io.open"):
                    fresh.load_checkpoint(save_dir, tag=kind, load_optimizer_states=False)
            assert_weights_equal(fresh, initial)
            assert fresh.global_steps == 0
            if dist.get_rank() == 0:
                with pytest.raises(pickle.UnpicklingError, match="io.open"):
                    get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=kind)
            dist.barrier()
            assert not os.path.exists(marker), f"the payload in the {kind} file ran"

        # Without a payload, DeepSpeed's own objects and a Megatron-style client_state load by default.
        _, loaded_client_state = fresh.load_checkpoint(save_dir, tag="good")
        assert_weights_equal(fresh, saved)
        assert fresh.global_steps == 1
        assert loaded_client_state["args"] == client_state["args"]
        loaded_rng, saved_rng = loaded_client_state["rng_state"][0], client_state["rng_state"][0]
        assert loaded_rng["random_rng_state"] == saved_rng["random_rng_state"]
        assert np.array_equal(loaded_rng["np_rng_state"][1], saved_rng["np_rng_state"][1])
        assert torch.equal(loaded_rng["torch_rng_state"], saved_rng["torch_rng_state"])
        if dist.get_rank() == 0:
            state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="good")
            assert state_dict.keys() == saved.keys()
        dist.barrier()

        # A checkpoint the user trusts loads as before, with the one config key.
        trusting = initialize(zero_stage, weights_only=False)
        trusting.load_checkpoint(save_dir, tag="optimizer")
        assert_weights_equal(trusting, saved)
        dist.barrier()
        assert os.path.exists(marker)


class TestZeroToFp32WeightsOnlyFlag(DistributedTest):
    world_size = 1

    def test_zero_to_fp32_refuses_a_payload_unless_told_to_trust_it(self, tmpdir):
        """zero_to_fp32 as users run it: refused, then --no_weights_only."""
        save_dir = str(tmpdir)
        marker = os.path.join(save_dir, "payload_ran")
        engine = initialize(zero_stage=2)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="step1")
        plant_payload(os.path.join(save_dir, "step1"), rank_file_names(2)["optimizer"], marker)

        def run(module, *args):
            return subprocess.run([sys.executable, "-m", module, *args],
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT,
                                  text=True,
                                  timeout=300)

        # What torch admits loads too: a global the user registers, here the payload's own.
        with torch.serialization.safe_globals([io.open]):
            get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="step1")
        assert os.path.exists(marker)
        os.remove(marker)

        refused = run("deepspeed.utils.zero_to_fp32", save_dir, os.path.join(save_dir, "fp32"))
        assert refused.returncode != 0 and "io.open" in refused.stdout, refused.stdout
        assert "--no_weights_only" in refused.stdout
        assert not os.path.exists(marker)
        trusted = run("deepspeed.utils.zero_to_fp32", save_dir, os.path.join(save_dir, "fp32"), "--no_weights_only")
        assert trusted.returncode == 0, trusted.stdout
        assert os.path.exists(marker)


class TestTrustedLoadInOneThread(DistributedTest):
    world_size = 1

    def test_other_threads_keep_the_check(self, tmpdir):
        """A job resumes from its own checkpoint with "weights_only": false while another thread of
        the process (an evaluation service, say) reads a downloaded checkpoint: that read is still
        checked, and the payload of the downloaded checkpoint does not run."""
        save_dir = str(tmpdir)
        marker = os.path.join(save_dir, "payload_ran")
        engine = initialize(zero_stage=2)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="own")
        engine.save_checkpoint(save_dir, tag="downloaded")
        plant_payload(os.path.join(save_dir, "downloaded"), rank_file_names(2)["optimizer"], marker)
        saved = full_weights(engine)

        other_reads = []

        def read_downloaded():
            try:
                get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="downloaded")
                other_reads.append("loaded")
            except pickle.UnpicklingError as e:
                other_reads.append(str(e))

        def load_while_another_thread_reads(src, dst):
            # load_checkpoint() calls this within the load that trusts its checkpoint.
            reader = threading.Thread(target=read_downloaded)
            reader.start()
            reader.join()
            dst.load_state_dict(src)

        trusting = initialize(zero_stage=2, weights_only=False)
        trusting.load_checkpoint(save_dir, tag="own", custom_load_fn=load_while_another_thread_reads)
        assert len(other_reads) == 1 and "io.open" in other_reads[0], other_reads
        assert not os.path.exists(marker)
        assert_weights_equal(trusting, saved)
