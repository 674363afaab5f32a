"""Recursive rejection sampling of a sampled tree (SpecInfer, Miao et al. 2024; multi-draft RRS).

At the current node (the root first) with target law p and draft law q, the
node's children c_1, c_2, ... are tested in order: accept c_j when
u_j * q(c_j) < p(c_j) (u_j ~ U(0, 1)), i.e. with probability min(1, p/q); on
acceptance move to c_j and start again there with its own p and q; on
rejection set
  p <- norm(max(0, p - q)),  q <- q with c_j removed, renormalized,
and test the next child. When every child is rejected, or the node has none,
the extra token is drawn from the current (residual) p. This is exact when
each node's children were drawn from q WITHOUT replacement (in the order
tested), as `SampledTreeDrafter` draws them.

with_replacement=True is the rule for children drawn i.i.d. from q (the
residual update of p only; q is not changed after a rejection). It is exact
for `SampledTreeDrafter(with_replacement=True)` and biased for children drawn
without replacement, where it serves as a negative control; `Speculative`
refuses to pair a rule with a drafter whose `sibling_draws` says otherwise.

A deterministic proposal (q None, e.g. `TreeDrafter` or any drafter at
temperature 0) is a point mass at each node's token: child c_j is accepted with
probability p(c_j) and a rejection zeroes c_j in p. With distinct siblings this
is SpecExec's rule (draw y ~ p; move to the child carrying y), exact for any
tree; at temperature 0 it follows the target's argmax, i.e. greedy decoding.
A chain (one child per node) reduces to token-level rejection sampling.

Padding nodes (parent -2, or a chain's positions at or past `proposal.length`)
are never tested. The nodes are visited in index order in one pass (parents
come first, so a node's children follow it).

Counters: a decision is one child's test (decided counts them, at most one per
node, so accepted <= decided). beta[t] is the t-th test's acceptance
probability given everything before it, sum_x min(p_t(x), q_t(x)) with that
test's residual laws (p_t(c) for a point mass): sum_t beta[t] has the same
expectation as the number accepted, so `min_pq_sum / decisions` estimates the
per-test acceptance rate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.sampling import draw
from spec_decode.decoding.types import Proposal, Verdict
from spec_decode.decoding.verifiers.base import Verifier


def _normalized(x, fallback):
  """x / sum(x) along the last axis, or `fallback` where the sum is 0."""
  mass = jnp.sum(x, axis=-1, keepdims=True)
  return jnp.where(mass > 0, x / jnp.where(mass > 0, mass, 1.0), fallback)


@registry.verifier("tree_rrs")
@dataclasses.dataclass(frozen=True)
class TreeRRSVerifier(Verifier):
  """Recursive rejection sampling down a tree; children drawn without replacement unless
  `with_replacement` (then the residual update of p alone; see the module doc)."""
  with_replacement: bool = False
  chain_only = False

  def __post_init__(self):
    if not isinstance(self.with_replacement, bool):
      raise ValueError(f"TreeRRSVerifier.with_replacement must be a bool, got "
                       f"{self.with_replacement!r}")

  def check_drafter(self, drafter) -> None:
    draws = drafter.sibling_draws  # None: a chain or a deterministic tree
    want = "with_replacement" if self.with_replacement else "without_replacement"
    if draws is not None and draws != want:
      raise ValueError(f"TreeRRSVerifier(with_replacement={self.with_replacement}) is exact "
                       f"only for siblings drawn {want.replace('_', ' ')}, but "
                       f"{type(drafter).__name__} draws them {draws.replace('_', ' ')}")

  def verify(self, p, proposal: Proposal, accept_keys, correct_keys, *, sampling,
             lenience: float = 1.0) -> Verdict:
    tok, par, q = proposal.tokens, proposal.parent, proposal.q
    B, K = tok.shape
    V = p.shape[-1]
    valid = par >= -1
    if proposal.length is not None:
      valid = valid & (jnp.arange(K)[None, :] < proposal.length[:, None])
    if sampling.greedy:  # one-hot p: accept iff p(c) > 0 (any u < 1 decides the same)
      u = jnp.zeros((B, K), jnp.float32)
    else:
      u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(accept_keys)
    slot = jnp.arange(K)[None, :]
    q_nodes = jnp.zeros((B, K, 1), p.dtype) if q is None else q  # [B, K, V] or unused

    def step(carry, node):
      cur, p_cur, q_cur, fresh, n, path, decided, beta = carry
      i, x, parent, ok, u_i, q_i, p_after = node
      test = ok & (parent == cur)
      onehot = jax.nn.one_hot(x, V, dtype=p.dtype)
      if q is None:
        q_use = onehot  # a point mass at the node's own token
      else:
        q_use = jnp.where(fresh[:, None], q_i, q_cur)
      p_x = jnp.take_along_axis(p_cur, x[:, None], axis=1)[:, 0]
      q_x = jnp.take_along_axis(q_use, x[:, None], axis=1)[:, 0]
      accept = test & (u_i * q_x < p_x)
      reject = test & ~accept
      chance = jnp.sum(jnp.minimum(p_cur, q_use), axis=-1)
      beta = jnp.where(test[:, None] & (slot == decided[:, None]), chance[:, None], beta)
      decided = decided + test.astype(jnp.int32)
      path = jnp.where(accept[:, None] & (slot == n[:, None]), i, path)
      n = n + accept.astype(jnp.int32)
      # After a rejection: p's residual; q without the rejected token (renormalized)
      # unless siblings are i.i.d. draws. Rounding can empty p's residual only when p ~ q,
      # where p itself is the right law.
      p_res = _normalized(jnp.maximum(p_cur - q_use, 0.0), p_cur)
      if self.with_replacement or q is None:
        q_res = q_use
      else:
        q_res = _normalized(q_use * (1.0 - onehot), jnp.zeros_like(q_use))
      p_cur = jnp.where(accept[:, None], p_after, jnp.where(reject[:, None], p_res, p_cur))
      q_cur = jnp.where(reject[:, None], q_res, q_cur)
      fresh = jnp.where(accept, True, jnp.where(reject, False, fresh))
      cur = jnp.where(accept, i, cur)
      return (cur, p_cur, q_cur, fresh, n, path, decided, beta), None

    init = (jnp.full((B,), -1, jnp.int32),  # the current node: -1 the root, i >= 0 node i
            p[:, 0],  # the (residual) target law at the current node
            jnp.zeros((B, V), p.dtype),  # the residual draft law once a child was rejected
            jnp.ones((B,), bool),  # no child of the current node tested yet
            jnp.zeros((B,), jnp.int32), jnp.zeros((B, K), jnp.int32),  # n, path
            jnp.zeros((B,), jnp.int32), jnp.zeros((B, K), jnp.float32))  # decided, beta
    # Nodes in index order (parents first: the current node's children come after it).
    nodes = (jnp.arange(K, dtype=jnp.int32), tok.T, par.T, valid.T, u.T,
             jnp.swapaxes(q_nodes, 0, 1), jnp.swapaxes(p[:, 1:], 0, 1))
    (_, p_cur, _, _, n, path, decided, beta), _ = jax.lax.scan(step, init, nodes)
    extra = draw(correct_keys, p_cur, greedy=sampling.greedy)
    return Verdict(accepted=n, path=path, extra=extra, decided=decided, beta=beta)
