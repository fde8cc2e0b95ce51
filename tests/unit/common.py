# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Test harness that runs each test method of a ``DistributedTest`` subclass on several ranks.

Interface (matches the one upstream DeepSpeed's unit tests are written against)::

    from unit.common import DistributedTest

    class TestAllReduce(DistributedTest):
        world_size = 2             # or a list: one run per size; @pytest.mark.world_size(n) overrides
        reuse_dist_env = False     # True: keep the rank processes alive across tests
        exec_timeout = 600         # seconds the test body may take on all ranks
        backend = "gloo"           # default: the accelerator's communication backend
        init_distributed = True    # call deepspeed.init_distributed() before the test body
        set_dist_env = True        # set MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE

        def test_sum(self, tmpdir):
            ...

How it works: ``tests/conftest.py`` parametrizes the world sizes at collection time and, at call time,
hands every ``DistributedTest`` item to :func:`run_distributed_test`. That pickles the test instance, the
method name and the fixture values the method asks for, and sends them to one worker process per rank.
Workers are started with the 'forkserver' (or 'spawn') start method, never 'fork': forking a process in
which torch has started threads can deadlock. Each worker sets the distributed environment variables,
initialises the process group once, then runs the tasks it is sent and reports back an outcome (passed,
skipped, xfailed or a formatted traceback). The parent turns the per-rank outcomes into one pytest outcome.
"""

import ast
import atexit
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest

from deepspeed.accelerator import get_accelerator

# Seconds a test body may run on all ranks before the harness kills the ranks and fails the test.
DEFAULT_EXEC_TIMEOUT = 600

# Seconds the ranks may take to start: spawning the processes, importing deepspeed and initialising the
# process group (which on CPU JIT-builds a shared-memory comm op the first time: about two minutes on two
# cores). Counted separately from exec_timeout so that a small exec_timeout bounds the test body only.
WORKER_START_TIMEOUT = 600

# Once one rank has failed (or skipped), its peers are often blocked in a collective waiting for it and
# will never finish on their own. Give them this many seconds to report, then kill them.
FAILURE_GRACE_SECONDS = 5.0

# Seconds to wait for workers to exit cleanly (destroying their process group) before killing them.
SHUTDOWN_TIMEOUT = 30.0

# Name of the (autouse) fixture that tests/conftest.py parametrizes when a test runs at several world sizes.
WORLD_SIZE_FIXTURE = "_dist_world_size"

# Multiprocessing start method for the rank processes. 'forkserver' forks each worker from a clean server
# process that has already imported torch (and, on CPU-only machines, deepspeed), which saves seconds per
# test compared with 'spawn'. The environment variable lets one fall back to 'spawn' when debugging.
START_METHOD_ENV = "DS_UNIT_TEST_START_METHOD"


def get_master_port():
    """Return a TCP port that was free a moment ago, found by letting the OS pick one (binding port 0).

    Never assume a fixed port is free: several test sessions may run on the same machine.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DistributedTest:
    """Base class for tests whose methods run on ``world_size`` ranks, each in its own process.

    See the module docstring for the class attributes. Methods are collected by pytest as usual; the
    conftest routes their execution through :func:`run_distributed_test`.
    """
    world_size = 2
    reuse_dist_env = False
    exec_timeout = DEFAULT_EXEC_TIMEOUT
    backend = get_accelerator().communication_backend_name()
    init_distributed = True
    set_dist_env = True


# --------------------------------------------------------------------------------------------------------------
# World sizes
# --------------------------------------------------------------------------------------------------------------


def _as_world_sizes(value, where):
    """Normalise an int or a (nested) sequence of ints to a list of positive ints."""
    if isinstance(value, (list, tuple)):
        sizes = []
        for v in value:
            sizes.extend(_as_world_sizes(v, where))
    else:
        sizes = [value]
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{where}: world_size must be a positive int or a list of them, got {value!r}")
    return sizes


def world_sizes_for(cls, node):
    """The world sizes a test runs at: the closest ``world_size`` marker, else the class attribute."""
    marker = node.get_closest_marker("world_size")
    if marker is not None:
        if not marker.args:
            raise ValueError(f"{node.nodeid}: @pytest.mark.world_size needs at least one size")
        return _as_world_sizes(list(marker.args), node.nodeid)
    return _as_world_sizes(cls.world_size, f"{node.nodeid}: {cls.__name__}.world_size")


def world_size_of_item(item):
    """The single world size one collected test item runs at."""
    callspec = getattr(item, "callspec", None)
    if callspec is not None and WORLD_SIZE_FIXTURE in callspec.params:
        return callspec.params[WORLD_SIZE_FIXTURE]
    sizes = world_sizes_for(type(item.instance), item)
    if len(sizes) != 1:
        # Only happens when the conftest hook that parametrizes the world sizes is missing.
        raise RuntimeError(f"{item.nodeid} has several world sizes {sizes} but was not parametrized over them; "
                           "is tests/conftest.py loaded?")
    return sizes[0]


# --------------------------------------------------------------------------------------------------------------
# Worker side (runs in the rank processes)
# --------------------------------------------------------------------------------------------------------------


def _set_dist_env(rank, world_size, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_SIZE"] = str(world_size)


def _import_test_module(name, path, rewrite_asserts):
    """Import the module that defines the test class, so that the pickled instance can be loaded.

    When pytest rewrites asserts in the parent, do the same here: otherwise a failing ``assert a == b`` on a
    rank would report a bare ``AssertionError`` without the values. Loading from the file (rather than by
    name) also works for modules pytest imported with a name that is not importable from ``sys.path``.
    """
    if name in sys.modules:
        return
    if path is None:
        importlib.import_module(name)
        return
    code = None
    if rewrite_asserts:
        try:
            from _pytest.assertion.rewrite import rewrite_asserts as _rewrite
            source = Path(path).read_bytes()
            tree = ast.parse(source, filename=path)
            _rewrite(tree, source, path)
            code = compile(tree, path, "exec", dont_inherit=True)
        except Exception:
            # Rewriting is a nicety; fall back to a plain import if pytest's internals ever change.
            code = None
    # Parent packages first, so that relative imports inside the test module work.
    package = name.rpartition(".")[0]
    if package:
        try:
            importlib.import_module(package)
        except ImportError:
            pass
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if code is not None:
            exec(code, module.__dict__)
        else:
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _release_model_parallel_groups():
    """Forget the tensor/model-parallel groups a test left in ``deepspeed.utils.groups``.

    DeepSpeed keeps them in module globals. On a reused worker the next test would inherit them: an
    engine built without tensor parallelism after an AutoTP one then sees a model-parallel world size
    of 2 and asks a missing ``mpu`` for its rank. Only references are dropped; nothing is destroyed.
    """
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None or not hasattr(groups, "_release_process_group_references"):
        return
    if any(getattr(groups, name, None) is not None for name in ("_TENSOR_MODEL_PARALLEL_GROUP", "mpu", "mesh_device")):
        groups._release_process_group_references(None)


def _run_task(task, rank, world_size, port, set_env):
    """Run one test method on this rank and return its outcome as a picklable tuple."""
    try:
        if set_env:
            # A previous test on a reused worker may have changed these.
            _set_dist_env(rank, world_size, port)
        _import_test_module(task["module"], task["path"], task["rewrite_asserts"])
        instance, method_name, kwargs = pickle.loads(task["payload"])
        getattr(instance, method_name)(**kwargs)
        # Flush pending device work so that asynchronous errors are attributed to this test.
        get_accelerator().synchronize()
        return ("passed", None)
    except pytest.skip.Exception as exc:
        return ("skipped", str(exc.msg))
    except pytest.xfail.Exception as exc:
        return ("xfailed", str(exc.msg))
    except BaseException as exc:
        # BaseException: pytest.fail() and pytest.exit() raise BaseException subclasses too, and a test
        # calling sys.exit() must not silently take the worker down. The first frame is this function's;
        # leave it out so that the report starts at the test.
        tb = exc.__traceback__.tb_next or exc.__traceback__
        return ("failed", "".join(traceback.format_exception(type(exc), exc, tb)))
    finally:
        _release_model_parallel_groups()


def _worker_main(rank, world_size, port, backend, init_distributed, set_env, conn, environ, cwd):
    """Entry point of one rank process: initialise, then run tasks until told to stop."""
    # A forkserver child inherits the server's environment and working directory, which may be older than
    # the parent's; restore the parent's so that the worker behaves like a freshly spawned one.
    os.environ.clear()
    os.environ.update(environ)
    try:
        os.chdir(cwd)
    except OSError:
        pass
    if set_env:
        _set_dist_env(rank, world_size, port)

    initialised = False
    try:
        import deepspeed
        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            # Bind the rank to its device before the process group is created (NCCL and friends need it).
            accelerator.set_device(rank)
        if init_distributed:
            deepspeed.init_distributed(dist_backend=backend)
            initialised = True
        conn.send(("ready", os.getpid()))
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        conn.close()
        return

    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            # The parent went away; nothing left to report to.
            break
        if task is None:
            break
        result = _run_task(task, rank, world_size, port, set_env)
        try:
            conn.send(result)
        except (BrokenPipeError, OSError):
            break

    # Tear down cleanly so that the process group's resources (sockets, threads) are released in order.
    import deepspeed.comm as dist
    try:
        if initialised and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    conn.close()


# --------------------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------------------

_mp_context = None


def _get_mp_context():
    global _mp_context
    if _mp_context is None:
        method = os.environ.get(START_METHOD_ENV)
        if not method:
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if method == "fork":
            raise ValueError(f"{START_METHOD_ENV}=fork is not supported: forking after torch started threads "
                             "can deadlock; use 'forkserver' or 'spawn'")
        _mp_context = multiprocessing.get_context(method)
        if method == "forkserver":
            # Import the heavy modules once in the server; every worker forked from it gets them for free.
            # deepspeed only on CPU: importing it on a GPU machine might initialise the device driver, which
            # must not happen in a process that later forks.
            preload = ["torch"]
            if get_accelerator().device_name() == "cpu":
                preload.append("deepspeed")
            _mp_context.set_forkserver_preload(preload)
    return _mp_context


def _kill_process_tree(proc):
    """Kill a worker and anything it started (e.g. data loader workers), which could otherwise linger."""
    if proc.pid is None:
        return
    try:
        import psutil
        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=10)


def _describe_exit(exitcode):
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            pass
    return f"exit code {exitcode}"


def _format_ranks(ranks):
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


class _WorkerPool:
    """``world_size`` rank processes, each with its own pipe, so rank r's task always goes to rank r."""

    def __init__(self, world_size, backend, init_distributed, set_dist_env):
        self.world_size = world_size
        self.backend = backend
        self.init_distributed = init_distributed
        self.set_dist_env = set_dist_env
        self.procs = []
        self.conns = []

    def start(self):
        """Start the ranks and wait until every one has initialised. Returns an error message or None."""
        error = self._start_once()
        if error is not None and "address already in use" in error.lower():
            # The free port we picked was taken by someone else before rank 0 could bind it; try another.
            self.kill()
            error = self._start_once()
        return error

    def _start_once(self):
        ctx = _get_mp_context()
        port = get_master_port()
        environ = dict(os.environ)
        cwd = os.getcwd()
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            # Not a daemon: daemonic processes may not start children, and tests do (e.g. data loaders).
            proc = ctx.Process(target=_worker_main,
                               args=(rank, self.world_size, port, self.backend, self.init_distributed,
                                     self.set_dist_env, child_conn, environ, cwd),
                               name=f"DistributedTest-rank{rank}",
                               daemon=False)
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        results, unfinished = self._collect(time.monotonic() + WORKER_START_TIMEOUT)
        failed = {rank: payload for rank, (status, payload) in results.items() if status != "ready"}
        if failed or unfinished:
            lines = [f"DistributedTest could not start {self.world_size} rank(s) with backend {self.backend!r}"]
            for rank, payload in sorted(failed.items()):
                lines += ["", f"----- rank {rank} -----", payload.rstrip()]
            if unfinished:
                waited = f"{FAILURE_GRACE_SECONDS:g}s after the failure" if failed else f"{WORKER_START_TIMEOUT:g}s"
                lines += ["", f"rank(s) {_format_ranks(unfinished)} had not finished initialising after {waited}"]
            return "\n".join(lines)
        return None

    def alive(self):
        return bool(self.procs) and all(proc.is_alive() for proc in self.procs)

    def run(self, task, timeout):
        """Send the task to every rank; returns (results by rank, ranks that did not finish)."""
        for conn in self.conns:
            conn.send(task)
        return self._collect(time.monotonic() + timeout)

    def _collect(self, deadline):
        """Gather one message per rank until all arrived or the deadline passed.

        Once a rank reports anything but success, the deadline is shortened to a grace period, because
        the remaining ranks are probably blocked waiting for the failed one.
        """
        results = {}
        pending = set(range(self.world_size))
        while pending:
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                # Read what arrived before checking liveness: a worker may report and then exit.
                if conn.poll():
                    try:
                        results[rank] = conn.recv()
                    except (EOFError, OSError):
                        proc.join(timeout=1)
                        results[rank] = ("failed", f"rank {rank} worker process exited unexpectedly "
                                         f"({_describe_exit(proc.exitcode)}) without reporting a result")
                    pending.discard(rank)
                elif not proc.is_alive():
                    results[rank] = ("failed", f"rank {rank} worker process exited unexpectedly "
                                     f"({_describe_exit(proc.exitcode)}) without reporting a result")
                    pending.discard(rank)
            if not pending:
                break
            if any(status not in ("ready", "passed") for status, _ in results.values()):
                # min() keeps the first grace deadline: later iterations do not push it further out.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_SECONDS)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            multiprocessing.connection.wait(waitables, timeout=remaining)
        return results, pending

    def kill(self):
        for proc in self.procs:
            _kill_process_tree(proc)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def close(self, timeout=SHUTDOWN_TIMEOUT):
        """Ask the workers to tear down their process group and exit; kill the ones that do not."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()


# Reused pools, keyed by everything that is fixed when the ranks start.
_reused_pools = {}


def shutdown_pools():
    """Shut down every reused pool; called at the end of the pytest session (and at exit, as a fallback)."""
    while _reused_pools:
        _, pool = _reused_pools.popitem()
        pool.close()


# atexit handlers run last-registered first. multiprocessing.util (imported above) registered the handler
# that joins non-daemonic children at exit; ours, registered later, runs before it, so it never waits
# forever for a worker that is still alive.
atexit.register(shutdown_pools)


def _discard_pool(key):
    pool = _reused_pools.pop(key, None)
    if pool is not None:
        pool.kill()


def run_distributed_test(item):
    """Run one collected ``DistributedTest`` method on its ranks and turn the outcome into pytest's."""
    instance = item.instance
    cls = type(instance)
    world_size = world_size_of_item(item)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and world_size > accelerator.device_count():
        pytest.skip(f"world_size {world_size} needs more devices than the {accelerator.device_count()} available")

    # Inside the ranks, self.world_size is the size of this run, not the list the class may declare.
    instance.world_size = world_size
    kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    try:
        payload = pickle.dumps((instance, item.originalname, kwargs))
    except Exception as exc:
        pickle_error = exc
    else:
        pickle_error = None
    if pickle_error is not None:
        # Failing outside the except block keeps pytest from printing the pickling traceback as well.
        pytest.fail(
            f"DistributedTest {item.name}: the test instance and fixture values ({', '.join(kwargs)}) are "
            f"sent to the ranks by pickling, and pickling failed: {pickle_error!r}",
            pytrace=False)
    module = sys.modules.get(cls.__module__)
    task = {
        "module": cls.__module__,
        "path": getattr(module, "__file__", None),
        "rewrite_asserts": item.config.getoption("assertmode", "plain") == "rewrite",
        "payload": payload,
    }

    reuse = bool(cls.reuse_dist_env)
    key = (world_size, cls.backend, bool(cls.init_distributed), bool(cls.set_dist_env))
    pool = _reused_pools.get(key) if reuse else None
    if pool is not None and not pool.alive():
        # A worker died between tests (e.g. a test killed it on purpose); start afresh.
        _discard_pool(key)
        pool = None
    if pool is None:
        pool = _WorkerPool(*key)
        try:
            error = pool.start()
        except BaseException:
            pool.kill()
            raise
        if error is not None:
            pool.kill()
            pytest.fail(f"{error}\n(while starting {item.name})", pytrace=False)
        if reuse:
            _reused_pools[key] = pool

    try:
        results, unfinished = pool.run(task, cls.exec_timeout)
    except BaseException:
        # Interrupted (e.g. Ctrl-C) or the pipe broke: the ranks are in an unknown state.
        if reuse:
            _discard_pool(key)
        else:
            pool.kill()
        raise

    healthy = not unfinished and all(status == "passed" for status, _ in results.values())
    if reuse:
        if unfinished or any(status == "failed" for status, _ in results.values()):
            # A failed or timed-out test can leave the process group or global state broken.
            _discard_pool(key)
    elif unfinished:
        pool.kill()
    else:
        pool.close()

    if not healthy:
        _report(item.name, world_size, cls.exec_timeout, results, unfinished)


def _skip_at_item(reason):
    """Skip, reporting the test's location rather than this file's (as a skip raised in the test would)."""
    try:
        exc = pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:
        # That keyword is pytest-internal; without it the skip is still reported, only with this location.
        pytest.skip(reason)
    raise exc


def _report(name, world_size, exec_timeout, results, unfinished):
    failed = {rank: payload for rank, (status, payload) in results.items() if status == "failed"}
    if failed:
        lines = [f"DistributedTest {name} failed on rank(s) {_format_ranks(failed)} of {world_size}"]
        for rank, payload in sorted(failed.items()):
            lines += ["", f"----- rank {rank} -----", payload.rstrip()]
        if unfinished:
            lines += [
                "", f"rank(s) {_format_ranks(unfinished)} had not finished {FAILURE_GRACE_SECONDS:g}s after the "
                "failure (probably waiting for the failed rank in a collective) and were killed"
            ]
        pytest.fail("\n".join(lines), pytrace=False)
    # No rank failed. A skip or xfail on some rank decides the outcome even if its peers had to be killed
    # (they were waiting for it); otherwise ranks that did not finish mean a timeout.
    for status in ("skipped", "xfailed"):
        reasons = [payload for _, (s, payload) in sorted(results.items()) if s == status]
        if reasons:
            if status == "skipped":
                _skip_at_item(reasons[0])
            pytest.xfail(reasons[0])
    if unfinished:
        pytest.fail(
            f"DistributedTest timed out after {exec_timeout:g}s: rank(s) {_format_ranks(unfinished)} of "
            f"{world_size} did not finish {name}",
            pytrace=False)
