"""Drafting with DeepSeek-V3-style sequential MTP modules (`heads.mtp`).

`ctx.draft` is a stack of D modules (`MtpNetwork`, e.g. `heads.mtp.MtpModules`) and
`ctx.draft_params` their parameters; the modules read the target's embeddings and LM head from
`ctx.target_params` and cross-attend to `ctx.encode("target")`.

Module k at position t reads (h^{k-1}_t, s_{t+k}), so its entry at t is made
of true tokens only while t + k <= m (m tokens committed; s_m is the last
one). A proposal of gamma = num tokens runs module k = 1 .. num at position
m - 1, where it reads the drafts x_1 .. x_{k-1} as s_{m+1} .. s_{m+k-1}, and
proposes x_k = s_{m+k}. So the state keeps, for a common boundary P per row:

  caches:  module k's self-attention cache holding the true entries t < P;
  feats:   [B, 2D, D_model] the target's features f_{P+j} at slot j
           (known for P + j < m; later slots are junk);
  m:       the committed length at the last proposal.

propose: each module k <= num runs once over the window t = P .. P + 2 num - 1
         (its input states are the previous module's outputs on the same
         window, module 1's the features), its output at t = m - 1 gives x_k;
         then the caches are rewound to the new boundary P' = max(m - num + 1, 0),
         below which every module's entries are made of true tokens (t + k <= m),
         and `feats` shifts to start at P'. The window holds m - 1 because m
         grows by at most num + 1 per iteration.
commit:  the verify call's target_hidden[:, i] is f_{m+i} for i <= n (n
         accepted): written into `feats` at slots m - P + i. No module runs.

A row's first iteration (nothing committed yet, also after it entered a refilled slot)
has no target feature: it proposes nothing (the verify
call is a plain target step), as the EAGLE drafter. Greedy proposals take each
module's argmax (q None); sampled ones draw x_k from the adjusted law
`ctx.sampling.probs` of module k's logits and return it as q_k, so the chain
verifier's rejection sampling stays exact. Unsharded runs only (mesh=None).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.sampling import argmax, draw
from spec_decode.decoding.types import Committed, Proposal


@runtime_checkable
class MtpNetwork(Protocol):
  """What `MtpDrafter` asks of its draft "model" (`heads.mtp.MtpModules`): D sequential
  modules over the target's final decoder states."""
  config: Any  # its dtype: config.dtype
  d_model: int
  num_modules: int

  def check_target(self, target) -> None:
    """Raises ValueError unless the modules read this target's states and LM head."""

  def init_caches(self, params, encoded, max_length: int, num: int):
    """Empty self-attention caches of modules 1 .. num."""

  def window_step(self, params, k: int, cache, states_BWD, tokens_BW, at_B, target,
                  target_params):
    """Module k over a window: (its states [B, W, D], its cache, logits [B, V] at at_B)."""


@flax.struct.dataclass
class MtpState:
  """caches: the D modules' caches (lengths P); feats [B, 2D, D_model]; m [B]."""
  caches: tuple
  feats: jax.Array
  m: jax.Array

  @property
  def boundary(self) -> jax.Array:
    return self.caches[0].lengths


def _tokens_at(committed: Committed, positions_BW):
  """s_i for each position i (s_0 = BOS; junk past each row's length)."""
  R = committed.tokens.shape[1]
  prev = jnp.take_along_axis(committed.tokens, jnp.clip(positions_BW - 1, 0, R - 1), axis=1)
  return jnp.where(positions_BW > 0, prev, 0)


@registry.drafter("mtp")
@dataclasses.dataclass(frozen=True)
class MtpDrafter(Drafter):
  """Proposes gamma <= D tokens from D sequential MTP modules; see the module doc."""

  def check_models(self, target, draft) -> None:
    if not isinstance(draft, MtpNetwork):
      raise ValueError(f"MtpDrafter needs MTP modules (spec_decode.heads.mtp) as the draft "
                       f"model, got {type(draft).__name__}")
    draft.check_target(target)

  def max_gamma(self, draft) -> int:
    return draft.num_modules

  def init(self, ctx, room: int):
    if ctx.mesh is not None:
      raise ValueError("MtpDrafter runs unsharded only (mesh=None)")
    modules = ctx.draft
    D = modules.num_modules
    W = 2 * D
    caches = modules.init_caches(ctx.draft_params, ctx.encode("target"), room + W, D)
    B = ctx.batch_size
    return MtpState(caches=caches,
                    feats=jnp.zeros((B, W, modules.d_model), modules.config.dtype),
                    m=jnp.zeros((B,), jnp.int32))

  def propose(self, ctx, state: MtpState, committed: Committed, keys_BK, num: int):
    modules, params = ctx.draft, ctx.draft_params
    target, tp, sampling = ctx.target, ctx.target_params, ctx.sampling
    if num > modules.num_modules:
      raise ValueError(f"gamma {num} exceeds the {modules.num_modules} MTP modules; use gamma <= "
                       f"{modules.num_modules}")
    m, P = committed.length, state.boundary
    W = 2 * num
    # seq[:, i] = s_{P+i}: true up to s_m, the drafts written in as they are chosen.
    span = jnp.arange(W + num + 1)[None, :]
    seq = _tokens_at(committed, P[:, None] + span)
    at = jnp.clip(m - 1 - P, 0, W - 1)  # window slot of position m - 1
    new_P = jnp.maximum(m - num + 1, 0)
    h = state.feats[:, :W]
    caches, xs, qs = list(state.caches), [], []
    for k in range(1, num + 1):
      h, cache, logits = modules.window_step(params, k, caches[k - 1], h, seq[:, k:k + W], at,
                                             target, tp)
      caches[k - 1] = cache.rewind(new_P)
      if sampling.greedy:
        x, q = argmax(logits), None
      else:
        q = sampling.probs(logits)
        x = draw(keys_BK[:, k - 1], q, greedy=False)
      seq = jnp.where(span == (m + k - P)[:, None], x[:, None], seq)  # s_{m+k} = x_k
      xs.append(x)
      qs.append(q)
    x = jnp.stack(xs, axis=1)
    q = None if sampling.greedy else jnp.stack(qs, axis=1)
    # A row's first iteration (m = 0, also in a refilled slot) has no target feature.
    length = jnp.where(m == 0, 0, num).astype(jnp.int32)
    # Slot j of the shifted buffer holds f_{P'+j}.
    slots = jnp.arange(state.feats.shape[1])[None, :] + (new_P - P)[:, None]
    feats = jnp.take_along_axis(state.feats,
                                jnp.clip(slots, 0, state.feats.shape[1] - 1)[..., None], axis=1)
    return (Proposal.chain(x, q, length=length),
            MtpState(caches=tuple(caches), feats=feats, m=m))

  def commit(self, ctx, state: MtpState, committed: Committed, verdict, proposal):
    hidden = committed.target_hidden  # [B, K + 1, D]: f_m .. f_{m+K} along the proposal
    if hidden is None:
      raise ValueError("MtpDrafter needs the target's decoder features (target_hidden)")
    K1 = hidden.shape[1]
    W = state.feats.shape[1]
    i = jnp.arange(W)[None, :] - (state.m - state.boundary)[:, None]  # slot j holds f_{m+i}
    new = jnp.take_along_axis(hidden.astype(state.feats.dtype),
                              jnp.clip(i, 0, K1 - 1)[..., None], axis=1)
    feats = jnp.where(((i >= 0) & (i < K1))[..., None], new, state.feats)
    return state.replace(feats=feats)
