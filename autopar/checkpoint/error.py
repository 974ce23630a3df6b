"""The checkpoint package's error (``autopar.checkpoint.store`` re-exports it)."""

from autopar.errors import AutoparError

__all__ = ["CheckpointError"]


class CheckpointError(AutoparError):
    """A checkpoint that is missing, incomplete, damaged or of another model: names the file."""
