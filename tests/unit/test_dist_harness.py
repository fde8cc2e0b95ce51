# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tests of the DistributedTest harness itself (tests/unit/common.py and tests/conftest.py).

Failures, timeouts and skips must be observed from outside the session that runs them, so those cases
run an inner pytest session in a subprocess (pytester) on a generated test file. The rest run here, as
ordinary DistributedTest classes.
"""

import os
import re
import textwrap
from pathlib import Path

import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedTest

TESTS_DIR = Path(__file__).resolve().parent.parent

# Read at import, before pytester replaces HOME for the inner sessions.
CACHE_HOME = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")

# The inner session's test file. FAILURE_GRACE_SECONDS is lowered so that the case where rank 0 waits in a
# barrier for a rank that failed costs 2 s instead of the default grace period.
INNER_TESTS = """
    import os
    import time

    import pytest

    import deepspeed.comm as dist
    import unit.common
    from unit.common import DistributedTest

    unit.common.FAILURE_GRACE_SECONDS = 2

    PID_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids")


    def record_pid(name):
        os.makedirs(PID_DIR, exist_ok=True)
        with open(os.path.join(PID_DIR, f"{name}.rank{dist.get_rank()}"), "w") as f:
            f.write(str(os.getpid()))


    class TestRankFailure(DistributedTest):
        world_size = 2

        def test_rank1_assert(self):
            if dist.get_rank() == 1:
                computed = 41
                assert computed == 42, "rank one computed the wrong value"
            # Rank 0 blocks here for a peer that never arrives; the harness must not wait exec_timeout.
            dist.barrier()


    class TestTimeout(DistributedTest):
        world_size = 2
        exec_timeout = 3

        def test_hang(self):
            if dist.get_rank() == 1:
                time.sleep(600)


    class TestSkip(DistributedTest):
        world_size = 2

        def test_skip(self):
            pytest.skip("needs hardware this machine lacks")


    class TestFresh(DistributedTest):
        world_size = 2

        def test_fresh_a(self):
            record_pid("fresh_a")

        def test_fresh_b(self):
            record_pid("fresh_b")


    class TestReuseDiscard(DistributedTest):
        world_size = 2
        reuse_dist_env = True

        def test_reuse_1(self):
            record_pid("reuse_1")

        def test_reuse_2_fails(self):
            record_pid("reuse_2")
            assert dist.get_rank() == 0, "deliberate failure on a reused pool"

        def test_reuse_3(self):
            record_pid("reuse_3")
            dist.barrier()
