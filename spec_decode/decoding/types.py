"""What decoders return and what drafters and verifiers exchange.

Axis letters: B batch, L max decode length, K proposed tokens, V vocab.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class DecodeStats:
  """Named per-row counters; each algorithm declares its own (`Algorithm.init_stats`).

  Every counter has the batch as its first axis: [B] totals, or [B, K] per
  draft position, K being the algorithm's own maximum number of proposed
  tokens. Read them as attributes (`stats.accepted`) or by name
  (`stats.counters["accepted"]`). The speculative algorithms count:

  target_calls: target (decoder) invocations while the row was active (the
                autoregressive baseline's counter too).
  nonfinite_calls: those target calls whose logits for the row held a NaN or an
                infinity (both kinds of decoder count it): a row with any decoded
                nothing the model meant (an argmax over NaN is PAD).
  draft_tokens: tokens the drafter proposed (a proposal's `proposed` length, which an
                adaptive drafter varies per row; `draft_tokens / target_calls` is
                the mean drafted length per call).
  accepted:     proposed tokens accepted by the verifier.
  decisions:    draft positions where an accept/reject decision was made
                (every position up to and including the first rejection; for
                block verification the emitted ones and the first one not emitted);
                `accepted / decisions` is the observed acceptance rate.
  min_pq_sum:   sum over those same positions of sum_x min(p(x), q(x)), the
                paper's beta (Cor. 3.6); `min_pq_sum / decisions` estimates alpha.
  accepted_at:  [B, K] how often draft position i (0-based) was accepted.
  decided_at:   [B, K] how often it was decided.
  first_call_tokens: tokens the row's first target call committed (its first iteration,
                nothing committed before it; also a row entering a refilled slot): a
                drafter that proposes nothing before the target's first features
                (EAGLE and MTP without a learned start) yields 1 there, so
                `tokens / target_calls` mixes that call with calls that draft.
  draft_mass_at: [B, K] float32, only with drafters that report confidences (trees):
                summed over target calls, the i-th largest node confidence of the
                proposal (`Proposal.confidence`); 1 + the sum of its first B
                entries / target_calls is the draft's own estimate of tokens per
                call of a budget-B tree (`theory.tree_budget_choice`).
  """
  counters: Mapping[str, jax.Array]

  def __getattr__(self, name: str):
    counters = self.__dict__.get("counters")
    if counters is not None and name in counters:
      return counters[name]
    raise AttributeError(f"DecodeStats has no counter {name!r}; it has "
                         f"{sorted(counters) if counters is not None else []}")

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(sorted(self.counters))

  @classmethod
  def zeros(cls, batch_size: int, **shapes: tuple[tuple[int, ...], Any]) -> "DecodeStats":
    """Counters named by `shapes`: name=(per-row shape, dtype), e.g. accepted=((), jnp.int32)."""
    return cls({name: jnp.zeros((batch_size,) + tuple(shape), dtype)
                for name, (shape, dtype) in shapes.items()})

  def add(self, **increments: jax.Array) -> "DecodeStats":
    """These counters plus the increments (names must exist)."""
    unknown = set(increments) - set(self.counters)
    if unknown:
      raise ValueError(f"unknown counters {sorted(unknown)}; known: {self.names}")
    return DecodeStats({k: v + increments[k].astype(v.dtype) if k in increments else v
                        for k, v in self.counters.items()})


@flax.struct.dataclass
class DecodeResult:
  """tokens [B, L] int32 without BOS, 0 after each row's end; lengths [B] (EOS included)."""
  tokens: jax.Array
  lengths: jax.Array
  stats: DecodeStats


