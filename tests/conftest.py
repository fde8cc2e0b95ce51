# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""pytest hooks that route ``DistributedTest`` methods (tests/unit/common.py) into the multi-rank harness."""

import os
import sys

import pytest

# Tests import the harness as ``from unit.common import DistributedTest``, so this directory must be on
# sys.path. pytest's default 'prepend' import mode already puts a rootdir conftest's directory there; doing
# it here as well keeps that working under --import-mode=importlib and when pytest runs from elsewhere.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from unit.common import DistributedTest, WORLD_SIZE_FIXTURE, run_distributed_test, shutdown_pools, world_sizes_for

# pytester lets the harness's own tests run an inner pytest session on generated test files.
pytest_plugins = ["pytester"]


def pytest_configure(config):
    # Registered here as well as in pytest.ini so that a copy of this conftest works on its own.
    config.addinivalue_line("markers", "world_size(*sizes): run a DistributedTest method at these world size(s)")
    config.addinivalue_line("markers", "sequential: test must not run in parallel with others")


@pytest.fixture(autouse=True, name=WORLD_SIZE_FIXTURE)
def _dist_world_size_fixture(request):
    """Stand-in that pytest_generate_tests parametrizes when a DistributedTest runs at several world sizes.

    Parametrizing needs a name that is among the test's fixtures; being autouse makes it one everywhere
    without the test methods having to declare it. Its value is read by the harness, not by the tests.
    """
    return getattr(request, "param", None)


def pytest_generate_tests(metafunc):
    cls = metafunc.cls
    if cls is None or not issubclass(cls, DistributedTest):
        return
    sizes = world_sizes_for(cls, metafunc.definition)
    if len(sizes) > 1:
        # One item per size, e.g. test_foo[world_size=1] and test_foo[world_size=2].
        metafunc.parametrize(WORLD_SIZE_FIXTURE, sizes, ids=[f"world_size={size}" for size in sizes])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if isinstance(pyfuncitem.instance, DistributedTest):
        run_distributed_test(pyfuncitem)
        # Returning True tells pytest the call was handled: the method must not also run in this process.
        return True
    return None


def pytest_sessionfinish(session, exitstatus):
    # Stop the worker pools kept for reuse_dist_env classes; they would otherwise live until interpreter exit.
    shutdown_pools()
