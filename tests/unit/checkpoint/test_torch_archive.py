# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``deepspeed.checkpoint.torch_archive``, the reader and writer of ``torch.save`` files that
``zero_to_fp32`` and ``ds_to_universal`` share: lazy reads of tensor slices, stand-ins for classes,
torch's legacy format, refusal of a truncated file naming it, and ``save``, whose files are
``torch.save``'s with the zip checksums filled in by zlib."""

import os
import shutil
import subprocess
import zipfile

import pytest
import torch

from deepspeed.checkpoint.torch_archive import IncompleteCheckpointFileError, LazyTensor, load_lazy, materialize, save
from deepspeed.runtime.zero.config import ZeroStageEnum


def stand_in(module, name):
    if (module, name) == ("deepspeed.runtime.zero.config", "ZeroStageEnum"):
        return int
    return None


def checkpoint_like():
    flat = torch.arange(1000, dtype=torch.float32)
    return {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights,
            "fp32_flat_groups": [flat, flat[:10] * 2],
        },
        "module": {
            "weight": torch.arange(12, dtype=torch.bfloat16).view(3, 4),
            "transposed": torch.arange(6, dtype=torch.float16).view(2, 3).t(),
            "empty": torch.zeros(0),
        },
        "step": 3,
    }


def assert_equal(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_equal(actual[key], value)
        elif isinstance(value, list):
            assert len(actual[key]) == len(value)
            for a, e in zip(actual[key], value):
                assert torch.equal(a, e)
        elif torch.is_tensor(value):
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


@pytest.mark.parametrize("legacy_format", [False, True])
def test_load_lazy(tmpdir, legacy_format):
    expected = checkpoint_like()
    path = str(tmpdir.join("states.pt"))
    torch.save(expected, path, _use_new_zipfile_serialization=not legacy_format)

    state = load_lazy(path, find_class=stand_in)
    flat = state["optimizer_state_dict"]["fp32_flat_groups"][0]
    assert isinstance(flat, LazyTensor) and flat.shape == (1000, ) and flat.dtype == torch.float32
    assert torch.equal(flat.read(990, 5), torch.arange(990, 995, dtype=torch.float32))
    out = torch.empty(3)
    flat.read(7, 3, out=out)
    assert torch.equal(out, torch.tensor([7., 8., 9.]))
    # the stand-in, not the enum class
    assert type(state["optimizer_state_dict"]["zero_stage"]) is int
    assert state["optimizer_state_dict"]["zero_stage"] == 3

    materialized = materialize(state)
    expected["optimizer_state_dict"]["zero_stage"] = 3
    assert_equal(materialized, expected)


def test_truncated_file_is_named(tmpdir):
    path = str(tmpdir.join("zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    torch.save(checkpoint_like(), path)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(IncompleteCheckpointFileError, match=f"Checkpoint file '{path}' is incomplete or corrupt"):
        load_lazy(path)
    with open(path, "wb"):
        pass
    with pytest.raises(IncompleteCheckpointFileError, match=f"Checkpoint file '{path}' is incomplete or corrupt"):
        load_lazy(path)


def test_save_fills_in_checksums(tmpdir):
    expected = checkpoint_like()
    expected["module"]["large"] = torch.randn(3 << 20)  # several records checksummed in parallel
    expected["module"]["large2"] = torch.randn(1 << 20)
    path = str(tmpdir.join("saved.pt"))
    save(expected, path)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        # torch.save()'s own records, each with its checksum
        assert all(info.CRC != 0 for info in archive.infolist() if info.file_size > 0)
    if shutil.which("unzip"):
        unzip = subprocess.run(["unzip", "-tq", path], capture_output=True, text=True)
        assert unzip.returncode == 0, unzip.stdout + unzip.stderr
    expected["optimizer_state_dict"]["zero_stage"] = ZeroStageEnum.weights
    assert_equal(torch.load(path, weights_only=False), expected)
    # torch's own checksums are back on for everyone else
    assert torch.serialization.get_crc32_options()
