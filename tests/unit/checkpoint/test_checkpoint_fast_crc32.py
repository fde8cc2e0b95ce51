# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The CRC-32 that every reader of a checkpoint verifies is computed by isal or zlib-ng where one of
them is installed (the same checksum as zlib's, several times faster), by zlib otherwise, and
``ds_report`` names it. Whichever computes it, a checkpoint file one bit of whose weights changed
after the save is refused, naming the record and the tensor.

A small GPT-2's model states are saved with ``torch.save``; a fresh interpreter, in which the
packages named are not installed, reports its environment and loads the file.
"""

import importlib.util
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from unit.checkpoint.test_checkpoint_crc32 import flip_bit

LOAD = textwrap.dedent("""
    import sys
    for name in sys.argv[2:]:
        sys.modules[name] = None  # not installed, in this process
    from deepspeed.checkpoint.utils import load_checkpoint_file
    from deepspeed.env_report import debug_report
    debug_report()
    try:
        load_checkpoint_file(sys.argv[1])
    except ValueError as e:
        print("refused:", e)
""")


@pytest.mark.parametrize("not_installed", [[], ["isal", "zlib_ng"]], ids=["as-installed", "zlib"])
def test_changed_weights_are_refused_with_each_crc32(not_installed, tmpdir):
    expected = next(
        (name
         for name in ("isal", "zlib_ng") if name not in not_installed and importlib.util.find_spec(name) is not None),
        "zlib")
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32))
    path = str(tmpdir.join("mp_rank_00_model_states.pt"))
    torch.save({"module": model.state_dict()}, path)
    record = flip_bit(path)

    result = subprocess.run([sys.executable, "-c", LOAD, path, *not_installed], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = re.search(r"^checkpoint CRC-32 \.+ (.*)$", result.stdout, re.M)
    assert report is not None, result.stdout
    assert report.group(1).startswith(expected.replace("_", "-")), report.group(1)
    refused = re.escape(f"refused: It was not loaded: checkpoint file {path} (record '{record}', holding module.")
    assert re.search(refused + r"\S+, fails its CRC-32 check", result.stdout), result.stdout
