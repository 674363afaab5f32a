"""Medusa heads as the drafter: K tokens at once from the target's last decoder state.

The loop's draft "model" is a set of heads (`MedusaNetwork`, e.g.
`heads.medusa.MedusaHeads`; its params the draft params). The state is h [B, D],
the target's final decoder state at the input whose logits gave the last
committed token: after a verify call on [s_m, x_1 .. x_K] that accepted n tokens
it is `committed.target_hidden[:, n]` (the extra token s_{m+n+1} was drawn from
the target's law there), so no target call is added. Head k then proposes token
s_{m+n+1+k}, for k = 1 .. gamma: the chain's first token follows the extra
token. Before the first target call there is no state yet; the heads then read
zeros (a fixed guess that the verifier simply rejects when wrong; the output law
is unchanged).

At temperature 0 each head proposes its argmax (q None); otherwise x_k is
drawn from head k's adjusted law q_k (the same `Sampling` as the target's), so
token-level rejection sampling keeps the target's law exactly (q_k need not
depend on x_1 .. x_{k-1}: any proposal law is fine if it is the one used).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.sampling import argmax, draw
from spec_decode.decoding.types import Committed, Proposal, Verdict


@runtime_checkable
class MedusaNetwork(Protocol):
  """What `MedusaDrafter` asks of its draft "model" (`heads.medusa.MedusaHeads`)."""
  num_heads: int

  def check_target(self, target) -> None:
    """Raises ValueError unless the heads read this target's decoder states."""

  def logits(self, params, target, target_params, hidden):
    """hidden [..., D] (the target's final decoder states) -> logits [..., K, V]."""


@registry.drafter("medusa")
@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
  """Proposes gamma <= K tokens from the K Medusa heads (the loop's draft model)."""

  def check_models(self, target, draft) -> None:
    if not isinstance(draft, MedusaNetwork):
      raise ValueError(f"MedusaDrafter needs Medusa heads as the draft model "
                       f"(spec_decode.heads.medusa), got {type(draft).__name__}")
    draft.check_target(target)

  def max_gamma(self, draft) -> int:
    return draft.num_heads

  def init(self, ctx, room: int):
    return jnp.zeros((ctx.batch_size, ctx.target.config.emb_dim), jnp.float32)

  def propose(self, ctx, hidden, committed: Committed, keys_BK, num: int):
    heads = ctx.draft
    if num > heads.num_heads:
      raise ValueError(f"gamma {num} exceeds the {heads.num_heads} Medusa heads; use gamma <= "
                       f"{heads.num_heads}")
    logits = heads.logits(ctx.draft_params, ctx.target, ctx.target_params, hidden)[:, :num]
    if ctx.sampling.greedy:
      return Proposal.chain(argmax(logits)), hidden
    q = ctx.sampling.probs(logits)  # [B, num, V]
    x = jax.vmap(lambda k, p: draw(k, p, greedy=False), in_axes=1, out_axes=1)(keys_BK, q)
    return Proposal.chain(x, q), hidden

  def commit(self, ctx, hidden, committed: Committed, verdict: Verdict, proposal: Proposal):
    if committed.target_hidden is None:
      raise ValueError("MedusaDrafter needs a target whose decode returns its hidden states")
    at = verdict.accepted[:, None, None]  # a chain: input n holds the law of the extra token
    return jnp.take_along_axis(committed.target_hidden, at, axis=1)[:, 0].astype(jnp.float32)
