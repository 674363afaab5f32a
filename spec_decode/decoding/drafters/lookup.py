"""Source lookup: no draft model; propose what followed the output's latest n-gram where it
occurs in the row's encoder input (or earlier in the row's own output).

Prompt lookup decoding for an encoder-decoder: a summary copies spans of its article, a
translation copies names and numbers, so the continuation of the last n output tokens
in the source is often the target's own continuation. Per row, inside the jit, in static
shapes: for n = max_ngram .. min_ngram, the first position of the haystack (the encoder
input's real tokens, then the committed output) where the last n committed tokens occur
with at least one token after them; the longest n that matches wins, and its following
tokens (up to `num`, never past the end of the source or of the committed output) are the
proposal. A row with no match proposes nothing (its verify call is a plain target step).

The draft is deterministic (a point mass at each proposed token, `Proposal.q` None), so
any verifier that accepts point-mass chains keeps the target's distribution exactly: the
chain verifier accepts token x with probability p(x) and otherwise draws from p without
x, block verification likewise, and greedy verification keeps the target's argmax.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp

from spec_decode.decoding import registry
from spec_decode.decoding.drafters.base import Drafter
from spec_decode.decoding.drafters.model import ModelDrafter
from spec_decode.decoding.types import Committed, Proposal
from spec_decode.models.base import PAD_ID


def lookup(source_BS, output_BR, length_B, *, num: int, max_ngram: int, min_ngram: int = 1,
           search_output: bool = True):
  """The continuation of each row's last n output tokens in its source (see the module doc).

  source_BS [B, S] int: encoder tokens, PAD_ID = padding. output_BR [B, R] int: the
  committed tokens s_1 .. (junk past length_B [B]). Returns (tokens [B, num] int32, junk
  past each length; length [B] int32 in 0 .. num; ngram [B] int32, the n that matched,
  0 for none).
  """
  B, S = source_BS.shape
  R = output_BR.shape[1]
  source_BS = source_BS.astype(jnp.int32)
  output_BR = output_BR.astype(jnp.int32)
  m = length_B.astype(jnp.int32)
  if search_output:
    hay = jnp.concatenate([source_BS, output_BR], axis=1)  # [B, H]
    out_pos = jnp.arange(R)[None, :]
    valid = jnp.concatenate([source_BS != PAD_ID, out_pos < m[:, None]], axis=1)
    # a continuation may run to the end of the source's real tokens, or of the output
    end_H = jnp.concatenate([jnp.broadcast_to(jnp.sum(source_BS != PAD_ID, axis=1)[:, None],
                                              (B, S)),
                             jnp.broadcast_to(S + m[:, None], (B, R))], axis=1)
  else:
    hay, valid = source_BS, source_BS != PAD_ID
    end_H = jnp.broadcast_to(jnp.sum(valid, axis=1)[:, None], (B, S))
  H = hay.shape[1]
  pos_H = jnp.arange(H)
  best_start = jnp.zeros((B,), jnp.int32)  # where the continuation starts in hay
  best_n = jnp.zeros((B,), jnp.int32)
  # hay shifted left by t (token h + t at position h) and whether that token is real, for
  # every offset an n-gram reads; shared by all n
  shifted = [jnp.roll(hay, -t, axis=1) for t in range(max_ngram)]
  real = [jnp.roll(valid, -t, axis=1) & (pos_H[None, :] + t < H) for t in range(max_ngram)]
  for n in range(min_ngram, max_ngram + 1):  # longer n overwrite shorter ones
    # suffix [B, n]: s_{m-n+1} .. s_m (rows with m < n cannot match)
    idx = m[:, None] - n + jnp.arange(n)[None, :]
    suffix = jnp.take_along_axis(output_BR, jnp.clip(idx, 0, R - 1), axis=1)
    match = jnp.ones((B, H), bool)
    for t in range(n):
      match &= real[t] & (shifted[t] == suffix[:, t:t + 1])
    start = pos_H[None, :] + n  # the continuation's first position
    # at least one token after the match, within the same segment (source or output)
    match &= (start < end_H) & (m[:, None] >= n)
    found = jnp.any(match, axis=1)
    first = jnp.argmax(match, axis=1).astype(jnp.int32)
    best_start = jnp.where(found, first + n, best_start)
    best_n = jnp.where(found, n, best_n)
  take = jnp.clip(best_start[:, None] + jnp.arange(num)[None, :], 0, H - 1)
  tokens = jnp.take_along_axis(hay, take, axis=1)
  segment_end = jnp.take_along_axis(end_H, jnp.clip(best_start, 0, H - 1)[:, None], axis=1)[:, 0]
  length = jnp.where(best_n > 0, jnp.clip(segment_end - best_start, 0, num), 0)
  return tokens, length.astype(jnp.int32), best_n


@registry.drafter("lookup")
@dataclasses.dataclass(frozen=True)
class LookupDrafter(Drafter):
  """Proposes up to gamma tokens by source lookup (module doc); needs no draft model.

  max_ngram / min_ngram: the n-gram sizes tried, longest first. search_output: also look
  in the row's own committed output (after its source). tokens_per_ngram: the most tokens
  proposed after a match of n tokens (entry n - 1; the last entry for longer n), e.g.
  (2, 4) proposes at most 2 tokens after a single-token match, whose continuation is
  the least likely to be right; None: gamma after any match. fallback: what a row with no
  match proposes: None (default) proposes nothing (the verify call is a plain target
  step), `ModelDrafter()` (the draft model: a small T5, an n-gram table) or
  `LayerSkipDrafter()` (the target's first layers). The fallback then runs every
  iteration for every row (static shapes), fed the lookup's tokens in the rows that
  matched (`ModelDrafter.propose(forced=...)`), so its cache holds what every row commits.
  """
  max_ngram: int = 3
  min_ngram: int = 1
  search_output: bool = True
  tokens_per_ngram: tuple[int, ...] | None = None
  fallback: Drafter | None = None

  varies_length = True

  def __post_init__(self):
    for name in ("max_ngram", "min_ngram"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"LookupDrafter.{name} must be an int >= 1, got {v!r}")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"LookupDrafter: min_ngram {self.min_ngram} > max_ngram "
                       f"{self.max_ngram}")
    if not isinstance(self.search_output, bool):
      raise ValueError(f"LookupDrafter.search_output must be True or False, got "
                       f"{self.search_output!r}")
    t = self.tokens_per_ngram
    if t is not None:
      if isinstance(t, list):
        t = tuple(t)
        object.__setattr__(self, "tokens_per_ngram", t)
      if (not isinstance(t, tuple) or not t
          or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in t)):
        raise ValueError(f"LookupDrafter.tokens_per_ngram must be None or a non-empty tuple "
                         f"of ints >= 0, got {t!r}")
    fb = self.fallback
    if fb is not None:
      if not isinstance(fb, Drafter):
        raise ValueError(f"LookupDrafter.fallback must be a Drafter or None, got "
                         f"{type(fb).__name__}")
      if (not isinstance(fb, ModelDrafter)
          or "forced" not in inspect.signature(type(fb).propose).parameters):
        raise ValueError(f"LookupDrafter.fallback must be None, ModelDrafter() (the draft "
                         f"model) or LayerSkipDrafter() (the target's first layers), got "
                         f"{type(fb).__name__}")

  @property
  def needs_draft_model(self) -> bool:  # overrides the class attribute
    return self.fallback is not None and self.fallback.needs_draft_model

  def check_models(self, target, draft) -> None:
    if self.fallback is not None:
      self.fallback.check_models(target, draft)

  def target_layers(self, draft) -> tuple[int, ...]:
    return () if self.fallback is None else self.fallback.target_layers(draft)

  def init(self, ctx, room: int):
    if self.fallback is not None:
      return self.fallback.init(ctx, room)
    return jnp.zeros((ctx.batch_size,), jnp.int32)  # stateless; a placeholder carry

  def propose(self, ctx, state, committed: Committed, keys, num: int):
    tokens, length, ngram = lookup(ctx.encoder_tokens, committed.tokens, committed.length,
                                   num=num, max_ngram=self.max_ngram,
                                   min_ngram=self.min_ngram, search_output=self.search_output)
    if self.tokens_per_ngram is not None:
      caps = self.tokens_per_ngram
      cap = jnp.asarray([0] + [caps[min(n, len(caps)) - 1]
                               for n in range(1, self.max_ngram + 1)], jnp.int32)[ngram]
      length = jnp.minimum(length, cap)
    if self.fallback is None:
      return Proposal.chain(tokens, None, length), state
    found = length > 0  # these rows take the lookup, the others the draft model's chain
    other, state = self.fallback.propose(ctx, state, committed, keys, num,
                                         forced=(tokens, found))
    return Proposal.chain(other.tokens, other.q, jnp.where(found, length, num)), state

  def commit(self, ctx, state, committed: Committed, verdict, proposal: Proposal):
    if self.fallback is None:
      return state
    return self.fallback.commit(ctx, state, committed, verdict, proposal)

  def expected_tokens(self, *, alpha: float, gamma: int, counters=None) -> float | None:
    """Thm 3.8 at the mean proposed length (`draft_tokens / target_calls` of the run's
    counters; gamma without them): a lookup proposes fewer than gamma tokens, often none."""
    if not counters or float(counters.get("target_calls", 0)) <= 0:
      return super().expected_tokens(alpha=alpha, gamma=gamma, counters=counters)
    mean = float(counters["draft_tokens"]) / float(counters["target_calls"])
    if alpha >= 1.0:
      return 1.0 + mean
    return float((1.0 - alpha ** (mean + 1.0)) / (1.0 - alpha))
