# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint file whose bytes changed after it was saved is never loaded.

``torch.save`` records a CRC-32 for every record of the zip it writes, and ``torch.load`` does not
check it: one bit flipped in the middle of a tensor (storage or memory that went bad, a copy between
filesystems that went wrong) loaded without a word, and training went on from the changed values.

A job saves a small Llama at ZeRO stage 1, 2 or 3, at world size 1 and 2; one bit is flipped in the
largest tensor of the model states file, or of the optimizer file of the last rank (at world size
2, a file that rank 0 does not read). ``load_checkpoint`` must refuse it on every rank before
anything is loaded, naming the file, the record and the tensor, and leave the model and its fp32
weights as they were; ``zero_to_fp32`` and ``ds_to_universal`` must refuse it too, writing nothing.
So must a job of another data-parallel size, whose ranks share the files to verify.
``"checkpoint": {"verify_crc32": false}`` skips the check, and a file saved without CRC-32s loads
with one warning for each file.
"""

import logging
import os
import re
import shutil
import struct
import zipfile

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
from deepspeed.checkpoint.utils import load_checkpoint_file
from deepspeed.utils import logger, safe_get_full_fp32_param
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from unit.checkpoint import zero_load_common
from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.checkpoint.test_ds_to_universal_output import convert_args
from unit.common import DistributedTest

CRC32_ERROR = "fails its CRC-32 check"

# The fixtures of the source checkpoints that a job of another data-parallel size loads.
cache = zero_load_common.cache
saved = zero_load_common.saved
# Each source checkpoint: stage, tp, dp, dtype, optimizer.
SOURCES = {f"stage{stage}-tp1dp1": (stage, 1, 1, torch.float32, "adam") for stage in (2, 3)}


def weights(engine):
    """Every parameter of the module and its fp32 weights, gathered."""
    state = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            state[name] = param.detach().clone()
        state[f"{name} (fp32)"] = safe_get_full_fp32_param(param).detach().clone()
    return state


def flip_bit(path):
    """Flip one bit in the middle of the largest tensor record of the ``torch.save`` zip ``path``, or
    of its pickle if it holds no tensor data (a ZeRO-3 model states file), as its bytes lie in the file
    (deflated, in a zip that deflates them); returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        records = sorted(archive.infolist(), key=lambda info: ("/data/" in info.filename, info.file_size))
    record = records[-1] if records[-1].file_size else next(info for info in records if info.filename.endswith(".pkl"))
    with open(path, "r+b") as fd:
        # The record's bytes follow its local header: 30 bytes, its name and its extra field.
        fd.seek(record.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", fd.read(4))
        offset = record.header_offset + 30 + name_length + extra_length + record.compress_size // 2
        fd.seek(offset)
        byte = fd.read(1)[0]
        fd.seek(offset)
        fd.write(bytes([byte ^ 0x10]))
    return record.filename.partition("/")[2]


@pytest.mark.parametrize("stage", [1, 2, 3])
class TestCheckpointCrc32(DistributedTest):
    world_size = [1, 2]
    reuse_dist_env = True

    def test_changed_file_is_refused(self, stage, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(stage)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="saved")
        last = dist.get_world_size() - 1
        model_file = f"zero_pp_rank_{last}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        optim_file = f"zero_pp_rank_{last}_mp_rank_00_optim_states.pt"
        before = weights(engine)
        for tag, name in (("model_changed", model_file), ("optim_changed", optim_file)):
            path = os.path.join(save_dir, tag, name)
            record = None
            if dist.get_rank() == 0:
                shutil.copytree(os.path.join(save_dir, "saved"), os.path.join(save_dir, tag))
                record = flip_bit(path)
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, record)
            holding = ", holding .*" if records[0].startswith("data/") else ""
            error = re.escape(f"{path} (record '{records[0]}'") + holding + " " + CRC32_ERROR
            with pytest.raises(ValueError, match=error):
                engine.load_checkpoint(save_dir, tag=tag)
            after = weights(engine)
            for key, value in before.items():
                assert torch.equal(after[key], value), key

            if dist.get_rank() == 0:
                with pytest.raises(ValueError, match=error):
                    get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
                output_dir = os.path.join(save_dir, f"{tag}_universal")
                with pytest.raises(ValueError, match=error):
                    convert_to_universal(convert_args(os.path.join(save_dir, tag), output_dir))
                assert not os.path.exists(output_dir)
            dist.barrier()


class TestSave(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_ws1(self, source, cache):
        zero_load_common.save(cache, source, SOURCES[source])


class TestCheckpointCrc32OtherDpSize(DistributedTest):
    """At another data-parallel size each rank reads a part of every file, and the ranks share the
    files to verify: rank 1 verifies none of the one file saved, and refuses it too."""
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("source", list(SOURCES))
    def test_changed_file_is_refused(self, source, saved, tmpdir):
        folder = os.path.join(str(tmpdir), source)
        path = os.path.join(folder, zero_load_common.TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        if dist.get_rank() == 0:
            shutil.copytree(saved, folder)
            flip_bit(path)
        dist.barrier()
        engine = zero_load_common.initialize(SOURCES[source][0], tp_size=1)
        with pytest.raises(ValueError, match=re.escape(f"{path} (record 'data/") + ".*" + CRC32_ERROR):
            engine.load_checkpoint(folder, tag=zero_load_common.TAG)


class TestCheckpointCrc32Off(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    def test_verify_crc32_false_loads_a_changed_file(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2, verify_crc32=False)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="saved")
        flip_bit(os.path.join(save_dir, "saved", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        load_path, _ = engine.load_checkpoint(save_dir, tag="saved")
        assert load_path is not None

    def test_file_without_crc32_loads_with_a_warning(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2)
        train_step(engine)
        torch.serialization.set_crc32_options(False)
        try:
            engine.save_checkpoint(save_dir, tag="saved")
        finally:
            torch.serialization.set_crc32_options(True)
        warnings = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        logger.addHandler(handler)
        try:
            load_path, _ = engine.load_checkpoint(save_dir, tag="saved")
        finally:
            logger.removeHandler(handler)
        assert load_path is not None
        unverifiable = [message for message in warnings if "record no CRC-32s" in message]
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            path = os.path.join(save_dir, "saved", name)
            assert sum(path in message for message in unverifiable) == 1, warnings


def test_load_checkpoint_file_refuses_a_changed_record(tmpdir):
    """Every reader of a checkpoint file (the universal loader, the offline tools) loads it with
    ``load_checkpoint_file``, which names the tensor whose bytes changed."""
    path = str(tmpdir.join("fp32.pt"))
    torch.save({"param": torch.randn(64, 32), "step": torch.tensor(3.0)}, path)
    record = flip_bit(path)
    with pytest.raises(ValueError, match=re.escape(f"{path} (record '{record}', holding param, {CRC32_ERROR}")):
        load_checkpoint_file(path)
