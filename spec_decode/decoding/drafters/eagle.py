"""EAGLE drafting: a head on the target's own decoder features proposes a chain.

`ctx.draft` is an EAGLE head (`FeatureHead`, e.g. `heads.eagle.EagleHead`) and
`ctx.draft_params` its parameters; the head reads the target's embeddings and LM head from
`ctx.target_params` and cross-attends to `ctx.encode("target")`, the encoding
the target cache was built from (no second encoder pass).

State per row with m tokens committed: the head cache holds the pairs
(f_t, s_{t+1}) for t < m (length m, as the target cache), and `feature` is
the head's prediction of f_m, the target's state at input s_m.

  propose: x_1 from the LM head on `feature`; then num - 1 head steps, each
           fed its own last prediction and the token just chosen. The head
           writes past m; the state keeps the cache rewound to m.
  commit:  the verify call's target_hidden[:, i] is the true f_{m+i} for
           i <= n (n accepted), so the head is fed the K + 1 pairs
           (f_{m+i}, s_{m+i+1}) in one call, rewound to the new length m', and
           `feature` becomes its prediction at pair m' - 1 (f_{m'}).

A row's first iteration (nothing committed yet: the loop's first, or the first after
the row entered a refilled slot) has no target feature: with a learned start
(`EagleHead.has_start`) `feature` is the head's own prediction of f_0 (made in `init`,
from the row's encoder output) and the proposal is full; without one its proposal has
length 0, so the verify call is a plain target step (the verifier accepts nothing and
draws s_1 from p at the root); from then on every proposal is full. Greedy proposals
are the LM head's argmax chain with q None; sampled ones draw from the adjusted law
`ctx.sampling.probs` and return it as q, so the chain verifier's rejection sampling
stays exact. Unsharded runs only (mesh=None).

`EagleTreeDrafter` grows a tree instead (EAGLE-2's dynamic draft tree, built by
the best-first search of `TreeDrafter` from the head's own scores): every
round scores all nodes in one head call, node i paired with its parent's
predicted feature (the root's: `feature`) at position m + depth - 1 and
seeing only its ancestors, so each node's logits are exactly what the chain
drafter computes along that node's path. The tree carries no q, so it goes
with `TreeVerifier` (SpecExec's rule, exact for any tree). Its commit gathers
the target's states along the accepted path and commits them as a chain.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.drafters.tree import TreeDrafter, confidence
from spec_decode.decoding.sampling import argmax, draw
from spec_decode.decoding.types import Committed, Proposal
from spec_decode.models.base import BOS_ID


@runtime_checkable
class FeatureHead(Protocol):
  """What the EAGLE drafters ask of their draft "model" (`heads.eagle.EagleHead`): a
  network predicting the target's next final decoder state from the last one and the
  embedding of the token chosen after it."""
  config: Any  # its dtype: config.dtype
  d_model: int

  def check_target(self, target) -> None:
    """Raises ValueError unless the head reads this target's states and LM head."""

  def init_cache(self, params, encoded, max_decode_len: int):
    """An empty head cache cross-attending to the target's encoder output."""

  def step(self, params, cache, features_BTD, embeddings_BTD, *, positions=None,
           tree_mask=None):
    """(predicted next features [B, T, D], cache with lengths + T)."""

  target_layers: tuple[int, ...]  # target decoder layers read beside the final state

  def target_input(self, params, hidden_BTF):
    """The D-wide feature fed to `step` from the target's states (`Committed.target_hidden`)."""

  has_start: bool  # whether start_prediction predicts f_0 before the target ran

  def start_prediction(self, params, cache, embeddings_B1D):
    """The predicted f_0 [B, D] from the empty cache and the embedding of s_0."""


@flax.struct.dataclass
class EagleState:
  """cache: the head's cache (lengths m); feature [B, D]: the predicted f_m."""
  cache: object
  feature: jax.Array


