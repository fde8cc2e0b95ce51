# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What frameworks save as ``client_state`` loads with the default ``weights_only`` check, and a
payload smuggled in through the classes that it admits for them is still refused.

PyTorch Lightning's DeepSpeed strategy saves its whole checkpoint dict as ``client_state``: the
hyperparameters of ``save_hyperparameters()`` (paths; with Hydra, OmegaConf configs), the loops'
and callbacks' states. A ZeRO-2 job saves that, and a fresh job loads it: with the default config,
it must get it back equal, and the weights, or, where it holds OmegaConf configs, be refused and
told how to admit them; admitted with ``omegaconf_safe_globals()``, it loads equal. Before, the load
was refused ("needs pathlib.PosixPath", OmegaConf's classes).

A file whose client state holds a path, and a config, each built from an object whose unpickling
creates a file, must be refused, naming the payload's global, and the file must not exist. A file
whose client state makes the load read an OmegaConf config (``dict(config)``, or the
``collections.OrderedDict`` that torch admits) must be refused before the config resolves: its
``${oc.env:...}`` would read a secret from the environment and its ``${oc.coerce:...}`` import a
module of the file's choosing. Before, OmegaConf was admitted by default and both resolved.
"""

import collections
import os
import pathlib
import pickle
import sys

import pytest
import torch

import deepspeed.comm as dist

from deepspeed.checkpoint.weights_only import omegaconf_safe_globals
from unit.checkpoint.autotp_common import forget_saved_files
from unit.checkpoint.test_checkpoint_weights_only import (Payload, assert_weights_equal, full_weights, initialize,
                                                          train_step)
from unit.common import DistributedTest

omegaconf = pytest.importorskip("omegaconf")
DictConfig, ListConfig, OmegaConf = omegaconf.DictConfig, omegaconf.ListConfig, omegaconf.OmegaConf


def lightning_client_state(save_dir):
    """The keys and kinds of values that Lightning's ``DeepSpeedStrategy.save_checkpoint()`` saves."""
    config = OmegaConf.create({"model": {"hidden": 32, "dropout": 0.1}, "data": {"splits": ["train", "val"]}})
    return {
        "epoch": 1,
        "global_step": 1,
        "pytorch-lightning_version": "2.6.6",
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_progress": {
                    "total": {
                        "ready": 2,
                        "completed": 1
                    }
                }
            }
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {
                "dirpath": os.path.join(save_dir, "checkpoints"),
                "best_model_score": torch.tensor(0.5),
                "best_k_models": {},
            }
        },
        "hparams_name": "kwargs",
        "hyper_parameters": {
            "data_dir": pathlib.Path(save_dir) / "data",
            "cache": pathlib.PurePosixPath("cache/tokens"),
            "cfg": config,
            "layers": OmegaConf.create([32, 32]),
        },
    }


