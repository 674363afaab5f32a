"""The draft model with an adaptive, per-row draft length (inside the jit).

The speculative loop's gamma is the static maximum K; each row proposes
`length` <= K tokens (`Proposal.length`), decided by one of three rules:

  schedule   a per-row length: + grow (default 2) after a fully accepted block,
             - shrink (default 1) otherwise, clipped to [min_length, K]; the
             first block proposes `start` (default K) tokens.
  threshold  draft x_1, x_2, ... and stop after the first token whose draft
             probability is below `threshold` (or at K).
  tuned      the threshold rule with a per-row threshold tuned from the row's
             own past blocks: + step * target_full after a block with a
             rejection (it drafted too far), - step * (1 - target_full) after
             a fully accepted one, clipped to [0.01, 0.99]. In equilibrium a
             fraction target_full of the blocks is fully accepted.

The draft probability is the draft model's own softmax of its logits at the
token it drew (temperature 1, no top-k/top-p), so the rule also works at
temperature 0 where the adjusted law is a point mass.

Exactness: the rules decide whether to draft position i + 1 from x_1 .. x_i
and past blocks only (the token with low probability is still proposed; the
drafting stops AFTER it). Such a length is equivalent to drafting every
later position from the target's own law, so token-level and block
verification stay exact (tests/test_adaptive.py checks both). Dropping the
low-probability token instead would bias the output.

Cost: the draft model runs in a lax.while_loop that ends once every row of
the batch has stopped, so a batch pays max(length) draft calls, not K; the
target still verifies K + 1 positions (static shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.model import ModelDrafter
from spec_decode.decoding.runner import is_int
from spec_decode.decoding.sampling import draw
from spec_decode.decoding.types import Committed, Proposal, Verdict

RULES = ("schedule", "threshold", "tuned")
THRESHOLD_BOUNDS = (0.01, 0.99)  # where the tuned threshold is kept


@flax.struct.dataclass
class AdaptiveState:
  """cache: the draft model's cache.

  limit [B] int32: the schedule's next length (before clipping to [min_length, K]).
  threshold [B] float32: the confidence threshold of each row.
  """
  cache: Any
  limit: jax.Array
  threshold: jax.Array


@registry.drafter("adaptive")
@dataclasses.dataclass(frozen=True)
class AdaptiveDrafter(ModelDrafter):
  """The draft model proposing a per-row number of tokens (rule: see the module doc)."""
  rule: str = "schedule"
  start: int | None = None
  grow: int = 2
  shrink: int = 1
  min_length: int = 1
  threshold: float = 0.4
  step: float = 0.05
  target_full: float = 0.5

  def __post_init__(self):
    if self.rule not in RULES:
      raise ValueError(f"AdaptiveDrafter.rule must be one of {RULES}, got {self.rule!r}")
    if self.start is not None and (not is_int(self.start) or self.start < 1):
      raise ValueError(f"AdaptiveDrafter.start must be an int >= 1 or None, got {self.start!r}")
    for name in ("grow", "shrink", "min_length"):
      if not is_int(getattr(self, name)) or getattr(self, name) < 1:
        raise ValueError(f"AdaptiveDrafter.{name} must be an int >= 1, "
                         f"got {getattr(self, name)!r}")
    if self.start is not None and self.start < self.min_length:
      raise ValueError(f"AdaptiveDrafter.start {self.start} is below min_length "
                       f"{self.min_length}")
    lo, hi = THRESHOLD_BOUNDS
    if not isinstance(self.threshold, (int, float)) or not 0.0 < self.threshold < 1.0:
      raise ValueError(f"AdaptiveDrafter.threshold must be in (0, 1), got {self.threshold!r}")
    if self.rule == "tuned" and not lo <= self.threshold <= hi:
      raise ValueError(f"the tuned threshold starts in [{lo}, {hi}], got {self.threshold}")
    if not isinstance(self.step, (int, float)) or not 0.0 < self.step < 1.0:
      raise ValueError(f"AdaptiveDrafter.step must be in (0, 1), got {self.step!r}")
    if not isinstance(self.target_full, (int, float)) or not 0.0 < self.target_full < 1.0:
      raise ValueError(f"AdaptiveDrafter.target_full must be in (0, 1), "
                       f"got {self.target_full!r}")

  def _check_max(self, num: int) -> None:
    for name in ("start", "min_length"):
      v = getattr(self, name)
      if v is not None and v > num:
        raise ValueError(f"AdaptiveDrafter.{name} {v} exceeds the maximum draft length "
                         f"{num} (Speculative.gamma)")

  def init(self, ctx, room: int) -> AdaptiveState:
    B = ctx.batch_size
    start = self.start if self.start is not None else jnp.iinfo(jnp.int32).max // 2
    return AdaptiveState(cache=ctx.start_cache("draft", room),
                         limit=jnp.full((B,), start, jnp.int32),
                         threshold=jnp.full((B,), self.threshold, jnp.float32))

  def propose(self, ctx, state: AdaptiveState, committed: Committed, keys_BK, num: int):
    self._check_max(num)
    draft, params, sampling = ctx.draft, ctx.draft_params, ctx.sampling
    B = committed.length.shape[0]
    cap = (jnp.clip(state.limit, self.min_length, num) if self.rule == "schedule"
           else jnp.full((B,), num, jnp.int32))
    uses_threshold = self.rule != "schedule"

    def drawn(logits, key_B):
      """(token [B], q [B, V], stop after it [B]) of one draft position."""
      q = sampling.probs(logits)
      x = draw(key_B, q, greedy=sampling.greedy)
      stop = jnp.zeros((B,), bool)
      if uses_threshold:
        own = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1),
                                  x[:, None], axis=1)[:, 0]
        stop = own < state.threshold
      return x, q, stop

    logits, cache = self.first_logits(ctx, state.cache, committed)
    x1, q1, stop1 = drawn(logits, keys_BK[:, 0])
    V = q1.shape[-1]
    xs = jnp.zeros((B, num), jnp.int32).at[:, 0].set(x1)
    qs = jnp.zeros((B, num, V), q1.dtype).at[:, 0].set(q1)
    length = jnp.ones((B,), jnp.int32)
    stopped = stop1 | (cap <= 1)
    cache = ctx.constrain_cache(cache, "draft")

    def cond(carry):
      j, _, _, _, _, stopped = carry
      return (j < num) & ~jnp.all(stopped)

    def body(carry):
      j, cache, xs, qs, length, stopped = carry  # j tokens drafted so far
      prev = jax.lax.dynamic_index_in_dim(xs, j - 1, axis=1, keepdims=False)
      out = draft.decode(params, cache, prev[:, None])
      key_B = jax.lax.dynamic_index_in_dim(keys_BK, j, axis=1, keepdims=False)
      x, q, stop = drawn(out.logits[:, 0], key_B)
      live = ~stopped
      xs = jax.lax.dynamic_update_index_in_dim(xs, jnp.where(live, x, 0), j, axis=1)
      qs = jax.lax.dynamic_update_index_in_dim(qs, jnp.where(live[:, None], q, 0.0), j, axis=1)
      length = jnp.where(live, j + 1, length)
      stopped = stopped | stop | (j + 1 >= cap)
      return j + 1, ctx.constrain_cache(out.cache, "draft"), xs, qs, length, stopped

    _, cache, xs, qs, length, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), cache, xs, qs, length, stopped))
    return Proposal.chain(xs, qs, length=length), state.replace(cache=cache)

  def commit(self, ctx, state: AdaptiveState, committed: Committed, verdict: Verdict,
             proposal: Proposal) -> AdaptiveState:
    length = proposal.proposed
    full = verdict.accepted >= length
    if self.rule == "schedule":
      limit = jnp.where(full, length + self.grow, length - self.shrink)
      return state.replace(limit=jnp.maximum(limit, self.min_length))
    if self.rule == "tuned":
      delta = jnp.where(full, -self.step * (1.0 - self.target_full),
                        self.step * self.target_full)
      return state.replace(threshold=jnp.clip(state.threshold + delta, *THRESHOLD_BOUNDS))
    return state
