"""PyTorch Lightning's DeepSpeed strategy, on the CPU: a small regression model whose hyperparameters
hold a path and an OmegaConf config (as Hydra gives them), saved by ``save_hyperparameters()``,
trained to ``--max_epochs`` with a checkpoint after each epoch (``last.ckpt``, a DeepSpeed checkpoint
folder), and resumed from one with ``--resume`` (or validated, ``--validate``). Run it under
``torch.distributed.run``. The checkpoints are this script's own, so it admits OmegaConf's classes to
DeepSpeed's ``weights_only`` load (``omegaconf_safe_globals()``); without that the resume is refused:
reading a config from a file you do not trust could run its resolvers.

    python -m torch.distributed.run --nproc_per_node 2 train.py --output_dir out --stage 2 --max_epochs 1
    python -m torch.distributed.run --nproc_per_node 1 train.py --output_dir out --stage 2 --max_epochs 2 \\
        --resume out/last.ckpt
"""

import argparse
import os
import pathlib

import pytorch_lightning as pl
import torch
from deepspeed.checkpoint.weights_only import omegaconf_safe_globals
from omegaconf import OmegaConf
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DeepSpeedStrategy


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning allows its DeepSpeed strategy on CUDA devices only; DeepSpeed itself runs on the CPU.
    What Lightning checks of CUDA devices is left out, nothing else."""

    def setup_environment(self):
        super(DeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self):
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self):
        # Lightning gives deepspeed.initialize() the device's index, which the CPU has not.
        return torch.device("cpu", 0)


class Regression(pl.LightningModule):

    def __init__(self, data_dir, cfg):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, cfg.hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(cfg.hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.cfg.lr)

    def train_dataloader(self):
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def val_dataloader(self):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)

    def on_train_start(self):
        if self.global_rank == 0:
            print(
                f"training from epoch {self.current_epoch}, step {self.global_step}, "
                f"hyperparameters {dict(self.hparams)}",
                flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--stage", type=int, default=2, help="the ZeRO stage")
    parser.add_argument("--max_epochs", type=int, default=1)
    parser.add_argument("--resume", default=None, help="the checkpoint to resume from (default: start afresh)")
    parser.add_argument("--validate",
                        action="store_true",
                        help="validate the checkpoint --resume names (an engine without an optimizer), not train")
    args = parser.parse_args()
    torch.serialization.add_safe_globals(omegaconf_safe_globals())

    trainer = pl.Trainer(accelerator="cpu",
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         strategy=CPUDeepSpeedStrategy(stage=args.stage, process_group_backend="gloo"),
                         max_epochs=args.max_epochs,
                         default_root_dir=args.output_dir,
                         logger=False,
                         enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=args.output_dir, save_last=True)])
    model = Regression(data_dir=pathlib.Path(args.output_dir) / "data",
                       cfg=OmegaConf.create({
                           "hidden": 8,
                           "lr": 1e-2
                       }))
    if args.validate:
        (metrics, ) = trainer.validate(model, ckpt_path=args.resume, verbose=False)
        if trainer.is_global_zero:
            print(f"validation loss {metrics['val_loss']:.6f}", flush=True)
    else:
        trainer.fit(model, ckpt_path=args.resume)
        if trainer.is_global_zero:
            print(f"validation loss {trainer.callback_metrics['val_loss']:.6f}", flush=True)


if __name__ == "__main__":
    main()
