"""What the series adds to upstream's code, measured on a patch queue: ``python -m forktools sizes``.

Prints the lines the series adds to ``deepspeed/runtime/engine.py``, the functions of ``deepspeed/`` longer
than 60 lines that the series adds or grows by more than 10 lines, and how many more times than the release
``engine.py`` and ``deepspeed/checkpoint/`` spell the MoE expert infix: the measures of a readable
checkpoint subsystem (docs/maintainers.md, *Keeping the code readable*).
"""

import ast
import re

from forktools.git import run_git
from forktools.upstream import BASE_TAG

ENGINE = "deepspeed/runtime/engine.py"
LONG_FUNCTION = 60
EXPERT_INFIX = ".deepspeed_moe.experts.deepspeed_experts."


def _functions(source):
    """``{qualified name: length in lines}`` of the functions of a Python source."""
    lengths = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return lengths


def _show(queue, rev, path):
    proc = run_git(["show", f"{rev}:{path}"], cwd=queue, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def measure(queue):
    """The report's lines for the patch queue at ``queue`` (its ``upstream`` tag against HEAD)."""
    changed = run_git(["diff", "--numstat", BASE_TAG, "HEAD", "--", "deepspeed"], cwd=queue).stdout.splitlines()
    lines = []
    long_functions = []
    for added, removed, path in (line.split("\t") for line in changed):
        if path == ENGINE:
            lines.append(f"{ENGINE}: +{added} -{removed} lines")
        if not path.endswith(".py"):
            continue
        before, after = _functions(_show(queue, BASE_TAG, path)), _functions(_show(queue, "HEAD", path))
        for name, length in after.items():
            grown = length - before.get(name, 0)
            if length > LONG_FUNCTION and grown > (0 if name not in before else 10):
                was = f" (upstream {before[name]})" if name in before else ""
                long_functions.append(f"  {path}: {name} {length} lines{was}")
    lines.append(f"functions over {LONG_FUNCTION} lines that the series adds or grows by over 10: "
                 f"{len(long_functions)}")
    lines += sorted(long_functions)
    spelled = []
    for rev in (BASE_TAG, "HEAD"):
        files = run_git(["ls-tree", "-r", "--name-only", rev, "--", ENGINE, "deepspeed/checkpoint"],
                        cwd=queue).stdout.split()
        spelled.append(sum(_show(queue, rev, path).count(EXPERT_INFIX) for path in files))
    lines.append(f"{EXPERT_INFIX!r} in {ENGINE} and deepspeed/checkpoint/: {spelled[1]} ({spelled[0]} in the release)")
    return lines


def readme_lines(readme_text):
    heading = next((i + 1 for i, line in enumerate(readme_text.splitlines()) if re.match(r"## Quick start", line)),
                   None)
    return f"README.md: {len(readme_text.encode()) / 1024:.1f} KB, quick start at line {heading}"
