"""A draft tree by best-first search (SpecExec, Svirschevski et al. 2024), in static shapes.

Each proposal grows a tree of at most `budget` nodes below the last committed
token s_m (the root), scored by cumulative draft log-probability:
  round 0: the root's top-`width` tokens become its children;
  rounds 1 .. steps-1: the draft scores every node in ONE call (the tree's
      tokens after the committed prefix, each at position m + depth, each
      attending to its own ancestors: `decode(positions=..., tree_mask=...)`);
      the `expand` best unexpanded nodes above depth `depth` get their
      top-`width` children; the `budget` best of old and new nodes are kept.
A path's score never rises with depth, so the kept set is a connected subtree
(ties go to the shallower node). Nodes are listed parents first; unused slots
have parent -2. Scores use the adjusted draft law (temperature, top-k, top-p);
at temperature 0 they use the raw softmax, so the tree still holds alternatives.

The draft cache holds the committed tokens it has seen (state `held` [B]);
each proposal first feeds the ones it lacks (at most depth + 1, one call of
depth + 1 slots), which gives the root's distribution. Draft work per target
call: that call plus steps - 1 calls of `budget` tokens.

The tree carries no q (it is not a sample of the draft), so it suits verifiers
that need none, such as `TreeVerifier` (SpecExec's rule, exact for any tree).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.runner import is_int
from spec_decode.decoding.types import Committed, Proposal

_NEG = -jnp.inf


@flax.struct.dataclass
class TreeState:
  """cache: the draft cache; held [B]: committed tokens s_0.. it holds (after a rewind)."""
  cache: object
  held: jax.Array


def catch_up(ctx, state: TreeState, committed: Committed, depth: int):
  """(root logits [B, V] after s_m, draft cache holding s_0 .. s_m) of a tree drafter.

  Feeds s_held .. s_m in one call of depth + 1 slots: a proposal at most `depth`
  deep commits at most depth + 1 tokens, so that many are all the cache can lack.
  """
  draft, params = ctx.draft, ctx.draft_params
  m, held = committed.length, state.held
  idx = held[:, None] + jnp.arange(depth + 1)[None, :]
  feed = jax.vmap(committed.token_at, in_axes=1, out_axes=1)(jnp.minimum(idx, m[:, None]))
  out = draft.decode(params, state.cache.rewind(held), feed)
  count = m - held + 1
  root_logits = jnp.take_along_axis(out.logits, (count - 1)[:, None, None], axis=1)[:, 0]
  return root_logits, ctx.constrain_cache(out.cache.rewind(m + 1), "draft")


def confidence(path_lp):
  """[B, N] the draft's probability of each node's path (0 for padding) from its path
  log-probabilities (-inf for padding): `Proposal.confidence`."""
  return jnp.where(jnp.isfinite(path_lp), jnp.exp(path_lp), 0.0).astype(jnp.float32)


@registry.drafter("tree")
@dataclasses.dataclass(frozen=True)
class TreeDrafter(Drafter):
  """budget B nodes, `width` children per expansion, `expand` nodes expanded per round,
  paths at most `depth` deep, `steps` rounds (the first expands the root)."""
  budget: int = 16
  width: int = 2
  expand: int = 2
  depth: int = 6
  steps: int = 4
  proposes_trees = True
  reports_confidence = True

  def __post_init__(self):
    for name in ("budget", "width", "expand", "depth", "steps"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise ValueError(f"TreeDrafter.{name} must be an int >= 1, got {v!r}")
    if self.width > self.budget:
      raise ValueError(f"TreeDrafter.width {self.width} exceeds the budget {self.budget}")
    if self.depth > self.budget:
      raise ValueError(f"TreeDrafter.depth {self.depth} exceeds the budget {self.budget}")

  def proposal_size(self, gamma: int) -> int:
    return self.budget

  def expected_tokens(self, *, alpha, gamma, counters=None):
    """The tree's own prediction from the draft's confidences: 1 + the summed node
    confidences per target call (`draft_mass_at`: under SpecExec's rule a node is reached
    with the target's path probability, which the draft's stands in for;
    `theory.tree_budget_choice`); None without those counters."""
    if not counters or "draft_mass_at" not in counters or not counters.get("target_calls"):
      return None
    return 1.0 + float(sum(counters["draft_mass_at"])) / float(counters["target_calls"])

  def init(self, ctx, room: int) -> TreeState:
    cache = ctx.start_cache("draft", room)
    return TreeState(cache=cache, held=jnp.zeros((ctx.batch_size,), jnp.int32))

  def _log_law(self, sampling, logits):
    if sampling.greedy:
      return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = sampling.probs(logits)
    return jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), _NEG)

  def propose(self, ctx, state: TreeState, committed: Committed, keys, num: int):
    draft, params = ctx.draft, ctx.draft_params
    m = committed.length
    root_logits, cache = catch_up(ctx, state, committed, self.depth)

    def score(tok, par, depth, mask, carry):
      out = draft.decode(params, cache, tok, positions=m[:, None] + depth, tree_mask=mask)
      return out.logits, carry

    tok, par, _, path_lp = self.grow(ctx.sampling, root_logits, score, None)
    proposal = Proposal(tokens=tok, q=None, parent=par, confidence=confidence(path_lp))
    return proposal, TreeState(cache=cache, held=m + 1)

  def grow(self, sampling, root_logits, score, carry):
    """(tokens [B, N], parents [B, N], carry, path log-probabilities [B, N]) of the
    best-first tree (see the module doc); padding nodes have log-probability -inf.

    root_logits [B, V]: the draft's logits at the root. score(tokens, parents, depths
    [B, N], ancestor mask [B, N, N], carry) -> (logits [B, N, V] at every node, carry):
    one draft call on the whole tree. carry (None, or an array [B, N, ...] with a row per
    node, zeros for nodes not yet scored) follows its node as the tree is re-ranked.
    """
    B, N, W, E = root_logits.shape[0], self.budget, self.width, self.expand

    # Round 0: the root's children.
    root_lp, root_tok = jax.lax.top_k(self._log_law(sampling, root_logits), W)  # [B, W]
    pad = N - W
    tok = jnp.concatenate([root_tok, jnp.zeros((B, pad), jnp.int32)], axis=1)
    score_ = jnp.concatenate([root_lp, jnp.full((B, pad), _NEG)], axis=1)
    par = jnp.where(jnp.isfinite(score_), -1, -2).astype(jnp.int32)
    par = par.at[:, W:].set(-2)
    depth = jnp.where(par >= -1, 1, 0).astype(jnp.int32)
    expanded = jnp.zeros((B, N), bool)

    for _ in range(self.steps - 1):
      # `depth` is carried (padding has 0; no node attends to padding, so its position
      # is irrelevant): only the ancestor mask is derived from the parents.
      mask = Proposal(tokens=tok, q=None, parent=par).ancestor_mask()
      logits, carry = score(tok, par, depth, mask, carry)
      lp = self._log_law(sampling, logits)
      child_lp, child_tok = jax.lax.top_k(lp, W)  # [B, N, W]
      eligible = jnp.isfinite(score_) & ~expanded & (depth < self.depth)
      key, pick = jax.lax.top_k(jnp.where(eligible, score_, _NEG), min(E, N))  # [B, E]
      ok = jnp.isfinite(key)
      c_tok = jnp.take_along_axis(child_tok, pick[:, :, None], axis=1).reshape(B, -1)
      c_score = (key[:, :, None] + jnp.take_along_axis(child_lp, pick[:, :, None], axis=1))
      c_score = jnp.where(ok[:, :, None], c_score, _NEG).reshape(B, -1)
      c_par = jnp.repeat(pick, W, axis=1)
      c_depth = jnp.take_along_axis(depth, c_par, axis=1) + 1
      expanded = expanded | jnp.any((jnp.arange(N)[None, None, :] == pick[:, :, None])
                                    & ok[:, :, None], axis=1)
      # Old and new nodes; keep the N best (ties to the shallower), parents first.
      all_tok = jnp.concatenate([tok, c_tok], axis=1)
      all_score = jnp.concatenate([score_, c_score], axis=1)
      all_par = jnp.concatenate([par, c_par], axis=1)
      all_depth = jnp.concatenate([depth, c_depth], axis=1)
      all_exp = jnp.concatenate([expanded, jnp.zeros_like(c_tok, bool)], axis=1)
      rank_key = jnp.where(jnp.isfinite(all_score), all_score - 1e-4 * all_depth, _NEG)
      _, keep = jax.lax.top_k(rank_key, N)  # [B, N] indices into the combined nodes
      kept_depth = jnp.take_along_axis(all_depth, keep, axis=1)
      kept_valid = jnp.isfinite(jnp.take_along_axis(all_score, keep, axis=1))
      order = jnp.argsort(jnp.where(kept_valid, kept_depth, N + 1) * (2 * N)
                          + jnp.arange(N)[None, :], axis=1)
      keep = jnp.take_along_axis(keep, order, axis=1)
      new_index = jnp.full(all_tok.shape, -2, jnp.int32)
      new_index = jax.vmap(lambda row, k: row.at[k].set(jnp.arange(N, dtype=jnp.int32)))(
          new_index, keep)
      take = lambda a: jnp.take_along_axis(a, keep, axis=1)
      tok, score_, depth, expanded = take(all_tok), take(all_score), take(all_depth), take(all_exp)
      if carry is not None:
        fresh = jnp.zeros((B, c_tok.shape[1]) + carry.shape[2:], carry.dtype)
        all_carry = jnp.concatenate([carry, fresh], axis=1)
        carry = jnp.take_along_axis(
            all_carry, keep.reshape(keep.shape + (1,) * (carry.ndim - 2)), axis=1)
      old_par = take(all_par)
      par = jnp.where(old_par >= 0,
                      jnp.take_along_axis(new_index, jnp.maximum(old_par, 0), axis=1), old_par)
      par = jnp.where(jnp.isfinite(score_), par, -2).astype(jnp.int32)
      tok = jnp.where(jnp.isfinite(score_), tok, 0)
    return tok.astype(jnp.int32), par, carry, score_
