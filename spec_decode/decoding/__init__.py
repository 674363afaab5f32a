"""Decoding algorithms over the `Decoder` protocol: autoregressive and speculative."""

from spec_decode.decoding.autoregressive import autoregressive
from spec_decode.decoding.sampling import Sampling, sample_from
from spec_decode.decoding.speculative import speculative
from spec_decode.decoding.types import DecodeResult, DecodeStats

__all__ = ["autoregressive", "speculative", "Sampling", "sample_from", "DecodeResult",
           "DecodeStats"]
