"""Results of the decoders: tokens, lengths and per-row statistics."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class DecodeStats:
  """Per-row counters, each [B] unless stated.

  target_calls: target (decoder) invocations while the row was active.
  draft_tokens: tokens the drafter proposed (gamma per speculative step).
  accepted:     proposed tokens accepted by rejection sampling.
  decisions:    draft positions where an accept/reject decision was made
                (min(n + 1, gamma) per step: every position up to and
                including the first rejection); `accepted / decisions` is the
                observed acceptance rate.
  min_pq_sum:   sum over those same positions of sum_x min(p(x), q(x)), the
                paper's beta (Cor. 3.6); `min_pq_sum / decisions` estimates alpha.
  accepted_at:  [B, gamma] how often draft position i (0-based) was accepted.
  decided_at:   [B, gamma] how often it was decided; accepted_at / decided_at is
                the per-position acceptance rate ([B, 0] for autoregressive).
  """
  target_calls: jax.Array
  draft_tokens: jax.Array
  accepted: jax.Array
  decisions: jax.Array
  min_pq_sum: jax.Array
  accepted_at: jax.Array
  decided_at: jax.Array

  @classmethod
  def zeros(cls, batch_size: int, gamma: int = 0) -> "DecodeStats":
    z = jnp.zeros((batch_size,), jnp.int32)
    per_position = jnp.zeros((batch_size, gamma), jnp.int32)
    return cls(target_calls=z, draft_tokens=z, accepted=z, decisions=z,
               min_pq_sum=jnp.zeros((batch_size,), jnp.float32),
               accepted_at=per_position, decided_at=per_position)


@flax.struct.dataclass
class DecodeResult:
  """tokens [B, L] int32 without BOS, 0 after each row's end; lengths [B] (EOS included)."""
  tokens: jax.Array
  lengths: jax.Array
  stats: DecodeStats
