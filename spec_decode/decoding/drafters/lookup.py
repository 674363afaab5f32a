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

`LookupTreeDrafter` proposes the continuations of several matches at once, as a tree
(`lookup_tree`) for the tree verifier.

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


def _haystack(source_BS, output_BR, length_B, search_output: bool):
  """(hay [B, H], valid [B, H], end [B, H], m [B]): the tokens searched (the source, then the
  committed output when `search_output`), which of them are real, and for each position the
  end of its segment (the source's real tokens, or the output so far): a continuation never
  runs past it."""
  B, S = source_BS.shape
  R = output_BR.shape[1]
  source_BS = source_BS.astype(jnp.int32)
  output_BR = output_BR.astype(jnp.int32)
  m = length_B.astype(jnp.int32)
  if search_output:
    hay = jnp.concatenate([source_BS, output_BR], axis=1)
    out_pos = jnp.arange(R)[None, :]
    valid = jnp.concatenate([source_BS != PAD_ID, out_pos < m[:, None]], axis=1)
    end_H = jnp.concatenate([jnp.broadcast_to(jnp.sum(source_BS != PAD_ID, axis=1)[:, None],
                                              (B, S)),
                             jnp.broadcast_to(S + m[:, None], (B, R))], axis=1)
  else:
    hay, valid = source_BS, source_BS != PAD_ID
    end_H = jnp.broadcast_to(jnp.sum(valid, axis=1)[:, None], (B, S))
  return hay, valid, end_H, m


def _ngram_matches(hay, valid, end_H, output_BR, m, *, max_ngram: int, min_ngram: int):
  """Yields (n, match [B, H]) for n = min_ngram .. max_ngram: whether the last n committed
  tokens occur at hay positions h .. h + n - 1 (real tokens) with at least one token of the
  same segment after them."""
  H = hay.shape[1]
  R = output_BR.shape[1]
  output_BR = output_BR.astype(jnp.int32)
  pos_H = jnp.arange(H)
  # hay shifted left by t (token h + t at position h) and whether that token is real, for
  # every offset an n-gram reads; shared by all n
  shifted = [jnp.roll(hay, -t, axis=1) for t in range(max_ngram)]
  real = [jnp.roll(valid, -t, axis=1) & (pos_H[None, :] + t < H) for t in range(max_ngram)]
  for n in range(min_ngram, max_ngram + 1):
    # suffix [B, n]: s_{m-n+1} .. s_m (rows with m < n cannot match)
    idx = m[:, None] - n + jnp.arange(n)[None, :]
    suffix = jnp.take_along_axis(output_BR, jnp.clip(idx, 0, R - 1), axis=1)
    match = jnp.ones(hay.shape, bool)
    for t in range(n):
      match &= real[t] & (shifted[t] == suffix[:, t:t + 1])
    start = pos_H[None, :] + n  # the continuation's first position
    yield n, match & (start < end_H) & (m[:, None] >= n)


def lookup(source_BS, output_BR, length_B, *, num: int, max_ngram: int, min_ngram: int = 1,
           search_output: bool = True):
  """The continuation of each row's last n output tokens in its source (see the module doc).

  source_BS [B, S] int: encoder tokens, PAD_ID = padding. output_BR [B, R] int: the
  committed tokens s_1 .. (junk past length_B [B]). Returns (tokens [B, num] int32, junk
  past each length; length [B] int32 in 0 .. num; ngram [B] int32, the n that matched,
  0 for none).
  """
  hay, valid, end_H, m = _haystack(source_BS, output_BR, length_B, search_output)
  B, H = hay.shape
  best_start = jnp.zeros((B,), jnp.int32)  # where the continuation starts in hay
  best_n = jnp.zeros((B,), jnp.int32)
  for n, match in _ngram_matches(hay, valid, end_H, output_BR, m, max_ngram=max_ngram,
                                 min_ngram=min_ngram):  # longer n overwrite shorter ones
    found = jnp.any(match, axis=1)
    first = jnp.argmax(match, axis=1).astype(jnp.int32)
    best_start = jnp.where(found, first + n, best_start)
    best_n = jnp.where(found, n, best_n)
  take = jnp.clip(best_start[:, None] + jnp.arange(num)[None, :], 0, H - 1)
  tokens = jnp.take_along_axis(hay, take, axis=1)
  segment_end = jnp.take_along_axis(end_H, jnp.clip(best_start, 0, H - 1)[:, None], axis=1)[:, 0]
  length = jnp.where(best_n > 0, jnp.clip(segment_end - best_start, 0, num), 0)
  return tokens, length.astype(jnp.int32), best_n