class PathPayload:
    """Pickles as a ``pathlib.PosixPath`` built from what ``Payload`` returns."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.PosixPath, (Payload(self.marker), ))


class ConfigPayload(PathPayload):
    """Pickles as an OmegaConf ``DictConfig`` built from what ``Payload`` returns."""

    def __reduce__(self):
        return (DictConfig, ({"value": Payload(self.marker)}, ))


class ResolvedConfig:
    """Pickles as ``reader(config)``: unpickling it reads every value of an OmegaConf config."""

    def __init__(self, reader, content):
        self.reader, self.content = reader, content

    def __reduce__(self):
        return (self.reader, (OmegaConf.create(self.content), ))


class TestCheckpointFrameworkClientState(DistributedTest):
    world_size = 1
    reuse_dist_env = True

    def test_lightning_client_state_loads(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2)
        train_step(engine)
        saved = lightning_client_state(save_dir)
        engine.save_checkpoint(save_dir, tag="checkpoint", client_state=saved)
        expected = full_weights(engine)

        fresh = initialize(2)
        with pytest.raises(pickle.UnpicklingError, match=r"needs .*omegaconf\.dictconfig\.DictConfig.*omegaconf_safe"):
            fresh.load_checkpoint(save_dir, tag="checkpoint")
        with torch.serialization.safe_globals(omegaconf_safe_globals()):
            _, client_state = fresh.load_checkpoint(save_dir, tag="checkpoint")
        assert_weights_equal(fresh, expected)
        hparams = client_state["hyper_parameters"]
        assert hparams["data_dir"] == saved["hyper_parameters"]["data_dir"]
        assert hparams["cache"] == saved["hyper_parameters"]["cache"]
        assert isinstance(hparams["cfg"], DictConfig) and hparams["cfg"] == saved["hyper_parameters"]["cfg"]
        assert isinstance(hparams["layers"], ListConfig) and list(hparams["layers"]) == [32, 32]
        assert client_state["loops"] == saved["loops"]
        assert client_state["callbacks"] == saved["callbacks"]

    def test_lightning_client_state_with_paths_loads(self, tmpdir):
        save_dir = str(tmpdir)
        engine = initialize(2)
        saved = lightning_client_state(save_dir)
        del saved["hyper_parameters"]["cfg"], saved["hyper_parameters"]["layers"]
        engine.save_checkpoint(save_dir, tag="checkpoint", client_state=saved)

        _, client_state = initialize(2).load_checkpoint(save_dir, tag="checkpoint")
        assert client_state["hyper_parameters"] == saved["hyper_parameters"]

    @pytest.mark.parametrize("reader", [dict, collections.OrderedDict])
    def test_config_is_not_resolved_at_load(self, tmpdir, monkeypatch, reader):
        save_dir = str(tmpdir)
        marker = os.path.join(save_dir, "module_imported")
        with open(os.path.join(save_dir, "ds_checkpoint_config_module.py"), "w") as fd:
            fd.write(f"open({marker!r}, 'w').close()\nvalue = int\n")
        monkeypatch.syspath_prepend(save_dir)
        monkeypatch.setenv("DS_CHECKPOINT_TEST_SECRET", "the secret")
        engine = initialize(2)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        tag_dir = os.path.join(save_dir, "checkpoint")
        if dist.get_rank() == 0:
            path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
            state = torch.load(path, weights_only=False)
            state["hyper_parameters"] = ResolvedConfig(
                reader, {
                    "secret": "${oc.env:DS_CHECKPOINT_TEST_SECRET}",
                    "imported": "${oc.coerce:ds_checkpoint_config_module.value,1}"
                })
            torch.save(state, path)
            forget_saved_files(tag_dir)
        dist.barrier()

        with pytest.raises(pickle.UnpicklingError, match=r"needs .*omegaconf\.dictconfig\.DictConfig") as refusal:
            initialize(2).load_checkpoint(save_dir, tag="checkpoint")
        assert "the secret" not in str(refusal.value)
        assert not os.path.exists(marker) and "ds_checkpoint_config_module" not in sys.modules

    @pytest.mark.parametrize("payload", [PathPayload, ConfigPayload])
    def test_payload_through_an_admitted_class_is_refused(self, tmpdir, payload):
        save_dir = str(tmpdir)
        marker = os.path.join(save_dir, "payload_ran")
        engine = initialize(2)
        train_step(engine)
        engine.save_checkpoint(save_dir, tag="checkpoint")
        tag_dir = os.path.join(save_dir, "checkpoint")
        if dist.get_rank() == 0:
            path = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
            state = torch.load(path, weights_only=False)
            state["hyper_parameters"] = {"value": payload(marker)}
            torch.save(state, path)
            forget_saved_files(tag_dir)
        dist.barrier()

        fresh = initialize(2)
        expected = full_weights(fresh)
        with pytest.raises(Exception, match=r"needs io\.open"):
            fresh.load_checkpoint(save_dir, tag="checkpoint")
        assert not os.path.exists(marker)
        assert_weights_equal(fresh, expected)
