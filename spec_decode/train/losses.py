"""Training losses: token cross-entropy with T5X's z-loss, and draft-distillation divergences.

All functions take logits [B, T, V] float32 and weights [B, T] (1 at real
target positions) and return weighted *sums* plus the weight total, so callers
normalize once per batch.

Divergences between the target (teacher) distribution p and the draft q at
the same prefix (DistillSpec): 'fkl' = KL(p || q), 'rkl' = KL(q || p),
'tvd' = total variation sum_x |p - q| / 2, which is 1 - beta, the paper's
per-token rejection probability. Both distributions are softmax(logits / T);
T = 0 makes p the one-hot argmax (the draft then learns the greedy target).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DIVERGENCES = ("fkl", "rkl", "tvd")


def cross_entropy(logits, targets, weights, *, z_loss: float = 1e-4):
  """Returns (loss_sum, z_loss_sum, correct_sum, weight_sum); loss includes the z-loss.

  z-loss = z_loss * logsumexp(logits)^2 per token, as T5X adds it.
  """
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  z = z_loss * jnp.square(lse)
  nll = lse - target_logit
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (jnp.sum((nll + z) * weights), jnp.sum(z * weights), jnp.sum(correct * weights),
          jnp.sum(weights))


def _probs(logits, temperature: float):
  if temperature == 0.0:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(logits / temperature, axis=-1)


def divergence(teacher_logits, student_logits, weights, *, kind: str = "fkl",
               temperature: float = 1.0):
  """Returns (divergence_sum, agreement_sum, weight_sum) of the student against the teacher.

  agreement: 1 where both argmaxes agree (the alpha of greedy decoding at that prefix).
  The teacher is treated as a constant (no gradient flows into it).
  """
  if kind not in DIVERGENCES:
    raise ValueError(f"unknown divergence {kind!r}; known: {DIVERGENCES}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  teacher_logits = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32))
  student_logits = student_logits.astype(jnp.float32)
  p = _probs(teacher_logits, temperature)
  log_q = jax.nn.log_softmax(student_logits / (temperature or 1.0), axis=-1)
  q = jnp.exp(log_q)
  if kind == "fkl":
    # sum_x p log p - p log q; the p log p part is constant but keeps the value a true KL.
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    d = jnp.sum(p * (log_p - log_q), axis=-1)
  elif kind == "rkl":
    if temperature == 0.0:
      raise ValueError("rkl needs temperature > 0 (KL(q || one-hot) is infinite)")
    log_p = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
    d = jnp.sum(q * (log_q - log_p), axis=-1)
  else:
    d = 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
  agree = (jnp.argmax(teacher_logits, -1) == jnp.argmax(student_logits, -1)).astype(jnp.float32)
  return jnp.sum(d * weights), jnp.sum(agree * weights), jnp.sum(weights)
