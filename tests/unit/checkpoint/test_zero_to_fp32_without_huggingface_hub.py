# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ``zero_to_fp32.py`` script saved into a checkpoint, run as users run it on a fresh install of
deepspeed, which does not depend on ``huggingface_hub``: with its default options it writes
``pytorch_model.bin``, and with a small ``--max_shard_size`` the shards and the index that
``huggingface_hub``'s ``split_torch_state_dict_into_shards()`` gives (tied weights included), with
the model's fp32 weights.

On deepspeed 0.19.8 both runs fail with ``ModuleNotFoundError: No module named 'huggingface_hub'``.
"""

import json
import os
import subprocess
import sys

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

from unit.common import DistributedTest

TAG = "step1"


def without_packages(*packages):
    """Python source that makes importing ``packages`` fail, as on an install of deepspeed without them."""
    return f"""
import sys
class WithoutPackages:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {packages!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, WithoutPackages())
"""


# Runs the script that follows it on the command line, as `python script.py ...` does.
RUN_SCRIPT = """
import runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(checkpoint_dir, output_dir, *options):
    script = os.path.join(checkpoint_dir, "zero_to_fp32.py")
    command = [sys.executable, "-c", without_packages("huggingface_hub") + RUN_SCRIPT, script]
    result = subprocess.run(command + [checkpoint_dir, output_dir, *options], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


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
                    tie_word_embeddings=True))


class TestZeroToFp32WithoutHuggingfaceHub(DistributedTest):
    world_size = 2
    reuse_dist_env = True

    def test(self, tmpdir):
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-2,
                    "torch_adam": True
                }
            },
            "zero_optimization": {
                "stage": 2
            },
        }
        model = build_model()
        engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
        ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        checkpoint_dir = str(tmpdir.join("checkpoint"))
        engine.save_checkpoint(checkpoint_dir, tag=TAG)
        dist.barrier()
        if dist.get_rank() == 0:
            expected = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=TAG)

            output_dir = str(tmpdir.join("fp32"))
            run_script(checkpoint_dir, output_dir)
            state_dict = torch.load(os.path.join(output_dir, "pytorch_model.bin"), weights_only=True)
            assert sorted(state_dict) == sorted(expected)
            for name, tensor in expected.items():
                assert torch.equal(state_dict[name], tensor), name

            # 20KB: the embedding (8 KB), tied to lm_head, and the layers' weights fill several shards.
            from huggingface_hub import split_torch_state_dict_into_shards
            split = split_torch_state_dict_into_shards(to_torch_tensor(expected, return_empty_tensor=True),
                                                       filename_pattern="pytorch_model{suffix}.bin",
                                                       max_shard_size="20KB")
            assert split.is_sharded
            sharded_dir = str(tmpdir.join("fp32-sharded"))
            run_script(checkpoint_dir, sharded_dir, "--max_shard_size", "20KB")
            with open(os.path.join(sharded_dir, "pytorch_model.bin.index.json")) as f:
                index = json.load(f)
            assert index["metadata"]["total_size"] == split.metadata["total_size"]
            assert index["weight_map"] == split.tensor_to_filename
            for filename, names in split.filename_to_tensors.items():
                shard = torch.load(os.path.join(sharded_dir, filename), weights_only=True)
                assert sorted(shard) == sorted(names), filename
                for name in names:
                    assert torch.equal(shard[name], expected[name]), name
        dist.barrier()
        engine.destroy()
