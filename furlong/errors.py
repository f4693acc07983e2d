"""Error types shared by every front door (Python API, RL loop, Tinker service)."""


class InputError(ValueError):
    """A request was malformed. Raised before any state changed; the message names the field
    and, for batched requests, the datum index."""
