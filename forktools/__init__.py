"""Build and maintenance tooling of the DeepSpeed fork.

The fork is the pinned upstream DeepSpeed source distribution (``upstream.toml``) plus the
ordered patch series in ``patches/``. This package turns the two into a wheel (``backend``, a
PEP 517 build backend) and gives maintainers a patch-queue workflow (``pq``).
"""


class ForkError(Exception):
    """A problem with the pin, the upstream source or the patch series, stated for a person."""
