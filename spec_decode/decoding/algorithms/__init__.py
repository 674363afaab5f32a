"""Decoding algorithms: frozen, hashable dataclasses registered by name.

Adding one: a new file here with a `runner.Algorithm` subclass under
`@registry.algorithm("name")`, plus its import line below.
"""

from spec_decode.decoding.algorithms.autoregressive import Autoregressive, autoregressive
from spec_decode.decoding.algorithms.speculative import Speculative, speculative

__all__ = ["Autoregressive", "Speculative", "autoregressive", "speculative"]
