"""A draft tree SAMPLED from the draft model: `width` children per node, `depth` levels.

The tree has a fixed shape, so its parents, depths and ancestor mask are
static: level 1 holds the root's `width` children, level l + 1 the `width`
children of each level-l node; nodes are listed level by level (parents
first), node i's parent is static, and K = width + width^2 + ... + width^depth.

Each node's children are drawn from the draft's adjusted law q at that node
(temperature, top-k, top-p), WITHOUT replacement by default: Gumbel-top-k on
log q, i.e. `width` distinct tokens in the order of a sequential draw without
replacement (with_replacement=True draws them i.i.d. from q instead, which
may repeat a token). Proposal.q[i] is q at node i's parent, the same for all
siblings. Where q's support holds fewer than `width` tokens (top-k, top-p)
the missing children, and everything below them, are padding (parent -2).

Draft work per proposal: the catch-up call of `TreeDrafter` (which gives q at
the root), then one call per level 2 .. depth on the levels above it (each
node at position m + depth, attending to its ancestors).

Verifiers: `TreeRRSVerifier` (recursive rejection sampling; its rule must
match `with_replacement`, which `Speculative` checks), or `TreeVerifier`
(SpecExec's rule, exact for any tree). At temperature 0 the tree is
deterministic: each node's top-`width` tokens under the raw softmax (as in
`TreeDrafter`, so the tree still holds alternatives), with q None.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.drafters.tree import TreeState, catch_up
from spec_decode.decoding.runner import is_int
from spec_decode.decoding.types import Committed, Proposal

MAX_NODES = 1024


def tree_shape(width: int, depth: int):
  """(offsets, parent [K], depth [K], ancestor mask [K, K]) of the full tree, numpy.

  offsets[l] is the index of level l + 1's first node (offsets[depth] = K).
  """
  sizes = [width ** l for l in range(1, depth + 1)]
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  K = int(offsets[-1])
  parent = np.full(K, -1, np.int32)
  level = np.ones(K, np.int32)
  for l in range(1, depth):
    idx = np.arange(offsets[l], offsets[l + 1])
    parent[idx] = offsets[l - 1] + (idx - offsets[l]) // width
    level[idx] = l + 1
  mask = np.eye(K, dtype=bool)
  for i in range(K):
    if parent[i] >= 0:
      mask[i] |= mask[parent[i]]
  return offsets, parent, level, mask


@registry.drafter("sampled_tree")
@dataclasses.dataclass(frozen=True)
class SampledTreeDrafter(Drafter):
  """`width` children per node, drawn from q (without replacement unless with_replacement),
  for `depth` levels: width + width^2 + ... + width^depth nodes per proposal."""
  width: int = 2
  depth: int = 3
  with_replacement: bool = False
  proposes_trees = True

  def __post_init__(self):
    for name in ("width", "depth"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise ValueError(f"SampledTreeDrafter.{name} must be an int >= 1, got {v!r}")
    if not isinstance(self.with_replacement, bool):
      raise ValueError(f"SampledTreeDrafter.with_replacement must be a bool, got "
                       f"{self.with_replacement!r}")
    if self.proposal_size(1) > MAX_NODES:
      raise ValueError(f"SampledTreeDrafter(width={self.width}, depth={self.depth}) has "
                       f"{self.proposal_size(1)} nodes, more than {MAX_NODES}")

  @property
  def sibling_draws(self) -> str:
    """How siblings are drawn from q: 'with_replacement' or 'without_replacement'."""
    return "with_replacement" if self.with_replacement else "without_replacement"

  def proposal_size(self, gamma: int) -> int:
    return sum(self.width ** l for l in range(1, self.depth + 1))

  def init(self, ctx, room: int) -> TreeState:
    cache = ctx.start_cache("draft", room)
    return TreeState(cache=cache, held=jnp.zeros((ctx.batch_size,), jnp.int32))

  def _children(self, sampling, key_B, logits_BMV):
    """(tokens [B, M, W], drawn [B, M, W] bool, q [B, M, V] or None) below M nodes."""
    W = self.width
    if sampling.greedy:
      _, tok = jax.lax.top_k(jax.nn.log_softmax(logits_BMV.astype(jnp.float32), axis=-1), W)
      return tok.astype(jnp.int32), jnp.ones(tok.shape, bool), None
    q = sampling.probs(logits_BMV)
    logq = jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)
    if self.with_replacement:
      draw = lambda k, lq: jax.random.categorical(k, lq[:, None, :], axis=-1,
                                                  shape=(lq.shape[0], W))
      tok = jax.vmap(draw)(key_B, logq)
      return tok.astype(jnp.int32), jnp.ones(tok.shape, bool), q
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logq.shape[1:]))(key_B)
    score, tok = jax.lax.top_k(logq + gumbel, W)  # W distinct tokens, in draw order
    return tok.astype(jnp.int32), jnp.isfinite(score), q

  def propose(self, ctx, state: TreeState, committed: Committed, keys, num: int):
    draft, params, sampling = ctx.draft, ctx.draft_params, ctx.sampling
    B, W, D = ctx.batch_size, self.width, self.depth
    offsets, parent_np, level_np, mask_np = tree_shape(W, D)
    m = committed.length
    logits, cache = catch_up(ctx, state, committed, D)
    logits = logits[:, None]  # [B, 1, V]: the root
    level_keys = jax.vmap(lambda k: jax.random.split(k, D))(keys[:, 0])  # [B, D]
    toks, drawn, qs = [], [], []
    above = jnp.ones((B, 1), bool)  # whether each node of the level above is in the tree
    for l in range(D):
      if l > 0:  # the draft's laws at level l's nodes (the levels above them are fed)
        n = int(offsets[l])
        tok_above = jnp.concatenate(toks, axis=1)
        out = draft.decode(params, cache, tok_above,
                           positions=m[:, None] + jnp.asarray(level_np[None, :n]),
                           tree_mask=jnp.broadcast_to(jnp.asarray(mask_np[:n, :n]), (B, n, n)))
        logits = out.logits[:, offsets[l - 1]:offsets[l]]
      tok, ok, q = self._children(sampling, level_keys[:, l], logits)
      M = tok.shape[1]
      above = (ok & above[:, :, None]).reshape(B, M * W)  # below a missing node: missing
      toks.append(tok.reshape(B, M * W))
      drawn.append(above)
      if q is not None:
        qs.append(jnp.repeat(q, W, axis=1))  # each child carries its parent's law
    tok = jnp.concatenate(toks, axis=1)
    valid = jnp.concatenate(drawn, axis=1)
    parent = jnp.where(valid, jnp.asarray(parent_np)[None, :], -2).astype(jnp.int32)
    q = jnp.concatenate(qs, axis=1) if qs else None
    proposal = Proposal(tokens=jnp.where(valid, tok, 0), q=q, parent=parent)
    return proposal, TreeState(cache=cache, held=m + 1)
