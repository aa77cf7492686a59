"""Errors the engine raises for bad checkpoints and bad requests."""

from blink.shared.checkpoints.errors import CheckpointError

__all__ = ["CheckpointError", "RequestError"]


class RequestError(ValueError):
    """A request cannot be served as given (too long a prompt, invalid sampling values)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
