# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The gbp-pq-like maintainer workflow: import the series as git commits, export it back."""

import subprocess

from conftest import forktools, git, tree_files

from forktools.series import series_names


def import_queue(repo, sdist, queue):
    proc = forktools(repo, "pq", "import", "--dir", str(queue), "--sdist", str(sdist))
    assert proc.returncode == 0, proc.stdout
    return queue


def test_import_makes_one_commit_per_patch_on_the_pristine_base(repo_copy, upstream_sdist, tmp_path):
    queue = import_queue(repo_copy, upstream_sdist, tmp_path / "queue")
    subjects = git(queue, "log", "--format=%s", "upstream..HEAD").splitlines()[::-1]
    assert len(subjects) == len(series_names(repo_copy))
    assert git(queue, "log", "--format=%s", "-1", "upstream").strip() == "deepspeed 0.19.8 (pristine sdist)"
    # The base commit is the sdist itself, byte for byte.
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    subprocess.run(["tar", "xzf", str(upstream_sdist), "-C", str(pristine)], check=True)
    git(queue, "checkout", "-q", "upstream")
    assert {
        k: v
        for k, v in tree_files(queue).items() if k.parts[0] != ".git"
    } == tree_files(pristine / "deepspeed-0.19.8")


def test_export_of_untouched_queue_changes_no_file(repo_copy, upstream_sdist, tmp_path):
    before = tree_files(repo_copy / "patches")
    queue = import_queue(repo_copy, upstream_sdist, tmp_path / "queue")
    proc = forktools(repo_copy, "pq", "export", "--dir", str(queue))
    assert proc.returncode == 0, proc.stdout
    assert "patches/ is up to date" in proc.stdout
    assert tree_files(repo_copy / "patches") == before


def test_export_writes_back_an_edited_patch_only(repo_copy, upstream_sdist, tmp_path):
    before = tree_files(repo_copy / "patches")
    first = series_names(repo_copy)[0]
    queue = import_queue(repo_copy, upstream_sdist, tmp_path / "queue")
    # Amend the first commit's message, as a maintainer rewording a patch would.
    git(queue, "-c", "user.name=Test Maintainer", "-c", "user.email=test@example.invalid", "-c",
        "sequence.editor=sed -i 1s/^pick/reword/", "-c", "core.editor=sed -i 's/^Root cause:/Cause:/'", "rebase", "-q",
        "-i", "--committer-date-is-author-date", "upstream")
    proc = forktools(repo_copy, "pq", "export", "--dir", str(queue))
    assert proc.returncode == 0, proc.stdout
    after = tree_files(repo_copy / "patches")
    changed = {name.name for name in after if after[name] != before.get(name)}
    assert changed == {first}
    assert b"\nCause:" in next(data for name, data in after.items() if name.name == first)


def test_import_refuses_to_replace_an_existing_queue(repo_copy, upstream_sdist, tmp_path):
    queue = import_queue(repo_copy, upstream_sdist, tmp_path / "queue")
    marker = queue / "work-in-progress.txt"
    marker.write_text("unsaved work")
    proc = forktools(repo_copy, "pq", "import", "--dir", str(queue), "--sdist", str(upstream_sdist))
    assert proc.returncode != 0
    assert "already exists" in proc.stdout
    assert marker.read_text() == "unsaved work"


def test_export_refuses_uncommitted_changes(repo_copy, upstream_sdist, tmp_path):
    queue = import_queue(repo_copy, upstream_sdist, tmp_path / "queue")
    (queue / "setup.py").write_text("# edited\n")
    before = tree_files(repo_copy / "patches")
    proc = forktools(repo_copy, "pq", "export", "--dir", str(queue))
    assert proc.returncode != 0
    assert "uncommitted changes" in proc.stdout
    assert tree_files(repo_copy / "patches") == before


def test_export_writes_a_csrc_change_to_the_sdist_copy_too(repo_copy, upstream_sdist, tmp_path):
    """In upstream's repository deepspeed/ops/csrc is a link to csrc/; the sdist holds a copy, which the wheel
    installs. A change made to csrc/ in the queue is exported to both, so the patch works outside the build."""
    source, copy = "csrc/cpu/comm/shm.h", "deepspeed/ops/csrc/cpu/comm/shm.h"
    queue = import_queue(repo_copy, upstream_sdist, tmp_path / "queue")
    (queue / source).write_text((queue / source).read_text() + "// a maintainer's edit\n")
    git(queue, "-c", "user.name=Test Maintainer", "-c", "user.email=test@example.invalid", "commit", "-q", "-m",
        "comm: a new patch that edits csrc/ only", "--", source)
    proc = forktools(repo_copy, "pq", "export", "--dir", str(queue))
    assert proc.returncode == 0, proc.stdout
    new_patch = repo_copy / "patches" / series_names(repo_copy)[-1]
    text = new_patch.read_text()
    assert f"diff --git a/{source} b/{source}" in text and f"diff --git a/{copy} b/{copy}" in text
    # The queue itself is left as it was: its commit still changes csrc/ only ...
    assert git(queue, "show", "--format=", "--name-only", "HEAD").split() == [source]
    # ... and importing the exported series gives a queue whose commits hold both, which exports unchanged.
    before = tree_files(repo_copy / "patches")
    again = import_queue(repo_copy, upstream_sdist, tmp_path / "again")
    assert git(again, "show", "--format=", "--name-only", "HEAD").split() == [source, copy]
    proc = forktools(repo_copy, "pq", "export", "--dir", str(again))
    assert proc.returncode == 0 and "patches/ is up to date" in proc.stdout, proc.stdout
    assert tree_files(repo_copy / "patches") == before