def lookup_tree(source_BS, output_BR, length_B, *, width: int, depth: int, max_ngram: int,
                min_ngram: int = 1, search_output: bool = True):
  """Up to `width` different continuations of each row's output in its source, as a tree.

  Every position c of the haystack that follows an occurrence of the output's last n tokens
  (n = max_ngram .. min_ngram) is a candidate; candidates rank by their longest n, then
  by position (the first is `lookup`'s chain). Branch w is the `depth` tokens (fewer at
  the end of its segment) after the best candidate whose continuation differs from those
  of branches 0 .. w - 1. Branches that share a prefix share its nodes (a trie), so a
  node's children carry different tokens.

  Returns (tokens [B, K] int32, parent [B, K] int32, ngram [B, width] int32), K = width x
  depth: the nodes in parents-first order, the real ones first (row b holds
  sum(parent[b] >= -1) of them), parent -1 for a child of the last committed token and -2
  for padding; ngram: each branch's n, 0 where no candidate was left.
  """
  hay, valid, end_H, m = _haystack(source_BS, output_BR, length_B, search_output)
  B, H = hay.shape
  W, D = width, depth
  n_at = jnp.zeros((B, H), jnp.int32)  # per continuation start: the longest n matching
  for n, match in _ngram_matches(hay, valid, end_H, output_BR, m, max_ngram=max_ngram,
                                 min_ngram=min_ngram):
    starts = jnp.pad(match, ((0, 0), (n, 0)))[:, :H]  # match at h -> start h + n
    n_at = jnp.where(starts, n, n_at)
  pos_H = jnp.arange(H)
  at = pos_H[None, :, None] + jnp.arange(D)[None, None, :]  # [1, H, D]
  inside = at < end_H[:, :, None]  # within the start's segment (a start's own segment)
  cont = jnp.where(inside, hay[:, jnp.clip(at[0], 0, H - 1)], -1)  # [B, H, D]
  score = jnp.where(n_at > 0, n_at * (H + 1) + (H - pos_H)[None, :], -1)
  branches, ngrams = [], []
  for _ in range(W):
    best = jnp.argmax(score, axis=1)
    found = jnp.take_along_axis(score, best[:, None], axis=1)[:, 0] > 0
    branch = jnp.where(found[:, None], jnp.take_along_axis(cont, best[:, None, None],
                                                           axis=1)[:, 0], -1)  # [B, D]
    branches.append(branch)
    ngrams.append(jnp.where(found, jnp.take_along_axis(n_at, best[:, None], axis=1)[:, 0], 0))
    same = jnp.all(cont == branch[:, None, :], axis=2)  # that continuation is taken
    score = jnp.where(same, -1, score)
  tok = jnp.stack(branches, axis=1)  # [B, W, D], -1 past a branch's end
  real_BWD = tok >= 0
  # prefix[b, w, v, d]: branches w and v hold the same real tokens 0 .. d
  eq = (tok[:, :, None, :] == tok[:, None, :, :]) & real_BWD[:, :, None, :]
  prefix = jnp.cumprod(eq.astype(jnp.int32), axis=3) > 0
  lower = jnp.tril(jnp.ones((W, W), bool))[None, :, :, None]  # v <= w
  canon = jnp.argmax(prefix & lower, axis=2).astype(jnp.int32)  # [B, W, D] first such v
  own = real_BWD & (canon == jnp.arange(W)[None, :, None])  # a node of its own
  d_ = jnp.arange(D)[None, None, :]
  prev = jnp.concatenate([jnp.zeros((B, W, 1), jnp.int32), canon[:, :, :-1]], axis=2)
  parent = jnp.where(d_ == 0, -1, (d_ - 1) * W + prev)  # depth-major node index d W + w
  flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(B, D * W)  # node d W + w
  tok, parent, own = flat(tok), flat(parent), flat(own)
  # the real nodes first, in order (so parents still precede their children)
  order = jnp.argsort(~own, axis=1, stable=True)
  rank = jnp.cumsum(own, axis=1) - 1  # a real node's new index
  parent = jnp.where(parent >= 0, jnp.take_along_axis(rank, jnp.maximum(parent, 0), axis=1),
                     parent)
  parent = jnp.where(own, parent, -2)
  tok = jnp.where(own, tok, PAD_ID)
  return (jnp.take_along_axis(tok, order, axis=1).astype(jnp.int32),
          jnp.take_along_axis(parent, order, axis=1).astype(jnp.int32),
          jnp.stack(ngrams, axis=1).astype(jnp.int32))


