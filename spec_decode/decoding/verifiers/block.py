"""Block verification of a chain (Sun et al., "Block Verification Accelerates
Speculative Decoding", ICLR 2025): exact, and never fewer tokens than token-level.

For a row proposing x_1 .. x_g (g its `proposal.proposed` length, <= K) with
draft laws q_1 .. q_g and target laws p_1 .. p_{g+1} (p_i = p[:, i - 1]):

  P_0 = 1,  P_i = min(1, P_{i-1} p_i(x_i) / q_i(x_i))
  r_i = sum_x max(P_i p_{i+1}(x) - q_{i+1}(x), 0)            (i < g)
  h_i = r_i / (r_i + 1 - P_i)  (1 if that denominator is 0)  (i < g),   h_g = P_g
  tau = the LAST i in 1..g with u_i <= h_i (0 if none), u_i ~ U(0, 1] independent
  emit x_1 .. x_tau, then the extra token from p_{g+1} if tau = g, else from
  norm(max(P_tau p_{tau+1} - q_{tau+1}, 0)).

Unlike token-level verification, a failed test at position i does not end the
block: a later position can still pass and keep every token before it. P_i is
a product of up to K ratios, so it is carried in log space (log P_i =
min(0, log P_{i-1} + log p_i(x_i) - log q_i(x_i))); 1 - P_i is -expm1(log P_i)
and the residual is computed as max(p - q / P_tau, 0), which has the same
normalized law and does not underflow with P_tau.

At temperature 0 p and q are one-hot: P_i is 1 while the draft matches the
target's argmax and 0 after, h_i = P_i, so tau is the matched prefix and the
extra token is the target's argmax: exactly token-level verification, so at
temperature 0 `verify` runs the token-level verifier (cheaper: no [B, K, V]
residual sums; tests/test_block_verification.py checks the formulas give the
same verdicts). A deterministic proposal (q None) is a point mass at each
token, for which the rule is exact as well.

Verdict.decided / beta keep the token-level meaning so that alpha stays
comparable across verifiers: decided = min(tau + 1, g), the positions whose
prefix was emitted (the emitted tokens and the first one not emitted); beta
their sum_x min(p, q). `min_pq_sum / decisions` therefore estimates the same
alpha (the mean beta over committed prefixes) as with token-level
verification, while `accepted / decisions` is block verification's higher
effective acceptance rate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.sampling import draw
from spec_decode.decoding.types import Proposal, Verdict
from spec_decode.decoding.verifiers.base import Verifier
from spec_decode.decoding.verifiers.chain import ChainVerifier, take


def safe_log(x: jax.Array) -> jax.Array:
  """log x with log 0 = -inf (and no NaN from the unused branch)."""
  return jnp.where(x > 0, jnp.log(jnp.where(x > 0, x, 1.0)), -jnp.inf)


def block_weights(p, q, tokens, length):
  """(log_P [B, K + 1], h [B, K]) of block verification (see the module doc).

  p [B, K + 1, V], q [B, K, V], tokens [B, K], length [B] (g per row).
  log_P[:, i] = log P_i (log_P[:, 0] = 0); h[:, i - 1] = h_i for i <= g and
  0 past g (a position that was not proposed never passes).
  """
  B, K = tokens.shape
  i = jnp.arange(1, K + 1)[None, :]  # 1-based positions
  valid = i <= length[:, None]
  # x_i was drawn from q_i, so q_i(x_i) > 0 at every proposed position.
  log_ratio = jnp.where(valid, safe_log(take(p[:, :K], tokens)) - safe_log(take(q, tokens)),
                        0.0)
  log_P = [jnp.zeros((B,), jnp.float32)]
  for k in range(K):  # K is static and small: P_i = min(1, P_{i-1} ratio_i)
    log_P.append(jnp.minimum(0.0, log_P[-1] + log_ratio[:, k]))
  log_P = jnp.stack(log_P, axis=1)  # [B, K + 1]
  P = jnp.exp(log_P[:, 1:])  # [B, K]: P_1 .. P_K
  # r_i for i = 1 .. K - 1 uses p_{i+1} = p[:, i] and q_{i+1} = q[:, i].
  r = jnp.sum(jnp.maximum(P[:, :K - 1, None] * p[:, 1:K] - q[:, 1:K], 0.0), axis=-1)
  r = jnp.concatenate([r, jnp.zeros((B, 1), r.dtype)], axis=1)  # [B, K]
  den = r + (-jnp.expm1(log_P[:, 1:]))  # r_i + 1 - P_i, accurate for P_i near 1
  h_inner = jnp.where(den > 0, r / jnp.where(den > 0, den, 1.0), 1.0)
  g = length[:, None]
  h = jnp.where(i < g, h_inner, jnp.where(i == g, P, 0.0))
  return log_P, h


def residual_law(p_next, q_next, log_P_tau):
  """norm(max(P_tau p_next - q_next, 0)) over the last axis, as norm(max(p - q / P_tau, 0)).

  p_next, q_next [B, V]; log_P_tau [B]. Where the residual has no mass (only
  through rounding, e.g. q_next = 0 rows excluded) p_next itself is returned.
  """
  scale = jnp.exp(-log_P_tau)[:, None]  # 1 / P_tau (inf when P_tau underflows)
  scaled_q = jnp.where(q_next > 0, q_next * scale, 0.0)
  residual = jnp.maximum(p_next - scaled_q, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)


@registry.verifier("block")
@dataclasses.dataclass(frozen=True)
class BlockVerifier(Verifier):
  """Exact block verification: keeps the LAST prefix that passes its test."""

  def verify(self, p, proposal: Proposal, accept_keys, correct_keys, *, sampling,
             lenience: float = 1.0) -> Verdict:
    if lenience != 1.0:
      raise ValueError("BlockVerifier is exact only; it has no lenient variant")
    if sampling.greedy:  # one-hot p and q: block verification is token-level verification
      return ChainVerifier().verify(p, proposal, accept_keys, correct_keys, sampling=sampling)
    x = proposal.tokens
    B, K = x.shape
    q = proposal.q
    if q is None:
      q = jax.nn.one_hot(x, p.shape[-1], dtype=p.dtype)
    length = proposal.proposed
    log_P, h = block_weights(p, q, x, length)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (K,)))(accept_keys)  # (0, 1]
    passed = u <= h
    position = jnp.arange(1, K + 1, dtype=jnp.int32)[None, :]
    tau = jnp.max(jnp.where(passed, position, 0), axis=1)  # [B], 0 when none passed

    p_next = jnp.take_along_axis(p, tau[:, None, None], axis=1)[:, 0]  # p_{tau+1}
    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_next = jnp.take_along_axis(q_ext, tau[:, None, None], axis=1)[:, 0]
    q_next = jnp.where((tau < length)[:, None], q_next, 0.0)  # tau = g: the bonus, from p
    log_P_tau = jnp.take_along_axis(log_P, tau[:, None], axis=1)[:, 0]
    extra = draw(correct_keys, residual_law(p_next, q_next, log_P_tau), greedy=False)
    beta = jnp.sum(jnp.minimum(p[:, :K], q), axis=-1)  # [B, K]
    return Verdict(accepted=tau, path=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)),
                   extra=extra, decided=jnp.minimum(tau + 1, length), beta=beta)