@registry.drafter("eagle")
@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
  """Proposes a chain from an EAGLE head (the loop's draft model); see the module doc."""

  def check_models(self, target, draft) -> None:
    if not isinstance(draft, FeatureHead):
      raise ValueError(f"EagleDrafter needs an EagleHead as the draft model "
                       f"(spec_decode.heads.eagle), got {type(draft).__name__}")
    draft.check_target(target)

  def target_layers(self, draft) -> tuple[int, ...]:
    return tuple(draft.target_layers)

  def init(self, ctx, room: int):
    if ctx.mesh is not None:
      raise ValueError("EagleDrafter runs unsharded only (mesh=None)")
    head = ctx.draft
    cache = head.init_cache(ctx.draft_params, ctx.encode("target"), room)
    if head.has_start:  # f_0 predicted from the encoder output: the first call drafts too
      bos = jnp.full((ctx.batch_size, 1), BOS_ID, jnp.int32)
      feature = head.start_prediction(ctx.draft_params, cache,
                                      ctx.target.embed(ctx.target_params, bos))
    else:
      feature = jnp.zeros((ctx.batch_size, head.d_model), head.config.dtype)
    return EagleState(cache=cache, feature=feature.astype(head.config.dtype))

  def propose(self, ctx, state: EagleState, committed: Committed, keys_BK, num: int):
    head, hp = ctx.draft, ctx.draft_params
    target, tp, sampling = ctx.target, ctx.target_params, ctx.sampling
    greedy = sampling.greedy

    def choose(key_B, feature_BD):
      logits = target.logits_from_hidden(tp, feature_BD[:, None].astype(target.config.dtype))
      logits = logits[:, 0]
      if greedy:
        return argmax(logits), None
      q = sampling.probs(logits)
      return draw(key_B, q, greedy=False), q

    x1, q1 = choose(keys_BK[:, 0], state.feature)

    def step(carry, key_B):
      cache, feature, x = carry
      pred, cache = head.step(hp, cache, feature[:, None], target.embed(tp, x[:, None]))
      x, q = choose(key_B, pred[:, 0])
      return (cache, pred[:, 0], x), (x, q)

    (cache, _, _), (xs, qs) = jax.lax.scan(step, (state.cache, state.feature, x1),
                                           jnp.swapaxes(keys_BK[:, 1:], 0, 1))
    x = jnp.concatenate([x1[:, None], jnp.swapaxes(xs, 0, 1)], axis=1)
    q = None if greedy else jnp.concatenate([q1[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    B = x.shape[0]
    # A row's first iteration (nothing committed yet, also for a row that entered a
    # refilled slot) has no target feature: an empty proposal, unless the head predicted
    # f_0 from its learned start.
    length = jnp.full_like(committed.length, num) if head.has_start else jnp.where(
        committed.length == 0, 0, num)
    length = length.astype(jnp.int32)
    return (Proposal.chain(x, q, length=length),
            state.replace(cache=cache.rewind(state.cache.lengths)))

  def commit(self, ctx, state: EagleState, committed: Committed, verdict, proposal):
    head, hp = ctx.draft, ctx.draft_params
    target, tp = ctx.target, ctx.target_params
    hidden = committed.target_hidden  # [B, K + 1, D (x layers)]: f_m .. f_{m+K} on the proposal
    if hidden is None:
      raise ValueError("EagleDrafter needs the target's decoder features (target_hidden)")
    K1 = hidden.shape[1]
    m = state.cache.lengths
    # s_{m+1} .. s_{m+K+1}: the tokens chosen after f_m .. f_{m+K} (junk past the new length).
    nxt = jax.vmap(lambda row, at: jax.lax.dynamic_slice(row, (at,), (K1,)))(committed.tokens, m)
    pred, cache = head.step(hp, state.cache, head.target_input(hp, hidden), target.embed(tp, nxt))
    new_length = committed.length
    last = jnp.clip(new_length - m - 1, 0, K1 - 1)  # pair m' - 1 predicts f_{m'}
    feature = jnp.take_along_axis(pred, last[:, None, None], axis=1)[:, 0]
    return EagleState(cache=cache.rewind(new_length), feature=feature)


@registry.drafter("eagle_tree")
@dataclasses.dataclass(frozen=True)
class EagleTreeDrafter(TreeDrafter):
  """A best-first tree (`TreeDrafter`'s budget, width, expand, depth, steps) from an EAGLE
  head; see the module doc."""

  def check_models(self, target, draft) -> None:
    EagleDrafter().check_models(target, draft)

  def target_layers(self, draft) -> tuple[int, ...]:
    return EagleDrafter().target_layers(draft)

  def init(self, ctx, room: int):
    return EagleDrafter().init(ctx, room)

  def propose(self, ctx, state: EagleState, committed: Committed, keys, num: int):
    head, hp = ctx.draft, ctx.draft_params
    target, tp = ctx.target, ctx.target_params
    m = committed.length
    lm = lambda h: target.logits_from_hidden(tp, h.astype(target.config.dtype))
    root_feature = state.feature

    def score(tok, par, depth, mask, feats):
      parent_feature = jnp.where((par >= 0)[..., None],
                                 jnp.take_along_axis(feats, jnp.maximum(par, 0)[..., None],
                                                     axis=1), root_feature[:, None])
      pred, _ = head.step(hp, state.cache, parent_feature, target.embed(tp, tok),
                          positions=m[:, None] + depth - 1, tree_mask=mask)
      return lm(pred), pred

    B, N = m.shape[0], self.budget
    feats = jnp.zeros((B, N, head.d_model), head.config.dtype)
    tok, par, _, path_lp = self.grow(ctx.sampling, lm(root_feature[:, None])[:, 0], score,
                                     feats)
    if not head.has_start:  # no target feature yet: an empty tree
      par = jnp.where((m == 0)[:, None], -2, par)
    conf = jnp.where(par >= -1, confidence(path_lp), 0.0)
    return Proposal(tokens=tok, q=None, parent=par, confidence=conf), state

  def commit(self, ctx, state: EagleState, committed: Committed, verdict, proposal):
    hidden = committed.target_hidden  # [B, K + 1, D (x layers)] at [s_m, node 0 .. K - 1]
    if hidden is None:
      raise ValueError("EagleTreeDrafter needs the target's decoder features (target_hidden)")
    along = jnp.concatenate([jnp.zeros_like(verdict.path[:, :1]), verdict.path[:, :self.depth]
                             + 1], axis=1)  # the accepted path's states first
    chain = jnp.take_along_axis(hidden, along[..., None], axis=1)
    return EagleDrafter().commit(ctx, state, committed.replace(target_hidden=chain), verdict,
                                 proposal)
