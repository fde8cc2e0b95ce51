# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""python -m forktools upstream-tests: the same selection of an upstream checkout's tests runs against the
pristine release and the fork, each in its own venv, and the ids whose verdict differs are reported."""

import subprocess

from forktools.upstream_tests import run

# Stands in for upstream's tests/: one test both builds pass, one only the pristine release passes, one
# both skip.
PROBE = """
import deepspeed
import pytest


def test_version():
    assert deepspeed.__version__.startswith("0.19.8")


def test_pristine():
    assert "+fork.0." in deepspeed.__version__, "the fork's series is applied"


def test_skipped():
    pytest.skip("not on this machine")
"""


def test_differing_verdicts_are_reported(wheels, tmp_path):
    upstream = tmp_path / "upstream"
    (upstream / "tests" / "unit").mkdir(parents=True)
    (upstream / "tests" / "unit" / "test_probe.py").write_text(PROBE)
    (upstream / "README.md").write_text("not a test\n")
    for command in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"]):
        subprocess.run(["git", "-C", str(upstream), *command], check=True)
    workdir = tmp_path / "work"
    workdir.mkdir()

    summary, regressions = run(upstream,
                               workdir, ("unit/test_probe.py", ),
                               wheels={
                                   "pristine": wheels["upstream"],
                                   "fork": wheels["fork"]
                               })

    assert regressions == ["unit.test_probe::test_pristine"], summary
    lines = summary.splitlines()
    assert lines[1].startswith("  pristine 0.19.8+fork.0.") and lines[1].endswith("2 passed, 0 failed, 1 skipped")
    assert lines[2].startswith("  fork 0.19.8+fork.") and lines[2].endswith("1 passed, 1 failed, 1 skipped")
    assert lines[3:6] == ["differing verdicts: 1", "  unit.test_probe::test_pristine", "    pristine: passed"]
    assert lines[6].startswith("    fork: failed: AssertionError: the fork's series is applied"), summary
    assert not (workdir / "README.md").exists(), "only tests/ is extracted"
