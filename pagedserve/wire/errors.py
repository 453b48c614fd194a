"""The wire's one exception (its own module: the codec and the messages' helpers both raise it)."""


class WireError(ValueError):
    """A frame that is not a valid message of this wire version."""
