# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Upstream's style gate (python -m forktools style): the series passes it, and each kind of problem is named."""

import re
import subprocess
import sys

import pytest
from conftest import REPO, copy_repo
from conftest import git as conftest_git

from forktools import pq
from forktools.series import series_names

# Amending and rebasing in the queue needs a committer; the patches keep their authors.
IDENTITY = ("-c", "user.name=Test Maintainer", "-c", "user.email=test@example.invalid")
LINEAR = "deepspeed/runtime/zero/linear.py"
FORK_INFO = "deepspeed/fork_info.py"
NEW_FILE = "deepspeed/runtime/zero/empty_params.py"
CUDA_CALL = "    torch.cuda.synchronize()"
# Longer than upstream's 119 columns, and a line yapf can split.
LONG_LINE = ("unforwarded_patch_names = [patch['name'] for patch in patches "
             "if patch['forwarded'] == 'no' and patch['applied_upstream'] == 'no' and patch['name']]")
OTHER_SIGNOFF = "Signed-off-by: Someone Else <someone.else@example.invalid>"
SHM_H = "csrc/cpu/comm/shm.h"
# A declaration clang-format with upstream's style writes as "int shm_ranks(int size) { return size; }".
UNFORMATTED_CPP = "int  shm_ranks ( int size ){return size;}"


def style_gate(repo, sdist):
    # Run the copy's own forktools: `python -m` puts the working directory first on sys.path.
    command = [sys.executable, "-m", "forktools", "style", "--sdist", str(sdist)]
    return subprocess.run(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def reported(output):
    """(path, line) -> message, for every ``path:line: message`` line of the gate's output."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"^(\S+):(\d+): (.*)$", line)
        if match:
            found[(match.group(1), int(match.group(2)))] = match.group(3)
    return found


def git(queue, *args):
    return conftest_git(queue, *IDENTITY, *args)


def patch_changing(repo, target):
    """Position (1-based) in the series of the one patch that changes ``target``, and its file name."""
    found = [(number, name) for number, name in enumerate(series_names(repo), start=1)
             if f"diff --git a/{target} b/{target}" in (repo / "patches" / name).read_text()]
    assert len(found) == 1, f"expected one patch changing {target}, found {found}"
    return found[0]


def rewrite_patch(queue, number, edit_tree=None, edit_message=None):
    """Amend the queue's commit of patch ``number`` and replay the later patches on it."""
    commit = git(queue, "rev-list", "--reverse", "upstream..HEAD").split()[number - 1]
    git(queue, "checkout", "-q", commit)
    if edit_tree:
        edit_tree(queue)
        git(queue, "add", "-A")
    message = git(queue, "log", "-1", "--format=%B")
    if edit_message:
        message = edit_message(message)
    git(queue, "commit", "-q", "--amend", "--cleanup=whitespace", "-m", message)
    git(queue, "rebase", "-q", "--onto", "HEAD", commit, "patch-queue")


def append_lines(path, *lines):
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def line_number(path, text):
    lines = path.read_text().splitlines()
    assert lines.count(text) == 1, text
    return lines.index(text) + 1


@pytest.fixture(scope="module")
def broken_series(tmp_path_factory, upstream_sdist):
    """A copy of the repository whose series has one problem of each kind, and the gate's verdict on it.

    A gate run builds the patched tree and runs yapf over every file the series changes (seconds
    per run), so the problems share one series and one run: the report must name each of them at
    its file and line, and nothing else.
    """
    root = tmp_path_factory.mktemp("style-gate")
    repo = copy_repo(root / "repo")
    queue = pq.import_queue(repo, root / "queue", sdist=upstream_sdist)

    # An added line that calls torch.cuda, in the patch that changes linear.py (which imports torch).
    linear_patch, _ = patch_changing(repo, LINEAR)
    rewrite_patch(queue, linear_patch, lambda tree: append_lines(tree / LINEAR, "", "", "def _wait():", CUDA_CALL))
    # An added line that yapf would split, in the patch that adds fork_info.py.
    assert len(LONG_LINE) > 119
    fork_info_patch, _ = patch_changing(repo, FORK_INFO)
    rewrite_patch(queue, fork_info_patch, lambda tree: append_lines(tree / FORK_INFO, LONG_LINE))
    # A C++ line clang-format would reformat, in the patch that changes shm.h.
    shm_patch, _ = patch_changing(repo, SHM_H)
    rewrite_patch(queue, shm_patch, lambda tree: append_lines(tree / SHM_H, UNFORMATTED_CPP))
    # A sign-off by someone else than the author, in the first patch.
    rewrite_patch(queue, 1, edit_message=lambda text: re.sub(r"(?m)^Signed-off-by: .*$", OTHER_SIGNOFF, text))
    # A new module without the license header, in the last patch.
    new_module = ['"""Zero-element parameters."""', "", "", "def is_empty(param):", "    return param.numel() == 0"]
    rewrite_patch(queue, len(series_names(repo)), lambda tree: append_lines(tree / NEW_FILE, *new_module))
    assert pq.export_queue(repo, queue)

    first_patch = repo / "patches" / series_names(repo)[0]
    expected = {
        "torch.cuda": (LINEAR, line_number(queue / LINEAR, CUDA_CALL)),
        "yapf": (FORK_INFO, line_number(queue / FORK_INFO, LONG_LINE)),
        "clang-format": (SHM_H, line_number(queue / SHM_H, UNFORMATTED_CPP)),
        "dco": (f"patches/{first_patch.name}", line_number(first_patch, OTHER_SIGNOFF)),
        "license": (NEW_FILE, 1),
    }
    proc = style_gate(repo, upstream_sdist)
    return proc, reported(proc.stdout), expected


def test_current_series_passes(upstream_sdist):
    # The repository itself, so the fork's tests under tests/unit are checked too.
    proc = style_gate(REPO, upstream_sdist)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.startswith("style gate passed:"), proc.stdout
    assert not reported(proc.stdout)


def test_added_torch_cuda_call_fails_naming_file_and_line(broken_series):
    proc, problems, expected = broken_series
    assert proc.returncode == 1, proc.stdout
    assert "torch.cuda" in problems[expected["torch.cuda"]], proc.stdout
    assert "get_accelerator()" in problems[expected["torch.cuda"]]


def test_added_line_yapf_would_reformat_fails_naming_file_and_line(broken_series):
    proc, problems, expected = broken_series
    assert proc.returncode == 1, proc.stdout
    assert problems[expected["yapf"]].startswith("yapf"), proc.stdout


def test_added_cpp_line_clang_format_would_reformat_fails_naming_file_and_line(broken_series):
    proc, problems, expected = broken_series
    assert proc.returncode == 1, proc.stdout
    assert problems[expected["clang-format"]] == "clang-format (upstream's style) would reformat this line", proc.stdout


def test_signoff_other_than_the_author_fails_naming_the_patch(broken_series):
    proc, problems, expected = broken_series
    assert proc.returncode == 1, proc.stdout
    message = problems[expected["dco"]]
    assert message.startswith("DCO:"), proc.stdout
    assert "Someone Else <someone.else@example.invalid>" in message


def test_added_module_without_license_header_fails(broken_series):
    proc, problems, expected = broken_series
    assert proc.returncode == 1, proc.stdout
    assert problems[expected["license"]].startswith("license header:"), proc.stdout


def test_gate_reports_those_problems_and_no_other(broken_series):
    proc, problems, expected = broken_series
    assert set(problems) == set(expected.values()), proc.stdout
    assert "style gate failed: 5 problem(s)" in proc.stdout
