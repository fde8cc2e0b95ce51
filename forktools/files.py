"""Writing files into the caller's tree: each one atomically, a set of them all or nothing."""

import os
from pathlib import Path

from forktools import ForkError


def replace_file(path, data):
    """Give ``path`` the bytes ``data`` atomically: written beside it under a temporary name, then renamed over
    it, so that a reader (or a kill) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_files(root, changes):
    """Apply {relative path: bytes, or None to remove} under ``root`` all or nothing.

    Each file is replaced atomically; if any step fails, the files already replaced get their old bytes back,
    so a failure leaves the tree as it was.
    """
    root = Path(root)
    done = []  # (path, its old bytes or None if it did not exist)
    current = None
    try:
        for relative, data in changes.items():
            current = root / relative
            old = current.read_bytes() if current.is_file() else None
            if data is None:
                current.unlink(missing_ok=True)
            else:
                replace_file(current, data)
            done.append((current, old))
    except BaseException as err:
        for path, old in reversed(done):
            if old is None:
                path.unlink(missing_ok=True)
            else:
                replace_file(path, old)
        if isinstance(err, OSError):
            raise ForkError(f"could not write {current}: {err}; the files written before it were restored") from err
        raise
