"""The Decoder protocol: what a decoding algorithm may ask of a model.

Decoding algorithms (autoregressive, speculative, later tree drafts) depend on
this protocol, never on a concrete class, so a T5, an n-gram table or a
feature-level head can serve as target or drafter interchangeably.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class Cache(Protocol):
  """A per-row KV (or state) cache. `lengths` [B] int32 = tokens consumed per row."""
  lengths: jax.Array

  @property
  def max_length(self) -> int: ...

  def rewind(self, lengths: jax.Array) -> "Cache":
    """Sets each row's length; entries beyond it are ignored and later overwritten."""


class LengthCache:
  """Mixin for flax.struct caches whose rewind only moves the per-row `lengths` [B].

  Entries beyond a row's length stay in place; attention (or the lookup) never
  reads them and later writes overwrite them, so a rewind is O(1).
  """

  @property
  def batch_size(self) -> int:
    return self.lengths.shape[0]

  def rewind(self, lengths):
    """Sets each row's length."""
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != self.lengths.shape:
      raise ValueError(f"rewind lengths must have shape {self.lengths.shape}, "
                       f"got {lengths.shape}")
    return self.replace(lengths=lengths)


@runtime_checkable
class Decoder(Protocol):
  """A conditional next-token model with an explicit, rewindable cache.

  Implementations must be hashable (they are static arguments of jitted loops)
  and their methods pure functions of (params, inputs).
  """

  @property
  def vocab_size(self) -> int: ...

  def encode(self, params: Any, encoder_tokens: jax.Array) -> Any:
    """Per-example conditioning computed once (e.g. encoder states)."""

  def init_cache(self, params: Any, encoded: Any, max_decode_len: int) -> Cache:
    """An empty cache with room for `max_decode_len` decoder tokens per row."""

  def decode(self, params: Any, cache: Cache, tokens: jax.Array) -> tuple[jax.Array, Cache]:
    """Appends tokens [B, T] at each row's length; returns logits [B, T, V] float32."""
