"""The one error a model that cannot be had or loaded correctly raises."""


class CheckpointError(ValueError):
    """A model cannot be loaded (correctly): names the file, tensor or field at fault, and what would load."""
