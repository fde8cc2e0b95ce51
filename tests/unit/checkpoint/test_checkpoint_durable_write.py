# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint is on disk before ``latest`` names it.

A 2-rank job trains a small Llama at ZeRO stage 2 and saves a checkpoint under ``strace``, which
records every ``fsync`` and ``rename`` of the real save as the kernel sees them. Each rank file must
be written under a temporary name, flushed to disk, renamed into place and its folder flushed after
the rename; ``latest`` must be renamed into place only after all of that, on every rank, and then
be flushed too. With ``"checkpoint": {"fsync": false}`` the same save makes no ``fsync`` at all. A
save that raises (a ``client_state`` that cannot be pickled) leaves no temporary file behind.

This file is also the job: ``python -m torch.distributed.run ... test_checkpoint_durable_write.py``.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from unit.checkpoint.test_checkpoint_killed_save import initialize, train_step
from unit.common import DistributedTest

# pid name(args) = result, or the two halves of a call that strace -f shows interrupted by another.
CALL = re.compile(r'^(\d+) +(\w+)\((.*?)(?:\) += (-?\d+).*| <unfinished \.\.\.>)$')
RESUMED = re.compile(r'^(\d+) +<\.\.\. (\w+) resumed>.*\) += (-?\d+)')
PATH = re.compile(r'"([^"]*)"|\d+<([^>]*)>')


def traced_save(save_dir, fsync):
    """The ``fsync`` and ``rename`` calls of a 2-rank save on paths in ``save_dir``, in the order they
    returned: (pid, call, paths)."""
    from unit.common import get_master_port
    trace = f"{save_dir}.strace"
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [
        "strace", "-f", "--seccomp-bpf", "-qq", "-y", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2", "-o",
        trace, sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={get_master_port()}", __file__,
        str(save_dir),
        str(fsync)
    ]
    proc = subprocess.run(command,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True,
                          timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([tests,
                                                                           os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stdout
    calls, pending = [], {}
    with open(trace) as f:
        for line in f:
            match = CALL.match(line)
            if match:
                pid, name, args, result = match.groups()
                if result is None:
                    pending[pid] = (name, args)
                    continue
            else:
                match = RESUMED.match(line)
                if not match:
                    continue
                pid, name, result = match.groups()
                name, args = pending.pop(pid)
            paths = [quoted or described for quoted, described in PATH.findall(args)]
            if int(result) == 0 and any(path.startswith(str(save_dir)) for path in paths):
                calls.append((pid, name, paths))
    return calls


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to see the calls of the save")
class TestDurableSave:

    def test_latest_after_every_file_is_on_disk(self, tmp_path):
        save_dir = tmp_path.resolve() / "ckpt"
        calls = traced_save(save_dir, fsync=True)
        tag_dir = str(save_dir / "global_step1")
        rank_files = sorted(os.path.join(tag_dir, name) for name in os.listdir(tag_dir) if name.endswith(".pt"))
        assert len(rank_files) == 3, rank_files  # the model states and each rank's optimizer states

        def index(pid, name, path):
            found = [i for i, call in enumerate(calls) if call[0] == pid and call[1] == name and call[2][-1] == path]
            assert found, f"no {name} of {path} by {pid}"
            return found[0]

        renames = {
            paths[-1]: (i, pid, paths[0])
            for i, (pid, name, paths) in enumerate(calls) if name.startswith("rename")
        }
        on_disk = []
        for path in rank_files:
            rename, pid, temp = renames[path]
            assert os.path.dirname(temp) == tag_dir and os.path.basename(temp).endswith(".tmp"), temp
            assert index(pid, "fsync", temp) < rename, f"{path} renamed before its data was flushed"
            folder_flush = [i for i, call in enumerate(calls) if i > rename and call == (pid, "fsync", [tag_dir])]
            assert folder_flush, f"{tag_dir} not flushed after {path} was renamed into it"
            on_disk.append(folder_flush[0])

        latest = str(save_dir / "latest")
        rename, pid, temp = renames[latest]
        assert index(pid, "fsync", temp) < rename
        assert max(on_disk) < rename, "latest named the tag before every rank file was on disk"
        flushes = [i for i, call in enumerate(calls) if call == (pid, "fsync", [str(save_dir)])]
        assert any(i < rename for i in flushes), "the tag's folder was not flushed before latest named it"
        assert any(i > rename for i in flushes), "latest was not flushed after its rename"
        with open(latest) as fd:
            assert fd.read() == "global_step1"

    def test_fsync_false_saves_without_fsync(self, tmp_path):
        save_dir = tmp_path.resolve() / "ckpt"
        calls = traced_save(save_dir, fsync=False)
        assert not [call for call in calls if call[1] in ("fsync", "fdatasync")]
        renamed = [os.path.basename(paths[-1]) for _, name, paths in calls if name.startswith("rename")]
        # The rank files, the record of which files the save wrote (when the engine records it), latest.
        renamed = [name for name in renamed if name != "checkpoint_manifest.json"]
        assert renamed.count("latest") == 1 and len(renamed) == 4, renamed
        assert renamed[-1] == "latest"


class TestSaveThatRaises(DistributedTest):
    world_size = 1

    def test_leaves_no_temporary_file(self, tmpdir):
        engine = initialize(2)
        train_step(engine)
        save_dir = str(tmpdir)
        with pytest.raises(Exception, match="pickle"):
            engine.save_checkpoint(save_dir, tag="global_step1", client_state={"callback": lambda: None})
        assert sorted(os.listdir(save_dir)) == ["global_step1"]
        assert not [name for name in os.listdir(os.path.join(save_dir, "global_step1")) if name.endswith(".tmp")]
        engine.save_checkpoint(save_dir, tag="global_step1")
        assert engine.load_checkpoint(save_dir)[0] is not None


if __name__ == "__main__":
    save_dir, fsync = sys.argv[1], sys.argv[2] == "True"
    engine = initialize(2, fsync=fsync)
    train_step(engine)
    engine.save_checkpoint(save_dir, tag="global_step1")
