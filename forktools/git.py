"""Running git: the one place forktools starts it, and the environments it runs it in."""

import os
import shutil
import subprocess
from pathlib import Path

from forktools import ForkError


def run_git(args, cwd, env=None, check=True, binary=False):
    """Run ``git ARGS`` in ``cwd`` and return the finished process.

    As text, ``stdout`` holds git's output and its errors together, in the order git wrote them (what a
    person needs to see when it fails). ``binary`` (``git archive``) keeps ``stdout`` as bytes and the
    errors apart in ``stderr``. With ``check``, a failure raises ForkError naming the command.
    """
    git = shutil.which("git")
    if git is None:
        raise ForkError("forktools needs git, and it is not on PATH")
    proc = subprocess.run([git, *args],
                          cwd=cwd,
                          env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE if binary else subprocess.STDOUT,
                          text=not binary)
    if check and proc.returncode != 0:
        output = proc.stderr.decode(errors="replace") if binary else proc.stdout
        raise ForkError(f"git {' '.join(args)} failed in {cwd}:\n{output.strip()}")
    return proc


def repo_env(repo):
    """The environment for git in the repository at ``repo`` and no other, even one around it: a patch queue
    lies inside the fork's own checkout."""
    return dict(os.environ, GIT_DIR=str(Path(repo) / ".git"), GIT_WORK_TREE=str(repo))


def plain_tree_env(tree):
    """The environment for git in a tree that is no repository (``git apply`` onto an unpacked sdist).

    git must never find a repository above the tree: it would apply paths relative to that repository's top
    and silently skip the files outside the tree.
    """
    return dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(tree).resolve().parent))


def identity_env(name, email, date=None, roles=("AUTHOR", "COMMITTER")):
    """The variables that make git commit as ``name <email>`` (at ``date``), whatever its configuration."""
    env = {}
    for role in roles:
        env.update({f"GIT_{role}_NAME": name, f"GIT_{role}_EMAIL": email})
        if date is not None:
            env[f"GIT_{role}_DATE"] = date
    return env


def configured_identity(cwd):
    """(user.name, user.email) from git's configuration as seen from ``cwd``; None for a value not set."""
    values = []
    for key in ("user.name", "user.email"):
        proc = run_git(["config", "--get", key], cwd, check=False)
        values.append(proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None)
    return tuple(values)
