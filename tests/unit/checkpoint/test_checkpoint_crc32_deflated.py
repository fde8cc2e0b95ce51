# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint file zipped again with its records deflated verifies: the CRC-32 that a zip records is
that of a record's bytes inflated, which ``torch.load`` reads.

``torch.save`` stores its records uncompressed. A tool that zips a checkpoint again for a transfer
may deflate them; ``torch.load`` still reads the file. The CRC-32 check must pass such a file, and
still refuse one whose deflated bytes changed. Before, every record of it was reported as "bytes
changed".
"""

import shutil
import zipfile

import torch

from deepspeed.checkpoint.integrity import checkpoint_crc32_problems

from unit.checkpoint.test_checkpoint_crc32 import flip_bit


def deflate(path):
    """Zip the ``torch.save`` archive ``path`` again, its records deflated."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in records:
            archive.writestr(name, data)


def test_deflated_checkpoint_file_verifies(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    # Weights that deflate: a model's are rarely random.
    state = {"module": {"weight": torch.arange(64 * 1024, dtype=torch.float32) % 7}, "global_steps": 3}
    torch.save(state, path)
    deflate(path)
    with zipfile.ZipFile(path) as archive:
        assert all(info.compress_type == zipfile.ZIP_DEFLATED for info in archive.infolist())
    assert torch.equal(torch.load(path, weights_only=True)["module"]["weight"], state["module"]["weight"])
    assert checkpoint_crc32_problems([str(path)]) == ([], [])

    changed = tmp_path / "changed" / path.name
    changed.parent.mkdir()
    shutil.copy(path, changed)
    flip_bit(str(changed))
    problems, _ = checkpoint_crc32_problems([str(changed)])
    assert len(problems) == 1 and problems[0].startswith(f"{changed} ("), problems
