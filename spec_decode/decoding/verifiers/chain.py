"""Token-level rejection sampling of a chain (Leviathan et al. 2023, Algorithm 1).

Accept x_i while u_i * l * q_i(x_i) < p_i(x_i) (u_i ~ U(0, 1), l the
lenience, 1 = exact); with n accepted, the extra token comes from
norm(max(0, p_{n+1} - l q_{n+1})), with q_{K+1} := 0 so that it is p_{K+1}
after a full acceptance. At temperature 0 p and q are one-hot and this is
exact matching: the output equals greedy decoding of the target.
A deterministic proposal (q None) is a point mass at each token. Positions
at or past a row's `proposal.proposed` length are not proposed: never
accepted, and q := 0 there (so the extra token after accepting all of them
comes from p at that position).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.sampling import draw
from spec_decode.decoding.types import Proposal, Verdict
from spec_decode.decoding.verifiers.base import Verifier


def take(probs_BKV, tokens_BK):
  """probs[b, k, tokens[b, k]]."""
  return jnp.take_along_axis(probs_BKV, tokens_BK[..., None], axis=-1)[..., 0]


def greedy_verdict(target_tokens, proposal: Proposal) -> Verdict:
  """Temperature 0: accept the longest prefix of the chain equal to the target's argmax.

  target_tokens [B, K + 1]: the target's argmax after the root and after each
  proposed token. The extra token is the target's argmax after the accepted
  prefix. beta is 1 where the draft's token is the target's (sum_x min(p, q)
  of two point masses). This is what every exact chain verifier (and the
  lenient one) reduces to on one-hot p and q, computed without them.
  """
  x = proposal.tokens
  B, K = x.shape
  length = proposal.proposed  # positions at or past it were not proposed
  match = target_tokens[:, :K] == x
  accept = match & (jnp.arange(K)[None, :] < length[:, None])
  n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  extra = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
  return Verdict(accepted=n, path=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)),
                 extra=extra, decided=jnp.minimum(n + 1, length), beta=match.astype(jnp.float32))


@registry.verifier("chain")
@dataclasses.dataclass(frozen=True)
class ChainVerifier(Verifier):
  """Rejection sampling token by token; the first rejection ends the step."""
  supports_lenience = True

  def verify(self, p, proposal: Proposal, accept_keys, correct_keys, *, sampling,
             lenience: float = 1.0) -> Verdict:
    x = proposal.tokens
    B, K = x.shape
    q = proposal.q
    if q is None:
      q = jax.nn.one_hot(x, p.shape[-1], dtype=p.dtype)
    if sampling.greedy:
      # q is one-hot at x and p one-hot, so the test is p(x) = 1 whatever u < 1 is (and
      # the random keys become dead code).
      accept = take(p[:, :K], x) > 0
    else:
      u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(accept_keys)
      accept = u * lenience * take(q, x) < take(p[:, :K], x)
    length = proposal.proposed  # [B]
    accept = accept & (jnp.arange(K)[None, :] < length[:, None])
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]

    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q_ext, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.where((n < length)[:, None], q_n, 0.0)  # n = length: nothing was proposed there
    residual = jnp.maximum(p_n - lenience * q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only through rounding when p ~ q; p_n itself is then the right law.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    extra = draw(correct_keys, residual, greedy=sampling.greedy)
    beta = jnp.sum(jnp.minimum(p[:, :K] / lenience, q), axis=-1)  # [B, K]
    return Verdict(accepted=n, path=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)),
                   extra=extra, decided=jnp.minimum(n + 1, length), beta=beta)
