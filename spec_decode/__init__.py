"""spec_decode: exact speculative decoding for T5 encoder-decoders in JAX/Flax."""

__version__ = "0.1.0"
