# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``zero_to_fp32`` as an offline tool: the script saved into a checkpoint works on a fresh install
(without ``huggingface_hub`` or ``safetensors``, which deepspeed does not depend on) with every
output option, in the layout Hugging Face loaders read; a run killed half way leaves nothing a
loader accepts, and a rerun succeeds; every rank converting into one folder at once gives one
complete output; a file in the way that the tool did not write is refused, untouched; an
incomplete checkpoint is refused with an error that names the file.

On deepspeed 0.19.8 the script fails on a fresh install with ``ModuleNotFoundError: No module
named 'huggingface_hub'`` (its default ``--max_shard_size 5GB``), and the tp2 checkpoint used here
is refused outright (``Expected 1 of '*_optim_states.pt' ... found 2``).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                          get_fp32_state_dict_from_zero_checkpoint)

from unit.common import DistributedTest
from unit.checkpoint.autotp_common import initialize, llama_config, train_engine, train_reference
from unit.checkpoint.test_zero_to_fp32_without_huggingface_hub import RUN_SCRIPT, without_packages

STEPS = 2
TAG = "step2"
ATOL = 2e-3  # see test_autotp_zero_to_fp32.py
SHARD = "100KB"  # the model is 0.36 MB in fp32: several shards

# Makes `import huggingface_hub` and `import safetensors` fail, as on a fresh install of deepspeed.
FRESH_INSTALL = without_packages("huggingface_hub", "safetensors")

# Runs the saved script in a process that is SIGKILLed the N-th time it renames a finished file into
# place, i.e. half way through writing its output.
KILLED_RUN = FRESH_INSTALL + """
import os, signal
when, count = sys.argv.pop(1), int(sys.argv.pop(1))
calls = []
original = getattr(os, when)
def killing(*args, **kwargs):
    calls.append(1)
    if len(calls) == count:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(*args, **kwargs)
setattr(os, when, killing)
""" + RUN_SCRIPT


def run_script(save_dir, output_dir, *options, killed_at=None):
    script = os.path.join(save_dir, "zero_to_fp32.py")
    if killed_at is None:
        command = [sys.executable, "-c", FRESH_INSTALL + RUN_SCRIPT, script]
    else:
        command = [sys.executable, "-c", KILLED_RUN, *map(str, killed_at), script]
    result = subprocess.run(command + [save_dir, output_dir, *options], capture_output=True, text=True)
    if killed_at is None:
        assert result.returncode == 0, result.stdout + result.stderr
    else:
        assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    return result


def load_with_transformers(output_dir):
    from transformers import LlamaForCausalLM
    llama_config(uneven=True).save_pretrained(output_dir)
    return LlamaForCausalLM.from_pretrained(output_dir, dtype=torch.float32).state_dict()


def assert_matches_reference(state_dict, reference):
    assert {k: tuple(v.shape) for k, v in state_dict.items()} == {k: tuple(v.shape) for k, v in reference.items()}
    for name, expected in reference.items():
        torch.testing.assert_close(state_dict[name].float(), expected, rtol=0, atol=ATOL, msg=name)


# The files zero_to_fp32 wrote into an output folder, the only ones it may replace or remove.
MANIFEST = ".zero_to_fp32.json"


def output_files(output_dir):
    return sorted(name for name in os.listdir(output_dir) if name not in ("config.json", MANIFEST))