def _is_count(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_search(drafter, *counts: str) -> None:
  """Raises ValueError naming the drafter's class unless its n-gram sizes (and the other
  fields `counts`) are ints >= 1, min_ngram <= max_ngram and search_output a bool."""
  what = type(drafter).__name__
  for name in counts + ("max_ngram", "min_ngram"):
    v = getattr(drafter, name)
    if not _is_count(v):
      raise ValueError(f"{what}.{name} must be an int >= 1, got {v!r}")
  if drafter.min_ngram > drafter.max_ngram:
    raise ValueError(f"{what}: min_ngram {drafter.min_ngram} > max_ngram {drafter.max_ngram}")
  if not isinstance(drafter.search_output, bool):
    raise ValueError(f"{what}.search_output must be True or False, got "
                     f"{drafter.search_output!r}")


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
    _check_search(self)
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


@registry.drafter("lookup_tree")
@dataclasses.dataclass(frozen=True)
class LookupTreeDrafter(Drafter):
  """Source lookup with several candidate matches at once: a tree of up to `width`
  different continuations (`lookup_tree`), for the tree verifier (`TreeVerifier`,
  SpecExec's rule: exact for any deterministic tree). Where one match's continuation is
  wrong, another's may be right (a name that occurs twice in an article, followed by
  different words).

  width: branches; depth: tokens per branch (None: gamma), so a proposal holds at most
  width x depth nodes; max_ngram / min_ngram / search_output: as `LookupDrafter`. A row
  with no match proposes nothing; with `Speculative.trim_verify` the verify call scores only
  as many nodes as the row with the most (`verify_sizes`).
  """
  width: int = 2
  depth: int | None = None
  max_ngram: int = 3
  min_ngram: int = 1
  search_output: bool = True

  needs_draft_model = False
  proposes_trees = True
  varies_length = True

  def __post_init__(self):
    _check_search(self, "width")
    d = self.depth
    if d is not None and not _is_count(d):
      raise ValueError(f"LookupTreeDrafter.depth must be None or an int >= 1, got {d!r}")

  def proposal_size(self, gamma: int) -> int:
    return self.width * (self.depth or gamma)

  def init(self, ctx, room: int):
    return jnp.zeros((ctx.batch_size,), jnp.int32)  # stateless; a placeholder carry

  def propose(self, ctx, state, committed: Committed, keys, num: int):
    tokens, parent, _ = lookup_tree(ctx.encoder_tokens, committed.tokens, committed.length,
                                    width=self.width, depth=self.depth or num,
                                    max_ngram=self.max_ngram, min_ngram=self.min_ngram,
                                    search_output=self.search_output)
    return Proposal(tokens=tokens, q=None, parent=parent), state

  def expected_tokens(self, *, alpha, gamma, counters=None):
    """None: a tree's yield is not Thm 3.8's (its tokens per call are measured)."""
    return None
