"""Models: T5 in JAX and the Decoder protocol that decoding algorithms rely on."""

from spec_decode.models import base, t5
from spec_decode.models.base import Cache, Decoder

__all__ = ["base", "t5", "Cache", "Decoder"]
