# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""python -m forktools upstream-tests: the same selection of an upstream checkout's tests runs against the
pristine release and the fork, each in its own venv, the fork with the series' updates of upstream tests,
and the ids whose verdict differs are reported."""

import os
import subprocess
from pathlib import Path

from forktools.upstream_tests import run

# Stands in for upstream's tests/: one test both builds pass, one only the pristine release passes, one
# both skip, and one whose expectation the series changes (its update is made below).
PROBE = '''
import os

import deepspeed
import pytest


def test_version():
    # As a pristine release's CPU all-reduce op does at every run: a shared-memory segment left behind.
    open(f"/dev/shm/deepspeed_allreduce_buffer_0_probe_{os.getpid()}", "wb").close()
    assert deepspeed.__version__.startswith("0.19.8")


def test_pristine():
    assert "+fork.0." in deepspeed.__version__, "the fork's series is applied"


def test_skipped():
    pytest.skip("not on this machine")


def test_changed_by_the_series():
    assert "+fork.0." in deepspeed.__version__
'''


def git(repo, *args):
    command = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def test_differing_verdicts_are_reported(wheels, tmp_path):
    upstream = tmp_path / "upstream"
    probe = upstream / "tests" / "unit" / "test_probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(PROBE)
    (upstream / "README.md").write_text("not a test\n")
    git(upstream, "init", "-q")
    git(upstream, "add", ".")
    git(upstream, "commit", "-qm", "upstream")
    # The series' update of the last test, as patches/upstream-tests/ holds one.
    lines = PROBE.rstrip("\n").split("\n")
    probe.write_text("\n".join(lines[:-1] + [lines[-1].replace(" in ", " not in ")]) + "\n")
    update = tmp_path / "topic.patch"
    update.write_text(git(upstream, "diff"))
    git(upstream, "checkout", "--", ".")
    workdir = tmp_path / "work"
    workdir.mkdir()
    not_ours = Path("/dev/shm") / f"deepspeed_allreduce_buffer_0_probe_{os.getpid()}"
    not_ours.touch()

    summary, regressions = run(upstream,
                               workdir, ("unit/test_probe.py", ),
                               wheels={
                                   "pristine": wheels["upstream"],
                                   "fork": wheels["fork"]
                               },
                               updates=[update])

    assert regressions == ["unit.test_probe::test_pristine"], summary
    lines = summary.splitlines()
    assert lines[1] == "  the fork runs them with the series' updates: topic.patch"
    assert lines[2].startswith("  pristine 0.19.8+fork.0.") and lines[2].endswith("3 passed, 0 failed, 1 skipped")
    assert lines[3].startswith("  fork 0.19.8+fork.") and lines[3].endswith("2 passed, 1 failed, 1 skipped")
    assert lines[4:7] == ["differing verdicts: 1", "  unit.test_probe::test_pristine", "    pristine: passed"]
    assert lines[7].startswith("    fork: failed: AssertionError: the fork's series is applied"), summary
    assert not (workdir / "README.md").exists(), "only tests/ is extracted"
    # The runs' segments are removed (each one holds 66 MiB of memory), a segment from before them is kept.
    assert {path.name for path in Path("/dev/shm").glob("deepspeed_allreduce_buffer_0_probe_*")} == {not_ours.name}
    not_ours.unlink()
