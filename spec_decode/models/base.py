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

  def check_append(self, tokens) -> None:
    """Raises ValueError unless tokens [B, T] fit after every row's current length.

    The per-row overflow check needs concrete lengths, so it is skipped under jit
    tracing (the decoding loops size their caches so it cannot happen there).
    """
    B, T = tokens.shape
    if B != self.batch_size:
      raise ValueError(f"tokens batch {B} != cache batch {self.batch_size}")
    if T > self.max_length:
      raise ValueError(f"cannot decode {T} tokens into a cache of length {self.max_length}")
    if not isinstance(self.lengths, jax.core.Tracer):
      longest = int(jnp.max(self.lengths))
      if longest + T > self.max_length:
        raise ValueError(f"decoding {T} tokens at length {longest} overflows the cache "
                         f"(max_decode_len {self.max_length})")


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
