"""A draft model (any `Decoder`: a small T5, an n-gram table) proposing a chain.

Invariants at each proposal, per row with m tokens committed (s_0 = BOS):
the draft cache holds at least s_0 .. s_{m-2}; it is rewound to m - 1 and fed
[s_{m-1}, s_m] in one 2-token call (which also catches up on the last draft
token when every proposal was accepted). On the first iteration (m = 0) the
same call is fed [s_0, s_0] and keeps only the first (`first_logits`). Then
num - 1 single-token calls in a lax.scan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.sampling import argmax, draw
from spec_decode.decoding.types import Committed, Proposal


@registry.drafter("model")
@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """Proposes x_1..x_num ~ q_1..q_num from the draft model, one token per call.

  At temperature 0 the proposal is the draft's argmax chain with q None (a
  point mass at each token: the one-hot q it stands for is never built).
  """

  def init(self, ctx, room: int):
    return ctx.start_cache("draft", room)

  def first_logits(self, ctx, cache, committed: Committed):
    """(logits [B, V] after s_m, cache holding s_0 .. s_m): the first call of a proposal.

    One 2-token call [s_{m-1}, s_m] on the cache rewound to m - 1 (see the module doc),
    with no branch on the iteration: a row with m = 0 (the first iteration) is fed
    [s_0, s_0] at slots 0 and 1, reads its logits after slot 0 and keeps one slot, so
    the second s_0 is never attended to and is overwritten by the next write. (A
    `lax.cond` on the iteration costs a conditional and its operand copies in every
    iteration of the loop.)
    """
    logits, _, cache = self._first_call(ctx, cache, committed)
    return logits, cache

  def _first_call(self, ctx, cache, committed: Committed):
    """`first_logits` and the call's `features` at s_m ([B, ...], None when `_decode`
    asks for none)."""
    m = committed.length
    first = m == 0
    tokens = jnp.stack([committed.token_at(m - 1), committed.token_at(m)], axis=1)
    out = self._decode(ctx, cache.rewind(jnp.maximum(m - 1, 0)), tokens)
    pick = lambda x: None if x is None else jnp.where(
        first.reshape((-1,) + (1,) * (x.ndim - 2)), x[:, 0], x[:, 1])
    return pick(out.logits), pick(out.features), out.cache.rewind(jnp.where(first, 1, m + 1))

  def _decode(self, ctx, cache, tokens):
    """The draft model's call on tokens [B, T]; a subclass may ask it for `features`, which
    `propose` then returns per proposed position as `Proposal.states`."""
    return ctx.draft.decode(ctx.draft_params, cache, tokens)

  def proposal_loop(self, workload, *, gamma: int, steps: int, verify_tokens: int = 0):
    """gamma single-token steps of the draft model per proposal: the paper's cost gamma T_q,
    so c = T_q / T_p (a proposal's first call feeds two tokens, which on the targets'
    scale costs about one step). With verify_tokens, the drafter's own proposals, each
    followed by a target call (`timing.proposal_loop`)."""
    if verify_tokens:
      return super().proposal_loop(workload, gamma=gamma, steps=steps,
                                   verify_tokens=verify_tokens)
    loop = workload.decode_loop("draft", num_tokens=1, steps=gamma * steps)
    loop.steps = steps
    return loop

  def propose(self, ctx, cache, committed: Committed, keys_BK, num: int, forced=None):
    """The draft model's chain of `num` tokens. forced: None, or (tokens [B, num] int32,
    use [B] bool): rows with `use` take these tokens instead of drawing (their q a point
    mass at each), and the draft is fed them, so its cache holds what such a row commits
    (a drafter that proposes something else for some rows: `LookupDrafter.fallback`)."""
    sampling = ctx.sampling
    logits, features, cache = self._first_call(ctx, cache, committed)
    greedy = sampling.greedy  # then each token is the argmax: a point mass, no q to carry
    use_B = None if forced is None else forced[1]

    def choose(key_B, logits_BV, forced_B=None):
      if greedy:
        x = argmax(logits_BV)
        return (x if use_B is None else jnp.where(use_B, forced_B, x)), None
      q = sampling.probs(logits_BV)
      x = draw(key_B, q, greedy=False)
      if use_B is None:
        return x, q
      x = jnp.where(use_B, forced_B, x)
      return x, jnp.where(use_B[:, None], jax.nn.one_hot(x, q.shape[-1], dtype=q.dtype), q)

    keys_KB = jnp.swapaxes(keys_BK[:, 1:], 0, 1)
    if forced is None:  # the scan carries exactly the draft's own chain
      x1, q1 = choose(keys_BK[:, 0], logits)
      inputs = keys_KB
    else:
      forced_KB = jnp.swapaxes(forced[0], 0, 1).astype(jnp.int32)
      x1, q1 = choose(keys_BK[:, 0], logits, forced_KB[0])
      inputs = (keys_KB, forced_KB[1:])

    def step(carry, inputs):
      cache, x = carry
      key_B, forced_B = inputs if forced is not None else (inputs, None)
      out = self._decode(ctx, cache, x[:, None])
      x_next, q = choose(key_B, out.logits[:, 0], forced_B)
      return (out.cache, x_next), (x_next, q, None if out.features is None else
                                   out.features[:, 0])

    cache = ctx.constrain_cache(cache, "draft")
    (cache, _), (xs, qs, fs) = jax.lax.scan(step, (cache, x1), inputs)
    stack = lambda first, rest: jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], 1)
    q = None if greedy else stack(q1, qs)
    states = None if features is None else stack(features, fs)  # at s_m, x_1 .. x_{num-1}
    return (Proposal.chain(stack(x1, xs), q).replace(states=states),
            ctx.constrain_cache(cache, "draft"))
