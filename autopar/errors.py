"""The user-facing error types of autopar. Each is a ``ValueError`` so callers can catch bad input
uniformly; the message names the offending field and value and says what to change."""

__all__ = ["AutoparError", "ClusterError", "PlanError", "LaunchError"]


class AutoparError(ValueError):
    """Base class of every error autopar raises on bad input or an impossible request."""


class ClusterError(AutoparError):
    """A cluster description (YAML, dict or preset name) is invalid."""


class PlanError(AutoparError):
    """No plan satisfies the request: what was needed and what was available."""


class LaunchError(AutoparError, RuntimeError):
    """A rank failed or hung; the job was stopped on every rank."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
