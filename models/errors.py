"""The error every checkpoint reader raises, in a module of its own at the bottom of models/: the GGUF
file primitives (models.gguf_file) raise it too, and they sit below the model code."""


class CheckpointError(ValueError):
    """A checkpoint whose contents do not match what its config.json describes."""
