# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""``python -m forktools prs``: every topic as an upstream pull request that applies with ``git am``."""

import email
import email.policy
import mailbox
import os
import subprocess
import tarfile

import pytest

from forktools import ForkError
from forktools.prs import Topic, export_topics, fixes_not_standalone, record_verification
from forktools.series import read_series

from conftest import REPO

# The person exporting: their sign-off goes on every exported commit.
EXPORTER = "Test Exporter <exporter@example.invalid>"


def git_config_env(monkeypatch, folder, identity=None):
    """git sees only a configuration file of the test's own: with ``identity`` (``Name <email>``) as its user."""
    config = folder / "gitconfig"
    if identity:
        name, address = identity[:-1].split(" <")
        config.write_text(f"[user]\n\tname = {name}\n\temail = {address}\n")
    else:
        config.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


@pytest.fixture(scope="module")
def exported(upstream_sdist, tmp_path_factory):
    out = tmp_path_factory.mktemp("prs") / "upstream-prs"
    with pytest.MonkeyPatch.context() as monkeypatch:
        git_config_env(monkeypatch, out.parent, EXPORTER)
        return export_topics(REPO, out, sdist=upstream_sdist)


def pristine_repo(sdist, dest):
    """A git repository of the pristine upstream release, as a maintainer would make one."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    tree = next(dest.iterdir())
    env = dict(os.environ,
               GIT_AUTHOR_NAME="upstream",
               GIT_AUTHOR_EMAIL="upstream@invalid",
               GIT_COMMITTER_NAME="reviewer",
               GIT_COMMITTER_EMAIL="reviewer@invalid")
    for args in (["init", "-q"], ["add", "-A", "-f", "."], ["commit", "-q", "-m", "pristine"]):
        subprocess.run(["git", *args], cwd=tree, env=env, check=True)
    return tree, env


def git_am(tree, env, mailbox):
    return subprocess.run(["git", "am", "-q", str(mailbox)],
                          cwd=tree,
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT,
                          text=True)


def summary_lines(patch):
    """The lines of a patch file that hold its Summary: field."""
    lines = patch.path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Summary: "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    assert end > start + 1, "a summary long enough to go on over more lines"
    return lines[start:end]


def test_topics_cover_every_forwardable_patch(exported):
    patches = [p for p in read_series(REPO) if p.dep3.get("Forwarded") != "not-needed"]
    assert sorted(p.name for topic, _ in exported for p in topic.patches) == sorted(p.name for p in patches)
    for topic, topic_dir in exported:
        assert (topic_dir / f"{topic.name}.mbox").is_file()
        description = (topic_dir / "PR.md").read_text()
        assert description.startswith(f"# {topic.patches[0].subject}\n")
        assert "Root cause" in description and "## Verification" in description
        # The README's summary is the fork's own: neither it nor the lines that continue it go upstream.
        mailbox_text = (topic_dir / f"{topic.name}.mbox").read_text()
        for patch in topic.patches:
            for line in summary_lines(patch):
                assert line not in description.splitlines() and line not in mailbox_text.splitlines(), line
        for test in topic.tests:
            assert f"`{test}`" in description


def test_mailboxes_apply_in_series_order_with_their_tests(exported, upstream_sdist, tmp_path):
    tree, env = pristine_repo(upstream_sdist, tmp_path)
    for topic, topic_dir in exported:
        proc = git_am(tree, env, topic_dir / f"{topic.name}.mbox")
        assert proc.returncode == 0, f"{topic.name}: {proc.stdout}"
        for test in topic.tests:
            # The test goes upstream at the path and with the bytes it has here.
            assert (tree / test).read_bytes() == (REPO / test).read_bytes()
        # Upstream's layout: deepspeed/ops/csrc is a link to csrc/ there, so only csrc/ changes.
        mailbox_text = (topic_dir / f"{topic.name}.mbox").read_text()
        assert "diff --git a/deepspeed/ops/csrc/" not in mailbox_text, topic.name
    log = subprocess.run(["git", "log", "--format=%an <%ae>%n%B%n--end--", "HEAD~1..HEAD", "--reverse"],
                         cwd=tree,
                         stdout=subprocess.PIPE,
                         text=True,
                         check=True).stdout
    assert "Signed-off-by: " in log
    for field in ("Topic:", "Kind:", "Depends-On:", "Upstream-Tests:", "Forwarded:", "Applied-Upstream:", "Summary:"):
        assert field not in log


def test_each_commit_is_signed_off_by_its_author(exported):
    for topic, topic_dir in exported:
        messages = list(mailbox.mbox(topic_dir / f"{topic.name}.mbox", create=False))
        assert len(messages) == len(topic.patches) + (1 if topic.tests else 0)
        for message in messages:
            author = str(email.message_from_bytes(message.as_bytes(), policy=email.policy.default)["From"])
            assert f"Signed-off-by: {author}" in message.get_payload(), (topic.name, message["Subject"])


def test_each_commit_is_signed_off_by_the_exporter_after_its_author(exported):
    for topic, topic_dir in exported:
        for message in mailbox.mbox(topic_dir / f"{topic.name}.mbox", create=False):
            author = str(email.message_from_bytes(message.as_bytes(), policy=email.policy.default)["From"])
            signoffs = [
                line for line in message.get_payload().split("\n---\n")[0].splitlines()
                if line.startswith("Signed-off-by:")
            ]
            assert signoffs == [f"Signed-off-by: {author}", f"Signed-off-by: {EXPORTER}"], (topic.name, signoffs)
        description = (topic_dir / "PR.md").read_text()
        assert f"## Sign-off\n\nEvery commit carries its author's `Signed-off-by:` and, after it, that of {EXPORTER}" \
            in description


def test_export_without_a_git_identity_is_refused(repo_copy, upstream_sdist, tmp_path, monkeypatch):
    git_config_env(monkeypatch, tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ForkError, match="user.name and user.email are not set"):
        export_topics(repo_copy, out, sdist=upstream_sdist)
    assert not out.exists()


def test_independent_topics_apply_alone(exported, upstream_sdist, tmp_path):
    independent = [(topic, topic_dir) for topic, topic_dir in exported if not topic.depends_on]
    assert independent
    tree, env = pristine_repo(upstream_sdist, tmp_path)
    pristine = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, stdout=subprocess.PIPE, text=True,
                              check=True).stdout.strip()
    for topic, topic_dir in independent:
        # Each alone on the pristine release, which the repository returns to between topics.
        subprocess.run(["git", "reset", "-q", "--hard", pristine], cwd=tree, env=env, check=True)
        proc = git_am(tree, env, topic_dir / f"{topic.name}.mbox")
        assert proc.returncode == 0, f"{topic.name}: {proc.stdout}"


def test_a_topic_carries_its_update_of_an_upstream_test(exported):
    """The leaf-module fix makes upstream's test_no_grad_input_error (which expects the failure) fail; its
    pull request carries the test's update, with the reason, as a patch to apply after the mailbox."""
    (topic, topic_dir), = [(t, d) for t, d in exported if t.name == "zero3-leaf-module-gradients"]
    update = (topic_dir / "upstream-test-updates.patch").read_text()
    original = (REPO / "patches" / "upstream-tests" / f"{topic.name}.patch").read_text()
    # The fork's update, signed off by the exporter after its author.
    head, sep, diff = original.partition("\n---\n")
    assert update == f"{head}\nSigned-off-by: {EXPORTER}{sep}{diff}"
    assert "diff --git a/tests/unit/runtime/zero/test_zero_leaf_module.py " in update
    assert "-    def test_no_grad_input_error(self):" in update and "Signed-off-by: " in update
    description = (topic_dir / "PR.md").read_text()
    assert "## Upstream tests this changes" in description
    assert "`tests/unit/runtime/zero/test_zero_leaf_module.py`" in description
    assert "test_no_grad_input_error expected set_z3_leaf_modules to fail" in description
    # Every other topic carries an update exactly when it has one of its own.
    for other, other_dir in exported:
        own = REPO / "patches" / "upstream-tests" / f"{other.name}.patch"
        assert (other_dir / "upstream-test-updates.patch").exists() == own.exists(), other.name


