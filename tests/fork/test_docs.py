# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The docs name what exists: topics of the series (never patch numbers, which move at every refresh), test
files of this repository, and the generated parts (README.md's version label, docs/topics.md's table of topics)
are those of the series; README.md opens with the quick start."""

import re
import shutil

import pytest
from conftest import REPO, forktools

from forktools.series import TEST_UPDATES_DIR, read_series

DOCS = sorted([*REPO.glob("*.md"), *(REPO / "docs").glob("*.md"), *(REPO / "benchmarks").glob("*.md")])
# Stand-ins a doc uses for any patch, topic or file.
PLACEHOLDERS = ("NNNN", "TOPIC", "...", "*")


def doc_ids():
    return [path.relative_to(REPO).as_posix() for path in DOCS]


def topic_references(text):
    """Every name a doc gives as a topic: "topic `NAME`" (or "topics `A` and `B`"), a backticked name in a table
    column headed "topic", and the value of a ``Topic:`` or ``Depends-On:`` line."""
    names = []
    # A topic's name has no dot: "topic `a-b`, `test_x.py`" names one topic, then a file.
    for match in re.finditer(r"\btopics?\s+((?:`[\w-]+`(?:,\s*|\s+and\s+|\s+or\s+)?)+)", text):
        names += re.findall(r"`([^`]+)`", match.group(1))
    column = None
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            column = None
        elif column is None and "topic" in cells:
            column = cells.index("topic")
        elif column is not None and column < len(cells):
            names += re.findall(r"`([^`]+)`", cells[column])
    for match in re.finditer(r"^\s*(?:Topic|Depends-On):\s*(\S.*?)\s*(?:#.*)?$", text, re.M):
        names += match.group(1).split()
    return [name for name in names if not any(mark in name for mark in PLACEHOLDERS)]


def file_references(text):
    """Paths of test, benchmark and example files a doc names, and bare test file names (``test_*.py``)."""
    paths = re.findall(r"\b((?:tests|benchmarks|examples)/[\w./-]*\w\.(?:py|sh))\b", text)
    names = re.findall(r"`(?:[\w./-]*/)?(test_\w+\.py)(?:::\w+)?`", text)
    return ([p for p in paths if not any(mark in p for mark in PLACEHOLDERS)], names)


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_doc_names_topics_not_patch_numbers(doc):
    text = doc.read_text()
    numbers = re.findall(r"(?<![\w.+-])0\d{3}(?:-[\w.-]+)?(?![\w.])", text)
    assert not numbers, f"{doc.name} cites patches by number ({', '.join(numbers)}): name their topic instead"


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_doc_names_only_topics_of_the_series(doc):
    topics = {patch.topic for patch in read_series(REPO)}
    unknown = sorted(set(topic_references(doc.read_text())) - topics)
    assert not unknown, f"{doc.name} names topics the series does not have: {unknown} (known: {sorted(topics)})"


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_doc_names_only_files_that_exist(doc):
    paths, names = file_references(doc.read_text())
    missing = [path for path in paths if not (REPO / path).exists()]
    # A bare test file name is one of ours, or one of upstream's that a topic's test update changes.
    known = {path.name for path in (REPO / "tests").rglob("test_*.py")}
    for update in (REPO / TEST_UPDATES_DIR).glob("*.patch"):
        known.update(re.findall(r"^diff --git a/\S*/(test_\w+\.py) ", update.read_text(), re.M))
    missing += [name for name in names if name not in known]
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_checks_find_what_they_look_for():
    """The three checks above see a stale reference of each kind."""
    text = ("Fixed by patch 0004 (topic `no-such-topic`), tested in `tests/unit/no_such_test.py` and "
            "`test_nowhere.py`.\n\n| path | topic |\n|---|---|\n| x | `gone-topic` |\n\nDepends-On: other-gone\n")
    assert re.findall(r"(?<![\w.+-])0\d{3}(?:-[\w.-]+)?(?![\w.])", text) == ["0004"]
    assert topic_references(text) == ["no-such-topic", "gone-topic", "other-gone"]
    assert file_references(text) == (["tests/unit/no_such_test.py"], ["test_nowhere.py"])


def test_topics_table_and_version_label_are_those_of_the_series():
    proc = forktools(REPO, "readme", "--check")
    assert proc.returncode == 0, proc.stdout
    table = (REPO / "docs" / "topics.md").read_text()
    for patch in read_series(REPO):
        assert patch.dep3["Summary"] in table, patch.name


def test_topics_table_names_direct_dependencies():
    table = (REPO / "docs" / "topics.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| `checkpoint-nvme-offload-record` |"))
    depends_on = row.split(" | ")[2]
    assert depends_on == ("`checkpoint-tag-manifest`, `checkpoint-crc32`, `checkpoint-reclaim-temps`, "
                          "`checkpoint-crash-consistency`"), row


def test_readme_is_short_and_opens_with_the_quick_start():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 15 * 1024
    assert "## Quick start" in "\n".join(readme.splitlines()[:80])


def test_readme_check_fails_when_the_series_changed(repo_copy):
    shutil.copytree(REPO / "docs", repo_copy / "docs")
    patch = read_series(repo_copy)[0]
    patch.path.write_text(patch.path.read_text().replace("Summary: ", "Summary: Newly worded: ", 1))
    proc = forktools(repo_copy, "readme", "--check")
    assert proc.returncode == 1 and "docs/topics.md out of date" in proc.stdout, proc.stdout
    proc = forktools(repo_copy, "readme")
    assert proc.returncode == 0, proc.stdout
    assert "| Newly worded: " in (repo_copy / "docs" / "topics.md").read_text()
    assert forktools(repo_copy, "readme", "--check").returncode == 0
