"""One exception type for every way a checkpoint can disagree with what the loader expects."""


class CheckpointError(ValueError):
    """A checkpoint that cannot become a ``Llama`` parameter tree.

    Messages name the file, the tensor or metadata key, what was expected and what was found, so
    a user can tell a wrong file from a wrong config from a bug here.
    """