class TestZeroToFp32Offline(DistributedTest):
    """A tp2 ZeRO-3 checkpoint of the small Llama (uneven splits) at world size 2."""
    world_size = 2
    reuse_dist_env = True

    def test(self, tmpdir):
        engine = initialize(3, 2, uneven=True)
        train_engine(engine, 2, STEPS, uneven=True)
        save_dir = str(tmpdir.join("checkpoint"))
        engine.save_checkpoint(save_dir, tag=TAG)
        dist.barrier()
        # Every rank converts into the same folder, as training scripts often do.
        every_rank = {str(tmpdir.join("every-rank")): "5GB", str(tmpdir.join("every-rank-sharded")): SHARD}
        for output_dir, max_shard_size in every_rank.items():
            convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, max_shard_size=max_shard_size)
        dist.barrier()
        if dist.get_rank() == 0:
            reference = train_reference(STEPS, uneven=True)[0].state_dict()
            for output_dir in every_rank:
                assert not [name for name in os.listdir(output_dir) if name.endswith(".tmp")]
                assert_matches_reference(load_with_transformers(output_dir), reference)
            self.fresh_install_outputs(save_dir, str(tmpdir), reference)
            self.killed_runs(save_dir, str(tmpdir), reference)
            self.files_of_others(save_dir, str(tmpdir), reference)
            self.incomplete_checkpoints(save_dir)
        dist.barrier()
        engine.destroy()

    def fresh_install_outputs(self, save_dir, tmpdir, reference):
        # The script's defaults: one pytorch_model.bin (under the default 5GB shard size).
        output_dir = os.path.join(tmpdir, "bin")
        result = run_script(save_dir, output_dir)
        assert "Saving checkpoint shards: 100%" in result.stderr
        assert output_files(output_dir) == ["pytorch_model.bin"]
        with open(os.path.join(output_dir, MANIFEST)) as f:
            assert json.load(f) == ["pytorch_model.bin"]
        assert zipfile.ZipFile(os.path.join(output_dir, "pytorch_model.bin")).testzip() is None
        assert_matches_reference(torch.load(os.path.join(output_dir, "pytorch_model.bin")), reference)
        assert_matches_reference(load_with_transformers(output_dir), reference)

        # Sharded safetensors.
        output_dir = os.path.join(tmpdir, "safetensors")
        run_script(save_dir, output_dir, "--safe_serialization", "--max_shard_size", SHARD)
        files = output_files(output_dir)
        shards = [name for name in files if name.endswith(".safetensors")]
        assert len(shards) > 1 and files == shards + ["model.safetensors.index.json"]
        assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        assert_matches_reference(load_with_transformers(output_dir), reference)

        # One safetensors file, and sharded .bin, through the API (in this process, where both
        # libraries are importable: the files do not depend on them, only the loader does).
        for options, expected in (({
                "safe_serialization": True,
                "max_shard_size": None
        }, ["model.safetensors"]), ({
                "max_shard_size": SHARD
        }, None)):
            output_dir = os.path.join(tmpdir, "api-" + "-".join(map(str, options.values())))
            convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, **options)
            files = output_files(output_dir)
            if expected is None:
                shards = files[:-1]
                assert len(shards) > 1 and files[-1] == "pytorch_model.bin.index.json"
                assert shards == [f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin" for i in range(1, len(shards) + 1)]
                for shard in shards:
                    assert zipfile.ZipFile(os.path.join(output_dir, shard)).testzip() is None
            else:
                assert files == expected
            assert_matches_reference(load_with_transformers(output_dir), reference)

    def killed_runs(self, save_dir, tmpdir, reference):
        from transformers import LlamaForCausalLM

        # A sharded run into a folder that holds a complete earlier output, killed after its second
        # shard is in place: neither the old nor the new output may load, the rerun must.
        output_dir = os.path.join(tmpdir, "killed-sharded")
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, max_shard_size=SHARD)
        run_script(save_dir, output_dir, "--max_shard_size", "150KB", killed_at=("replace", 3))  # 1: the manifest
        assert "pytorch_model.bin.index.json" not in output_files(output_dir)
        llama_config(uneven=True).save_pretrained(output_dir)
        with pytest.raises(OSError):
            LlamaForCausalLM.from_pretrained(output_dir)
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, max_shard_size="150KB")
        assert not [name for name in os.listdir(output_dir) if name.endswith(".tmp")]
        assert_matches_reference(load_with_transformers(output_dir), reference)

        # One safetensors file, killed when it is written, before it is renamed into place: only a
        # temporary file, no model.safetensors.
        output_dir = os.path.join(tmpdir, "killed-single")
        run_script(save_dir, output_dir, "--safe_serialization", killed_at=("replace", 2))
        files = output_files(output_dir)
        assert len(files) == 1 and files[0].startswith(".model.safetensors.") and files[0].endswith(".tmp")
        llama_config(uneven=True).save_pretrained(output_dir)
        with pytest.raises(OSError):
            LlamaForCausalLM.from_pretrained(output_dir)
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, safe_serialization=True)
        assert output_files(output_dir) == ["model.safetensors"]  # and the temporary file is gone
        assert_matches_reference(load_with_transformers(output_dir), reference)

    def files_of_others(self, save_dir, tmpdir, reference):
        # A file in the way that zero_to_fp32 did not write is refused before anything changes; the
        # files beside it are left alone.
        output_dir = os.path.join(tmpdir, "users-folder")
        os.makedirs(output_dir)
        mine = {"pytorch_model.bin": "my own weights", "notes.txt": "mine"}
        for name, text in mine.items():
            with open(os.path.join(output_dir, name), "w") as f:
                f.write(text)
        with pytest.raises(FileExistsError, match="pytorch_model.bin, which zero_to_fp32 did not write"):
            convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir)
        assert sorted(os.listdir(output_dir)) == sorted(mine)
        for name, text in mine.items():
            with open(os.path.join(output_dir, name)) as f:
                assert f.read() == text
        os.remove(os.path.join(output_dir, "pytorch_model.bin"))
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir)
        assert output_files(output_dir) == ["notes.txt", "pytorch_model.bin"]
        assert_matches_reference(torch.load(os.path.join(output_dir, "pytorch_model.bin")), reference)

    def incomplete_checkpoints(self, save_dir):
        for name in ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            copy = save_dir + "-truncated"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(save_dir, copy)
            path = os.path.join(copy, TAG, name)
            os.truncate(path, os.path.getsize(path) // 2)
            # Named by the load of the file that gives the topology, or by the check of the others
            # before anything is loaded.
            named = rf"Checkpoint file '{re.escape(path)}' is incomplete or corrupt|{re.escape(path)} \(truncated\)"
            with pytest.raises(ValueError, match=named):
                get_fp32_state_dict_from_zero_checkpoint(copy, tag=TAG)
            with pytest.raises(ValueError, match=named):
                convert_zero_checkpoint_to_fp32_state_dict(copy, os.path.join(copy, "out"))
            assert not os.path.exists(os.path.join(copy, "out"))


def zero2_engine(model):
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": 2
        }
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    return engine