@flax.struct.dataclass
class Proposal:
  """A drafter's proposal: a chain, or a tree whose nodes are listed parents first.

  tokens [B, K] int32: the proposed tokens (node i's token).
  q      [B, K, V] float32: the draft distribution node i was drawn from (the
         adjusted law at its parent), or None for a deterministic draft (the
         verifier then treats each token as drawn from a point mass).
  parent [B, K] int32: node i's parent index, -1 for a child of the last
         committed token (the root); a chain has parent[i] = i - 1.
  length [B] int32 or None: a chain's proposed tokens per row (0 <= length <= K;
         None: all K). Positions >= length are padding (shapes stay static):
         verifiers treat them as not proposed, so after accepting all `length`
         tokens the extra token is drawn from p at position `length`. Length 0
         (a drafter with nothing to propose yet, e.g. EAGLE before the first
         target feature) makes the verify call a plain step: the extra token
         is drawn from p at the root.
  confidence [B, K] float32 or None: the draft's own probability of reaching
         node i (its law multiplied along the path from the root; 0 for
         padding), from drafters that report it (`Drafter.reports_confidence`).
         Under SpecExec's rule a node is reached with the TARGET's path
         probability, so 1 + the sum of the B largest confidences estimates the
         tokens per call of a budget-B tree from the draft alone (see
         `theory.tree_budget_choice`).
  states [B, K, ...] or None: what the drafter computed at a chain's first K verify
         inputs (s_m, nodes 0 .. K - 2) that its own verify call reuses
         (`Drafter.verify_call`: the layer skip's residual streams); verifiers ignore it.
  """
  tokens: jax.Array
  q: Any
  parent: jax.Array
  length: Any = None
  confidence: Any = None
  states: Any = None

  @property
  def size(self) -> int:
    return self.tokens.shape[1]

  @property
  def proposed(self) -> jax.Array:
    """[B] int32: tokens proposed per row: `length`, or else the nodes that are not
    padding (a tree pads with parent -2; a full chain has K)."""
    if self.length is None:
      return jnp.sum(self.parent >= -1, axis=1).astype(jnp.int32)
    return jnp.asarray(self.length, jnp.int32)

  @classmethod
  def chain(cls, tokens: jax.Array, q=None, length=None) -> "Proposal":
    B, K = tokens.shape
    return cls(tokens=tokens, q=q,
               parent=jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32) - 1, (B, K)),
               length=length)

  def depths(self) -> jax.Array:
    """[B, K] depth of each node (1 for a child of the root); parents come first."""
    B, K = self.parent.shape
    depth = jnp.zeros((B, K), jnp.int32)
    for i in range(K):  # K is static and small
      par = self.parent[:, i]
      d = jnp.where(par < 0, 1, jnp.take_along_axis(depth, jnp.maximum(par, 0)[:, None],
                                                    axis=1)[:, 0] + 1)
      depth = depth.at[:, i].set(d)
    return depth

  def ancestor_mask(self) -> jax.Array:
    """[B, K, K] bool: node j is node i or one of its ancestors."""
    B, K = self.parent.shape
    mask = jnp.zeros((B, K, K), bool)
    eye = jnp.eye(K, dtype=bool)
    for i in range(K):
      par = jnp.maximum(self.parent[:, i], 0)
      inherited = jnp.take_along_axis(mask, par[:, None, None], axis=1)[:, 0]  # [B, K]
      row = jnp.where((self.parent[:, i] >= 0)[:, None], inherited, False) | eye[i][None]
      mask = mask.at[:, i].set(row)
    return mask


@flax.struct.dataclass
class Verdict:
  """A verifier's decision for each row.

  accepted [B] int32: n, how many proposed nodes are kept.
  path     [B, K] int32: the kept nodes' indices in order (entries >= n unused);
           a chain keeps 0 .. n - 1.
  extra    [B] int32: the token drawn after the kept nodes (the correction
           after a rejection, or the bonus token after a full acceptance).
  decided  [B] int32: draft positions on which a decision was made.
  beta     [B, K] float32: sum_x min(p(x), q(x)) at each proposed position
           (the alpha estimator's terms; 1 where the draft equals the target).
  Tree verifiers say what a decision is for them (tree.py: a visited node with
  children; tree_rrs.py: one child's test, beta[t] that test's acceptance chance).
  """
  accepted: jax.Array
  path: jax.Array
  extra: jax.Array
  decided: jax.Array
  beta: jax.Array


@flax.struct.dataclass
class Committed:
  """The tokens a row has committed so far (read-only view for drafters).

  tokens [B, R]: s_1, s_2, ... (R >= max_decode_len; junk past each length).
  length [B]: m, tokens committed. it: scalar, the loop iteration.
  `token_at(i)` is s_i with s_0 = BOS (i may be 0 .. m, per row).
  target_hidden [B, K + 1, D] or None: in `Drafter.commit` only, the target's
  final decoder states from this iteration's verify call, at its inputs
  [s_m (the old m), proposal node 0 .. K - 1]: state i is what the target read its
  logits at input i from (None for models that expose none). Feature-level
  drafters read it here, so they need no second target pass. A drafter whose
  `target_layers` names decoder layers gets [B, K + 1, D * (1 + len(layers))]: the
  final states, then the residual streams after those layers.
  """
  tokens: jax.Array
  length: jax.Array
  it: jax.Array
  target_hidden: Any = None

  def token_at(self, i: jax.Array) -> jax.Array:
    prev = jnp.take_along_axis(self.tokens, jnp.maximum(i - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.where(i > 0, prev, 0)
