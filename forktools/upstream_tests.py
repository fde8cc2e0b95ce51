"""``python -m forktools upstream-tests``: upstream's own unit tests, run unchanged against the pinned
release and against the fork, and the test ids whose verdict differs.

Upstream's tests live in its repository, not in the sdist. This takes a checkout (or a bare clone) of
that repository, extracts its ``tests/`` folder into a work directory (never into this repository),
builds the pristine release (the empty series) and the fork with the build backend, installs each
into a venv of its own (which sees the running environment's packages, torch and pytest among them,
behind its own deepspeed), and runs the same selection in both, on CPU.
"""

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from forktools import ForkError
from forktools.backend import REPO, patched_wheel
from forktools.git import plain_tree_env, run_git
from forktools.series import TEST_UPDATES_DIR, read_series
from forktools.upstream import removing_new_shm_segments

# What finishes in about an hour on 2 cores: the checkpoint tests the series touches most, without
# the largest files (test_zero_optimizer.py, test_universal_checkpoint.py: pass --select for them).
DEFAULT_SELECTION = (
    "unit/checkpoint/test_convert_checkpoint.py",
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_shared_weights.py",
    "unit/checkpoint/test_reshape_checkpoint.py",
    "unit/checkpoint/test_autotp_uc_checkpoint.py",
    "unit/runtime/zero/test_zero_leaf_module.py",
)
# As upstream's CPU job, on this machine: LOCAL_SIZE makes the CPU accelerator report 4 devices, or
# the harness skips every test of more ranks than NUMA nodes.
TEST_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "LOCAL_SIZE": "4"}
BUILDS = ("pristine", "fork")


@dataclass
class Verdicts:
    version: str
    outcomes: dict = field(default_factory=dict)  # test id -> (outcome, first line of its error)

    def count(self, outcome):
        return sum(1 for o, _ in self.outcomes.values() if o == outcome)


def extract_tests(upstream, dest):
    """``tests/`` of the upstream repository's HEAD, as ``dest/tests``; returns (tests folder, commit)."""
    commit = run_git(["rev-parse", "--short", "HEAD"], upstream, check=False)
    archive = run_git(["archive", "HEAD", "tests"], upstream, check=False, binary=True)
    if commit.returncode != 0 or archive.returncode != 0:
        error = archive.stderr.decode(errors="replace") if commit.returncode == 0 else commit.stdout
        raise ForkError(f"{upstream} is not a git repository of upstream DeepSpeed with a tests/ folder:\n" +
                        error.strip())
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "tests", commit.stdout.strip()


def apply_test_updates(tests_dir, updates):
    """``tests_dir`` with ``updates`` (patch files against upstream's tests/) applied, as a copy beside it."""
    root = tests_dir.parent / "updated"
    shutil.copytree(tests_dir, root / "tests")
    for patch in updates:
        proc = run_git(["apply", str(patch)], root, plain_tree_env(root), check=False)
        if proc.returncode != 0:
            raise ForkError(f"{patch} does not apply to upstream's tests:\n{proc.stdout.strip()}")
    return root / "tests"


def build_wheel(name, workdir, sdist):
    """The wheel of ``name``: the pristine release (the empty series) or the fork."""
    patches = [] if name == "pristine" else read_series(REPO)
    return patched_wheel(workdir / "build", {"sdist": sdist}, patches)


def install(name, workdir, wheel):
    """Install ``wheel`` into a venv of its own; returns its python."""
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True,
                          text=True,
                          check=True).stdout.strip()
    # After the venv's own site-packages: its deepspeed comes first, everything else from here.
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "forktools-base.pth").write_text("".join(f"{path}\n" for path in paths))
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                           str(wheel)],
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        raise ForkError(f"installing the {name} wheel failed:\n{proc.stdout[-2000:]}")
    return python


def run_tests(python, tests_dir, selection, keyword, workdir):
    junit = workdir / "junit.xml"
    command = [str(python), "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}"]
    if keyword:
        command += ["-k", keyword]
    env = dict(os.environ, **TEST_ENV, TORCH_EXTENSIONS_DIR=str(workdir / "torch_extensions"))
    env.pop("PYTHONPATH", None)
    with removing_new_shm_segments():
        subprocess.run(command + list(selection), cwd=tests_dir, env=env, stdout=subprocess.DEVNULL)
    if not junit.exists():
        raise ForkError(f"pytest wrote no results for {selection} (does the selection exist in {tests_dir}?)")
    version = subprocess.run([str(python), "-c", "import deepspeed; print(deepspeed.__version__)"],
                             capture_output=True,
                             text=True,
                             env=env).stdout.strip().splitlines()[-1:]
    return Verdicts(version[0] if version else "?", read_junit(junit))


def read_junit(path):
    outcomes = {}
    for case in ET.parse(path).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = element.get("message") or element.text or ""
                detail = text.strip().splitlines()[0] if text.strip() else ""
                break
        outcomes[test_id] = (outcome, detail)
    return outcomes


def report(verdicts, commit, selection, updates=()):
    """The summary to print, and the ids that pass on the pristine release and fail on the fork (an id
    that the series' updates of upstream tests removed is listed, not counted)."""

    def outcome(name, test_id):
        return verdicts[name].outcomes.get(test_id, ("absent", ""))

    lines = [f"upstream tests at {commit}: {' '.join(selection)}"]
    if updates:
        lines.append(f"  the fork runs them with the series' updates: {', '.join(p.name for p in updates)}")
    for name in BUILDS:
        v = verdicts[name]
        lines.append(f"  {name} {v.version}: {v.count('passed')} passed, {v.count('failed')} failed, "
                     f"{v.count('skipped')} skipped")
    ids = set().union(*(v.outcomes for v in verdicts.values()))
    differing = sorted(t for t in ids if outcome("pristine", t)[0] != outcome("fork", t)[0])
    lines.append(f"differing verdicts: {len(differing)}")
    for test_id in differing:
        lines.append(f"  {test_id}")
        for name in BUILDS:
            result, detail = outcome(name, test_id)
            lines.append(f"    {name}: {result}{': ' + detail if detail else ''}")
    regressions = [t for t in differing if outcome("pristine", t)[0] == "passed" and outcome("fork", t)[0] == "failed"]
    return "\n".join(lines), regressions


def run(upstream, workdir, selection=DEFAULT_SELECTION, keyword=None, sdist=None, wheels=None, updates=None):
    """Run ``selection`` of ``upstream``'s tests against both builds (``wheels``: name -> wheel already
    built; ``updates``: the series' updates of upstream tests, default those in patches/upstream-tests/);
    returns the report and the regressions (see report())."""
    tests_dir, commit = extract_tests(Path(upstream), workdir)
    if updates is None:
        updates = sorted((REPO / TEST_UPDATES_DIR).glob("*.patch"))
    tests_dirs = {"pristine": tests_dir, "fork": apply_test_updates(tests_dir, updates)}
    verdicts = {}
    for name in BUILDS:
        build_dir = workdir / name
        build_dir.mkdir()
        print(f"building and installing {name} ...", file=sys.stderr, flush=True)
        wheel = wheels[name] if wheels else build_wheel(name, build_dir, sdist)
        python = install(name, build_dir, wheel)
        print(f"running the selection against {name} ...", file=sys.stderr, flush=True)
        verdicts[name] = run_tests(python, tests_dirs[name], selection, keyword, build_dir)
    return report(verdicts, commit, selection, updates)