def test_unknown_dependency_is_refused_by_name(repo_copy, upstream_sdist, tmp_path, monkeypatch):
    git_config_env(monkeypatch, tmp_path, EXPORTER)
    patch = next(p for p in read_series(repo_copy) if p.dep3.get("Depends-On"))
    text = patch.path.read_text()
    patch.path.write_text(text.replace(f"Depends-On: {patch.dep3['Depends-On']}", "Depends-On: no-such-topic", 1))
    out = tmp_path / "out"
    with pytest.raises(ForkError, match="depends on 'no-such-topic'"):
        export_topics(repo_copy, out, sdist=upstream_sdist)
    assert not out.exists()


def test_a_patch_without_kind_is_refused_by_name(repo_copy, upstream_sdist, tmp_path, monkeypatch):
    git_config_env(monkeypatch, tmp_path, EXPORTER)
    patch = next(p for p in read_series(repo_copy) if p.dep3.get("Kind") == "fix")
    patch.path.write_text(patch.path.read_text().replace("Kind: fix\n", "", 1))
    out = tmp_path / "out"
    with pytest.raises(ForkError, match=f"{patch.name}: Kind: must be one of fix, feature"):
        export_topics(repo_copy, out, sdist=upstream_sdist)
    assert not out.exists()


def test_fixes_that_cannot_go_upstream_alone_are_named():
    gradients, empty_params = Topic("gradients", "fix"), Topic("empty-params", "fix")
    zero_width = Topic("zero-width", "fix", depends_on=["empty-params"])
    faster_hooks = Topic("faster-hooks", "feature", depends_on=["empty-params"])
    reshard = Topic("reshard", "feature")
    late_fix, deep_fix = Topic("late-fix", "fix"), Topic("deep-fix", "fix", depends_on=["zero-width"])
    fix_on_feature = Topic("fix-on-feature", "fix", depends_on=["reshard"])
    topics = [gradients, empty_params, zero_width, faster_hooks, reshard, deep_fix, fix_on_feature, late_fix]
    assert fixes_not_standalone(topics) == [
        "fix topic deep-fix comes after feature topic faster-hooks",
        "fix topic deep-fix needs 2 topic(s) merged first: empty-params (fix), zero-width (fix)",
        "fix topic fix-on-feature comes after feature topic faster-hooks",
        "fix topic fix-on-feature needs 1 topic(s) merged first: reshard (feature)",
        "fix topic late-fix comes after feature topic faster-hooks",
    ]
    # With the fixes first, each on at most one other fix, nothing is left to report.
    assert fixes_not_standalone([gradients, empty_params, zero_width, late_fix, faster_hooks, reshard]) == []


def test_verification_is_recorded_in_the_pull_request(exported):
    topic, topic_dir = next((topic, path) for topic, path in exported if topic.depends_on and topic.tests)
    pr_file = topic_dir / "PR.md"
    before = pr_file.read_text()
    try:
        record_verification(pr_file, topic, "fails on 0.19.8 + x (1 failed), passes with this PR (1 passed)")
        text = pr_file.read_text()
    finally:
        pr_file.write_text(before)
    verification = text[text.index("## Verification"):text.index("## Depends on")]
    assert "Verified (`python -m forktools prs --verify`): `test_" in verification
    assert verification.rstrip().endswith("fails on 0.19.8 + x (1 failed), passes with this PR (1 passed).")
