"""The parts of the docs made from the series: ``python -m forktools readme [--check]``.

Each part stands between ``<!-- forktools readme: PART -->`` and ``<!-- forktools readme: end -->``:

- ``version`` (README.md): the version a build of the series carries (``0.19.8+fork.<patches>.<digest>``);
- ``topics`` (docs/topics.md): the table of topics, one row per patch in series order: its topic (the
  ``Topic:`` field, stable when patches are renumbered), whether the topic fixes a bug of the release or
  adds a feature (``Kind:``) and the topics it depends on directly (``Depends-On:``), on the topic's first
  row, its subject, its ``Summary:`` field and its upstream status (``Forwarded:`` / ``Applied-Upstream:``).

``--check`` writes nothing and fails when a file is not what the series makes of it.
"""

import re
from pathlib import Path

from forktools import ForkError
from forktools.files import replace_file
from forktools.prs import topics_of
from forktools.series import local_version_label, read_series
from forktools.upstream import read_pin

README = "README.md"
TOPICS = "docs/topics.md"
# Which generated parts each file holds.
GENERATED = {README: ("version", ), TOPICS: ("topics", )}
_PART_RE = re.compile(r"(<!-- forktools readme: (\w+) -->)(.*?)(<!-- forktools readme: end -->)", re.S)


def upstream_status(patch):
    applied, forwarded = patch.dep3.get("Applied-Upstream", "no"), patch.dep3.get("Forwarded", "no")
    if applied != "no":
        return f"in upstream {applied}"
    if patch.fork_only:
        return "fork only"
    return "not yet forwarded" if forwarded == "no" else f"forwarded: {forwarded}"


def _cell(text):
    return text.replace("|", "\\|")


def topics_table(repo, patches):
    rows = ["| topic | kind | depends on | patch | fixes | upstream status |", "|---|---|---|---|---|---|"]
    first_patches = {topic.patches[0].name: topic for topic in topics_of(repo, patches)}
    for patch in patches:
        summary = patch.dep3.get("Summary")
        if not summary:
            raise ForkError(f"{patch.name} has no Summary: field (what it fixes, for {TOPICS}); add it to "
                            "the patch's trailers in the patch queue (see docs/maintainers.md)")
        topic = "(fork only)" if patch.fork_only and "Topic" not in patch.dep3 else f"`{patch.topic}`"
        kind, depends_on = "", ""
        if patch.name in first_patches:
            kind = first_patches[patch.name].kind
            depends_on = ", ".join(f"`{name}`" for name in first_patches[patch.name].depends_on) or "none"
        rows.append(f"| {topic} | {kind} | {depends_on} | {_cell(patch.subject)} | {_cell(summary)} | "
                    f"{upstream_status(patch)} |")
    return "\n" + "\n".join(rows) + "\n"


def render(repo, name):
    """The text of ``name`` (a key of GENERATED) with every generated part made from the series of ``repo``."""
    repo = Path(repo)
    patches = read_series(repo)
    parts = {
        "topics": lambda: topics_table(repo, patches),
        "version": lambda: f"`{read_pin(repo).version}+{local_version_label(repo, patches)}`",
    }
    text = (repo / name).read_text(encoding="utf-8")
    found = {match.group(2) for match in _PART_RE.finditer(text)}
    if found != set(GENERATED[name]):
        raise ForkError(f"{repo / name}: expected the generated parts {', '.join(GENERATED[name])} between "
                        f"'<!-- forktools readme: PART -->' and '<!-- forktools readme: end -->', found "
                        f"{', '.join(sorted(found)) or 'none'}")
    return _PART_RE.sub(lambda match: match.group(1) + parts[match.group(2)]() + match.group(4), text)


def update(repo, check=False):
    """Rewrite the generated parts of each file (or, with ``check``, only compare); returns the stale files."""
    stale = []
    for name in GENERATED:
        path = Path(repo) / name
        text = render(repo, name)
        if text != path.read_text(encoding="utf-8"):
            stale.append(name)
            if not check:
                replace_file(path, text.encode("utf-8"))
    return stale
