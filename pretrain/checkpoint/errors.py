"""The error every checkpoint reader raises, ours or another framework's format."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or used, with the file that says so."""