"""


def _durations(result):
    """Map 'Class::test' to the seconds --durations reported for its call phase."""
    durations = {}
    for line in result.outlines:
        match = re.match(r"\s*([\d.]+)s call\s+\S+?::(\S+)$", line)
        if match:
            durations[match.group(2)] = float(match.group(1))
    return durations


def _pids(pid_dir, name):
    return [(pid_dir / f"{name}.rank{rank}").read_text() for rank in range(2)]


def test_failures_timeouts_skips_and_pool_reuse(pytester, monkeypatch):
    # The inner session imports the harness from this tree and uses a copy of the real conftest.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    # pytester points HOME at a temporary directory; keep using the caches under the real one, where the
    # ops that deepspeed JIT-builds are (init_distributed on CPU builds one, which takes minutes on 2 cores).
    monkeypatch.setenv("XDG_CACHE_HOME", CACHE_HOME)
    pytester.makeconftest((TESTS_DIR / "conftest.py").read_text())
    pytester.makepyfile(test_inner=textwrap.dedent(INNER_TESTS))
    # The limit also proves the harness does not wait out exec_timeout (600 s by default) for a rank blocked
    # in a collective. It is generous because starting ranks can include a JIT build of a comm op (minutes).
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "--durations=0", timeout=300)
    output = result.stdout.str()

    result.assert_outcomes(passed=4, failed=3, skipped=1)
    durations = _durations(result)

    # (a) An assert failing on rank 1 fails the test, naming the rank and showing its traceback and message.
    result.stdout.fnmatch_lines([
        "*DistributedTest test_rank1_assert failed on rank(s) [[]1[]] of 2*",
        "*----- rank 1 -----*",
        "*AssertionError: rank one computed the wrong value*",
        # Rank 0, blocked in the barrier, was killed after the grace period rather than after exec_timeout.
        "*rank(s) [[]0[]] had not finished 2s after the failure*",
    ])
    # Assertions are rewritten on the ranks as in the parent, so the compared values are shown.
    assert "assert 41 == 42" in output

    # (b) A rank that never finishes makes the test fail with a clear message once exec_timeout has passed.
    result.stdout.fnmatch_lines(
        ["*DistributedTest timed out after 3s: rank(s) [[]1[]] of 2 did not finish test_hang*"])
    assert durations["TestTimeout::test_hang"] >= 3

    # (d) pytest.skip on the ranks skips the test, with the ranks' reason.
    result.stdout.fnmatch_lines(["SKIPPED *needs hardware this machine lacks*"])

    # (e) A reused pool keeps its processes across tests; a failure discards it and the next test gets a
    # fresh one. Tests without reuse_dist_env get fresh processes every time.
    result.stdout.fnmatch_lines([
        "*DistributedTest test_reuse_2_fails failed on rank(s) [[]1[]] of 2*",
        "*AssertionError: deliberate failure on a reused pool*",
    ])
    pid_dir = pytester.path / "pids"
    assert _pids(pid_dir, "reuse_1") == _pids(pid_dir, "reuse_2")
    assert not set(_pids(pid_dir, "reuse_3")) & set(_pids(pid_dir, "reuse_2"))
    assert not set(_pids(pid_dir, "fresh_a")) & set(_pids(pid_dir, "fresh_b"))


def test_world_size_parametrization(pytester):
    # Collection only, so it can run in this process: no ranks are started. (The inner session's end shuts
    # down this process's reused pools; defined before the reuse tests below, it runs while there are none.)
    pytester.makeconftest((TESTS_DIR / "conftest.py").read_text())
    pytester.makepyfile(test_sizes="""
        import pytest
        from unit.common import DistributedTest

        class TestSizes(DistributedTest):
            world_size = [1, 2]

            def test_list(self):
                pass

            @pytest.mark.world_size(4)
            def test_marker_int(self):
                pass

            @pytest.mark.world_size(1, 3)
            def test_marker_several(self):
                pass

            @pytest.mark.parametrize("value", ["a", "b"])
            def test_with_params(self, value):
                pass

        class TestSingle(DistributedTest):
            def test_default(self):
                pass
    """)
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider")
    collected = {line.strip() for line in result.outlines if "::" in line}
    assert collected == {
        "test_sizes.py::TestSizes::test_list[world_size=1]",
        "test_sizes.py::TestSizes::test_list[world_size=2]",
        "test_sizes.py::TestSizes::test_marker_int",
        "test_sizes.py::TestSizes::test_marker_several[world_size=1]",
        "test_sizes.py::TestSizes::test_marker_several[world_size=3]",
        "test_sizes.py::TestSizes::test_with_params[world_size=1-a]",
        "test_sizes.py::TestSizes::test_with_params[world_size=1-b]",
        "test_sizes.py::TestSizes::test_with_params[world_size=2-a]",
        "test_sizes.py::TestSizes::test_with_params[world_size=2-b]",
        "test_sizes.py::TestSingle::test_default",
    }


def _check_dist_env(world_size):
    """What every rank must see: the environment variables and an initialised process group of that size."""
    rank = dist.get_rank()
    assert dist.is_initialized()
    assert dist.get_world_size() == world_size
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert int(os.environ["MASTER_PORT"]) > 0
    assert int(os.environ["RANK"]) == rank
    assert int(os.environ["LOCAL_RANK"]) == rank
    assert int(os.environ["WORLD_SIZE"]) == world_size
    assert int(os.environ["LOCAL_SIZE"]) == world_size

    # A collective across all ranks: sum of (rank + 1).
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    assert value.item() == world_size * (world_size + 1) / 2


class TestAllReduce(DistributedTest):
    world_size = 2

    def test_all_reduce(self):
        _check_dist_env(2)


class TestWorldSizes(DistributedTest):
    # (c) One run per listed size, and a marker overrides the class's sizes.
    world_size = [1, 2]
    reuse_dist_env = True

    def test_each_size(self):
        # Inside the ranks, self.world_size is the size of this run.
        assert self.world_size in (1, 2)
        _check_dist_env(self.world_size)

    @pytest.mark.world_size(1)
    def test_marker_overrides_class(self):
        assert self.world_size == 1
        _check_dist_env(1)


@pytest.fixture(scope="module")
def pid_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reuse-pids")


class TestReusedWorkers(DistributedTest):
    # (e) Tests of a reuse_dist_env class run in the same rank processes, with the process group kept.
    world_size = 2
    reuse_dist_env = True

    def _same_worker_as_before(self, pid_dir):
        # Whichever of the two tests runs first records the pid of each rank; the other must find its own.
        path = pid_dir / f"rank{dist.get_rank()}"
        if path.exists():
            assert path.read_text() == str(os.getpid())
        else:
            path.write_text(str(os.getpid()))
        dist.barrier()
        _check_dist_env(2)

    def test_first(self, pid_dir):
        self._same_worker_as_before(pid_dir)

    def test_second(self, pid_dir):
        self._same_worker_as_before(pid_dir)


@pytest.fixture
def payload():
    return {"numbers": [1.0, 2.0, 3.0]}


class TestFixturesReachRanks(DistributedTest):
    # (f) Fixture values and parametrize arguments are pickled to every rank.
    world_size = 2
    reuse_dist_env = True

    @pytest.mark.parametrize("scale", [2, 3])
    def test_fixtures(self, tmpdir, tmp_path, payload, scale):
        rank = dist.get_rank()
        # All ranks got the parent's temporary directory, so they can exchange files through it.
        assert str(tmpdir) == str(tmp_path)
        tmpdir.join(f"rank{rank}.txt").write(str(scale))
        dist.barrier()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.txt", "rank1.txt"]

        value = torch.tensor(payload["numbers"]) * scale
        dist.all_reduce(value)
        assert value.tolist() == [2.0 * scale * n for n in payload["numbers"]]
