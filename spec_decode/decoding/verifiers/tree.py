"""SpecExec's acceptance rule for a draft tree: sampling from the target with the tree as a cache.

Start at the root (the last committed token). Draw y from the target's
adjusted law p at the current node; if a child of the node carries y, move to
that child and repeat; otherwise stop, and y is the extra token. Every emitted
token is a draw from p at its own prefix, so the output is distributed exactly
as the target's sampling for ANY tree (any drafter, any temperature); at
temperature 0 it follows the target's argmax, i.e. greedy decoding.

Counters: a decision is made at every visited node that has children
(decided), accepted when the draw hits one; beta at a decision is the target's
probability of the children's tokens, p(children), the exact chance of that
acceptance, so `min_pq_sum / decisions` estimates the per-node hit rate the
way the chain's alpha does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.sampling import draw
from spec_decode.decoding.types import Proposal, Verdict
from spec_decode.decoding.verifiers.base import Verifier


@registry.verifier("tree")
@dataclasses.dataclass(frozen=True)
class TreeVerifier(Verifier):
  """SpecExec's rule: walk down the tree while the target's draws hit a child."""
  chain_only = False

  def verify(self, p, proposal: Proposal, accept_keys, correct_keys, *, sampling,
             lenience: float = 1.0) -> Verdict:
    tok, par = proposal.tokens, proposal.parent
    B, K = tok.shape
    keys = jax.vmap(lambda k: jax.random.split(k, K + 1))(correct_keys)  # [B, K + 1]
    cur = jnp.full((B,), -1, jnp.int32)  # -1: the root; i >= 0: node i
    n = jnp.zeros((B,), jnp.int32)
    stopped = jnp.zeros((B,), bool)
    extra = jnp.zeros((B,), jnp.int32)
    path = jnp.zeros((B, K), jnp.int32)
    decided = jnp.zeros((B,), jnp.int32)
    beta = jnp.zeros((B, K), jnp.float32)
    # A child whose token an earlier sibling already carries adds nothing to p(children).
    same = (par[:, :, None] == par[:, None, :]) & (tok[:, :, None] == tok[:, None, :])
    repeat = jnp.any(same & jnp.tril(jnp.ones((K, K), bool), -1)[None], axis=2)  # [B, K]
    for step in range(K + 1):  # a path holds at most K nodes
      p_cur = jnp.take_along_axis(p, (cur + 1)[:, None, None], axis=1)[:, 0]  # [B, V]
      y = draw(keys[:, step], p_cur, greedy=sampling.greedy)
      children = par == cur[:, None]  # [B, K] (padding has parent -2: never a child)
      hit = children & (tok == y[:, None])
      has_children = jnp.any(children, axis=1)
      found = jnp.any(hit, axis=1)
      child = jnp.argmax(hit, axis=1).astype(jnp.int32)
      live = ~stopped
      if step < K:
        # p(children): the chance this decision accepts (each distinct token once)
        mass = jnp.sum(jnp.where(children & ~repeat,
                                 jnp.take_along_axis(p_cur, tok, axis=1), 0.0), axis=1)
        at = live & has_children
        beta = beta.at[:, step].set(jnp.where(at, mass, 0.0))
        decided = decided + at.astype(jnp.int32)
        move = live & found
        path = path.at[:, step].set(jnp.where(move, child, path[:, step]))
      else:
        move = jnp.zeros((B,), bool)
      n = n + move.astype(jnp.int32)
      extra = jnp.where(live & ~move, y, extra)
      stopped = stopped | (live & ~move)
      cur = jnp.where(move, child, cur)
    return Verdict(accepted=n, path=path, extra=extra, decided=decided, beta=beta)
