# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""PyTorch Lightning's DeepSpeed strategy resumes with the fork's default ``weights_only`` check, as a
Lightning user runs it (examples/lightning_resume/train.py, under ``torch.distributed.run``): the
model's hyperparameters hold a path and an OmegaConf config (``save_hyperparameters()``, as with
Hydra), which Lightning saves into the DeepSpeed checkpoint's client state. ZeRO-2 and ZeRO-3 train
one epoch on 2 ranks, then resume from ``last.ckpt`` on 2 ranks (ZeRO-2) and on 1 (ZeRO-3) and
train the second epoch, with the hyperparameters back as saved. Then ``trainer.validate()`` (an
engine without an optimizer) loads the ZeRO-3 ``last.ckpt`` on 2 ranks: its validation loss is the
one that the run ended with.

Before, each resume was refused: "needs ... omegaconf.dictconfig.DictConfig ... pathlib.PosixPath";
the validation failed, "'DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights'".
"""

import pytest

from example_jobs import REPO, torchrun

pytest.importorskip("pytorch_lightning")

TRAIN = REPO / "examples" / "lightning_resume" / "train.py"


def train(num_ranks, out, stage, max_epochs, *args):
    return torchrun(TRAIN, num_ranks, "--output_dir", out, "--stage", stage, "--max_epochs", max_epochs, *args)


@pytest.mark.parametrize("stage, resume_ranks", [(2, 2), (3, 1)])
def test_lightning_resumes_with_hyperparameters(tmp_path, stage, resume_ranks):
    out = tmp_path / "out"
    train(2, out, stage, 1)
    assert (out / "last.ckpt" / "latest").read_text() == "checkpoint"
    log = train(resume_ranks, out, stage, 2, "--resume", str(out / "last.ckpt"))
    hyperparameters = f"{{'data_dir': PosixPath('{out / 'data'}'), 'cfg': {{'hidden': 8, 'lr': 0.01}}}}"
    assert f"training from epoch 1, step 2, hyperparameters {hyperparameters}" in log, log
    (second_epoch, ) = out.glob("epoch=1-step=*.ckpt")
    assert (second_epoch / "latest").read_text() == "checkpoint"
    if stage < 3:
        return

    # An engine without an optimizer (Lightning's validate) loads the weights the last epoch ended with,
    # on another number of ranks than saved them.
    # The two ranks' mean of their batches' losses, rounded otherwise than the one rank's.
    validated = train(2, out, stage, 2, "--resume", str(out / "last.ckpt"), "--validate")
    assert validation_loss(validated) == pytest.approx(validation_loss(log), rel=1e-6), validated


def validation_loss(log):
    (line, ) = [line for line in log.splitlines() if line.startswith("validation loss ")]
    return float(line.split()[-1])
