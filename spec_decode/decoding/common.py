"""Pieces shared by the decoding loops: argument checks and per-row PRNG keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.decoding.sampling import Sampling
from spec_decode.models import t5


def row_keys(rng: jax.Array, row_ids: jax.Array, step: jax.Array) -> jax.Array:
  """[B] keys, one per row, each a function of (rng, row id, step) only.

  A row's randomness therefore never depends on its batch position or on its
  neighbours; pass the same `row_ids` to decode a row alone and in a batch.
  """
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(rng, r), step))(row_ids)


def check_inputs(model, encoder_tokens, *, max_decode_len, sampling, rng, row_ids):
  """Validates the public arguments of a decoder; returns normalized values."""
  if not isinstance(max_decode_len, (int, np.integer)) or isinstance(max_decode_len, bool) \
      or max_decode_len < 1:
    raise ValueError(f"max_decode_len must be a positive int, got {max_decode_len!r}")
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a decoding.Sampling, got {type(sampling).__name__}")
  encoder_tokens = t5._check_tokens(encoder_tokens, "encoder_tokens", model.vocab_size)
  B = encoder_tokens.shape[0]
  if rng is None:
    if not sampling.greedy:
      raise ValueError("rng is required when sampling with temperature > 0")
    rng = jax.random.PRNGKey(0)
  if row_ids is None:
    row_ids = jnp.arange(B, dtype=jnp.int32)
  else:
    row_ids = jnp.asarray(row_ids, jnp.int32)
    if row_ids.shape != (B,):
      raise ValueError(f"row_ids must have shape ({B},), got {row_ids.shape}")
  return encoder_tokens, int(max_decode_len), rng, row_ids
