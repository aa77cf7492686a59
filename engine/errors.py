"""Errors the engine raises for bad checkpoints and bad requests."""


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded: names the file, tensor or field at fault."""


class RequestError(ValueError):
    """A request cannot be served as given (too long a prompt, invalid sampling values)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
