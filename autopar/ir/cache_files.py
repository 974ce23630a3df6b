"""How autopar keeps its cache files (measurements, calibration, emulated links, plans): private to the
user, written without following links, read with their type checked, and bounded in number.

- directories are made 0700 (an existing one of this user is narrowed to it);
- a file is written to a fresh temporary of ``tempfile.mkstemp`` (created exclusively, mode 0600, so a
  link planted at a predictable name is never followed) and renamed over the file, which replaces a
  link at the file's own name instead of writing through it;
- a file is opened with ``O_NOFOLLOW`` and must hold a JSON object: anything else is a miss, with a
  warning naming the file, so its contents are measured or planned again and rewritten;
- ``evict_oldest`` keeps a folder of per-key files (the plans) to its newest ``keep`` files by last use.

Every failure to read or write is a miss or a skipped write (a read-only home is no reason to fail),
never an error. Pure file handling: nothing here knows what the files hold.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

__all__ = ["CacheFileWarning", "private_dir", "read_json_object", "write_private", "mark_used", "evict_oldest"]


class CacheFileWarning(UserWarning):
    """A cache file that could not be used: it is recomputed and rewritten."""


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can read: made 0700, or narrowed to 0700 when it is
    this user's already (a link the user made to a folder of theirs, a cache on another disk, is
    followed). ``OSError`` when the folder belongs to someone else."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise OSError(f"{path} is another user's directory; not used as a cache")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically through a private temporary (module docstring);
    ``OSError`` when it cannot."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``: None when there is no file, and None with a ``CacheFileWarning``
    when the file is a link, unreadable, not JSON or not a JSON object."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        warnings.warn(f"cache file {path} cannot be opened ({exc}); recomputing it", CacheFileWarning, stacklevel=2)
        return None
    try:
        with os.fdopen(fd, encoding="utf-8") as f:
            data = json.loads(f.read())
    except (OSError, ValueError) as exc:
        warnings.warn(f"cache file {path} is not JSON ({exc}); recomputing it", CacheFileWarning, stacklevel=2)
        return None
    if not isinstance(data, dict):
        warnings.warn(f"cache file {path} holds a {type(data).__name__}, not an object; recomputing it",
                      CacheFileWarning, stacklevel=2)
        return None
    return data


def mark_used(path: Path) -> None:
    """Record a read of ``path`` as its last use, for ``evict_oldest`` (its modification time)."""
    try:
        os.utime(path)
    except OSError:
        pass


def evict_oldest(folder: Path, keep: int, pattern: str = "*.json") -> int:
    """Remove all but the ``keep`` most recently used files of ``pattern`` in ``folder`` (by
    modification time, which a read marks with ``mark_used``); returns how many were removed."""
    try:
        files = [(p.stat().st_mtime, p) for p in folder.glob(pattern) if p.is_file() and not p.is_symlink()]
    except OSError:
        return 0
    if len(files) <= keep:
        return 0
    files.sort(key=lambda x: x[0])
    removed = 0
    for _, p in files[:len(files) - keep]:
        try:
            p.unlink()
            removed += 1
        except OSError:
            pass
    return removed