class TestZeroToFp32SafetensorsBytes(DistributedTest):
    """safetensors output is what the safetensors library writes for the same tensors: laid out by
    descending dtype, so that every tensor is aligned to its element size in the file."""
    world_size = 1

    def test(self, tmpdir):
        from safetensors import safe_open
        from safetensors.torch import save_file
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config())
        # A boolean mask and integer positions, as models register them, before the fp32 weights.
        model.model.register_buffer("padding_mask", torch.tensor([True, False, True]))
        model.model.register_buffer("position_ids", torch.arange(5))
        engine = zero2_engine(model)
        save_dir = str(tmpdir.join("checkpoint"))
        engine.save_checkpoint(save_dir, tag=TAG)
        output_dir = str(tmpdir.join("out"))
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, safe_serialization=True)

        state_dict = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        assert {state_dict[name].dtype for name in state_dict} == {torch.bool, torch.int64, torch.float32}
        reference = str(tmpdir.join("reference.safetensors"))
        save_file(state_dict, reference, metadata={"format": "pt"})
        with open(os.path.join(output_dir, "model.safetensors"), "rb") as ours, open(reference, "rb") as theirs:
            assert ours.read() == theirs.read()
        with safe_open(os.path.join(output_dir, "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                assert tensor.data_ptr() % tensor.element_size() == 0, name


class TestZeroToFp32ShardsTiedWeights(DistributedTest):
    """Shards follow huggingface_hub's rule with or without it installed: a model with tied input and
    output embeddings is split the same way by the script on a fresh install as by the API with
    huggingface_hub, the tied tensors in one shard and counted once in ``metadata.total_size``."""
    world_size = 1

    def test(self, tmpdir):
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        config = llama_config()
        config.tie_word_embeddings = True
        model = LlamaForCausalLM(config)
        engine = zero2_engine(model)
        save_dir = str(tmpdir.join("checkpoint"))
        engine.save_checkpoint(save_dir, tag=TAG)

        indexes = []
        for output_dir in (str(tmpdir.join("with-hub")), str(tmpdir.join("fresh-install"))):
            if output_dir.endswith("with-hub"):
                convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_dir, max_shard_size="50KB")
            else:
                run_script(save_dir, output_dir, "--max_shard_size", "50KB")
            with open(os.path.join(output_dir, "pytorch_model.bin.index.json")) as f:
                indexes.append(json.load(f))
            loaded = {}
            for name in set(indexes[-1]["weight_map"].values()):
                loaded.update(torch.load(os.path.join(output_dir, name)))
            assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()
        assert indexes[0] == indexes[1]
        unique = {tensor.data_ptr(): tensor for tensor in model.state_dict().values()}.values()
        assert indexes[0]["metadata"]["total_size"] == sum(tensor.numel() * 4 for tensor in unique)
