"""furlong: reinforcement-learning post-training of language models."""

from furlong.errors import InputError
from furlong.types import AdamParams, Datum, ForwardResult

__all__ = ["AdamParams", "Datum", "ForwardResult", "InputError"]
__version__ = "0.1.0"
