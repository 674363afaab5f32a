"""Test doubles and exact oracles shared by tests and experiments.

* `MarkovDecoder`: a `Decoder` whose next-token logits are a table lookup on
  the last `order` tokens fed, plus a per-example bias derived from the encoder
  input. Its distributions are exact (no rounding differences between batch
  shapes or chunk sizes) and its cache keeps the full token history, so a
  rewind followed by a re-feed is checked for real.
* `sequence_distribution`: the exact distribution of whole output sequences of
  any `Decoder` (T5 included) under a `Sampling`, by enumerating every prefix.
* `chi_square`: Pearson's goodness of fit of sampled sequences to those exact
  distributions, with small bins merged.

Axis letters: B batch, S source length, T tokens in a call, L cache length, V vocab.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Hashable, Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.models import base
from spec_decode.models.base import BOS_ID, EOS_ID, check_tokens as _check_tokens


@flax.struct.dataclass
class MarkovCache(base.LengthCache):
  """history [B, L] int32: tokens fed so far (junk at positions >= a row's length).

  bias [B, V] float32: the per-example logit bias from `encode`.
  lengths [B] int32: tokens consumed per row.
  """
  history: jax.Array
  bias: jax.Array
  lengths: jax.Array

  POSITION_FIELDS = ("history",)

  @property
  def max_length(self) -> int:
    return self.history.shape[1]

  def logical_axes(self) -> "MarkovCache":
    """Logical axes per field, for `partitioning.constrain_cache` under a mesh."""
    return self.replace(history=("batch", "length"), bias=("batch", None),
                        lengths=("batch",))


@dataclasses.dataclass(frozen=True)
class MarkovDecoder:
  """An order-`order` Markov chain over `vocab_size` tokens, conditioned on the source.

  params: {"table": [V] * order + [V] logits, "source": [V, V]}. The logits
  after feeding token s_t (position t, s_0 = BOS) are
    table[s_{t-order+1}, ..., s_t] + mean over non-PAD source tokens w of source[w],
  with tokens before position 0 read as BOS. Hashable: only static config.
  """
  vocab_size: int
  order: int = 1

  def __post_init__(self):
    for name in ("vocab_size", "order"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"MarkovDecoder.{name} must be a positive int, got {v!r}")
    if self.vocab_size < 2:
      raise ValueError(f"MarkovDecoder.vocab_size must be >= 2 (PAD/BOS and EOS), "
                       f"got {self.vocab_size}")

  def init(self, rng: jax.Array, *, scale: float = 1.0, source_scale: float = 1.0) -> dict:
    """Random params: table ~ N(0, scale^2), source ~ N(0, source_scale^2)."""
    V = self.vocab_size
    k_table, k_source = jax.random.split(rng)
    return {"table": scale * jax.random.normal(k_table, (V,) * (self.order + 1), jnp.float32),
            "source": source_scale * jax.random.normal(k_source, (V, V), jnp.float32)}

  def _check_params(self, params) -> None:
    V, want = self.vocab_size, (self.vocab_size,) * (self.order + 1)
    if tuple(params["table"].shape) != want or tuple(params["source"].shape) != (V, V):
      raise ValueError(f"MarkovDecoder params must have table {want} and source {(V, V)}, "
                       f"got {tuple(params['table'].shape)} and "
                       f"{tuple(params['source'].shape)}")

  def encode(self, params, encoder_tokens) -> jax.Array:
    """bias [B, V]: mean of source[w] over the non-PAD tokens w of each row (0 if none)."""
    self._check_params(params)
    encoder_tokens = _check_tokens(encoder_tokens, "encoder_tokens", self.vocab_size)
    return self._encode(params, encoder_tokens)

  @functools.partial(jax.jit, static_argnums=0)
  def _encode(self, params, encoder_tokens):
    mask_BS = (encoder_tokens != 0).astype(jnp.float32)
    rows_BSV = jnp.take(params["source"], encoder_tokens, axis=0)
    total_BV = jnp.einsum("BS,BSV->BV", mask_BS, rows_BSV)
    return total_BV / jnp.maximum(jnp.sum(mask_BS, axis=1, keepdims=True), 1.0)

  def init_cache(self, params, encoded: jax.Array, max_decode_len: int) -> MarkovCache:
    if not isinstance(max_decode_len, (int, np.integer)) or max_decode_len < 1:
      raise ValueError(f"max_decode_len must be a positive int, got {max_decode_len!r}")
    B = encoded.shape[0]
    return MarkovCache(history=jnp.zeros((B, int(max_decode_len)), jnp.int32),
                       bias=jnp.asarray(encoded, jnp.float32),
                       lengths=jnp.zeros((B,), jnp.int32))

  def decode(self, params, cache: MarkovCache, tokens, *, positions=None,
             tree_mask=None) -> base.DecodeOutput:
    """Appends tokens [B, T] at each row's length; logits [B, T, V] float32, no hidden states.

    With a `tree_mask` [B, T, T] (ancestor-or-self among the new tokens) a
    token's context is its own ancestors, then the cached prefix: the k-th
    token back from new token t is the ancestor whose depth (number of
    ancestors) is depth(t) - k, or the cached token at slot lengths + depth(t)
    - k once that falls before the new tokens. `positions` carry no
    information for a Markov chain beyond the mask and are only validated.
    """
    self._check_params(params)
    tokens = _check_tokens(tokens, "tokens", self.vocab_size)
    _, tree_mask = base.check_tree_args(tokens, positions, tree_mask)
    cache.check_append(tokens)
    return self._decode(params, cache, tokens, tree_mask)

  @functools.partial(jax.jit, static_argnums=0)
  def _decode(self, params, cache: MarkovCache, tokens_BT, tree_mask=None):
    B, T = tokens_BT.shape
    offsets_B = cache.lengths
    write = lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,))
    history = jax.vmap(write)(cache.history, tokens_BT, offsets_B)
    if tree_mask is None:
      tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    depth_BT = jnp.sum(tree_mask, axis=2) - 1  # ancestors of each new token
    context = []
    for back in range(self.order - 1, -1, -1):  # oldest context token first
      want_BT = depth_BT - back
      # the ancestor of t at depth want (exactly one when want >= 0)
      is_it_BTJ = tree_mask & (depth_BT[:, None, :] == want_BT[:, :, None])
      from_tree = jnp.sum(jnp.where(is_it_BTJ, tokens_BT[:, None, :], 0), axis=2)
      at = offsets_B[:, None] + want_BT  # cached slot once want < 0
      from_cache = jnp.take_along_axis(history, jnp.maximum(at, 0), axis=1)
      tok = jnp.where(want_BT >= 0, from_tree, jnp.where(at >= 0, from_cache, BOS_ID))
      context.append(tok)
    logits_BTV = params["table"][tuple(context)] + cache.bias[:, None, :]
    return base.DecodeOutput(logits=logits_BTV.astype(jnp.float32),
                             cache=cache.replace(history=history, lengths=offsets_B + T))

  def forward(self, params, encoder_tokens, decoder_input_tokens) -> jax.Array:
    """Teacher-forced logits [B, T, V] (decoder inputs start with BOS), like T5.forward."""
    decoder_input_tokens = _check_tokens(decoder_input_tokens, "decoder_input_tokens",
                                         self.vocab_size)
    cache = self.init_cache(params, self.encode(params, encoder_tokens),
                            decoder_input_tokens.shape[1])
    return self.decode(params, cache, decoder_input_tokens).logits


def perturbed(params: Any, seed: int, scale: float) -> Any:
  """params + scale * N(0, 1) noise on every floating leaf: a draft close to a target.

  The noise comes from numpy (seeded), which costs no XLA compilation.
  """
  rs = np.random.RandomState(seed)

  def add_noise(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    noisy = np.asarray(x, np.float32) + scale * rs.normal(size=x.shape)
    return jnp.asarray(noisy.astype(np.float32), x.dtype)

  return jax.tree_util.tree_map(add_noise, params)


def sequences(result) -> list[tuple[int, ...]]:
  """The output of each row of a DecodeResult as a tuple of tokens (its EOS included)."""
  tokens, lengths = np.asarray(result.tokens).tolist(), np.asarray(result.lengths).tolist()
  return [tuple(row[:n]) for row, n in zip(tokens, lengths)]


def sequence_distribution(model, params, encoder_tokens, *, max_decode_len: int,
                          sampling,
                          max_prefixes: int = 100_000) -> list[dict[tuple[int, ...], float]]:
  """Exact law of the output of each row under `sampling`, by enumeration.

  A sequence ends at EOS (included) or after `max_decode_len` = L tokens, as
  in the decoders. Every token string x_1..x_{L-1} is teacher-forced as
  [BOS, x_1..x_{L-1}] through `model.encode / init_cache / decode` in one
  batched call; by causality the logits at position t are those after the
  prefix x_1..x_t, and `sampling.probs` of them is the next-token law. Returns,
  per row, {sequence: probability} over the sequences of positive probability
  (products in float64 of the float32 adjusted probabilities, renormalized per
  step). Only for small vocabularies: raises ValueError when V^(L-1) exceeds
  `max_prefixes`.
  """
  if not isinstance(max_decode_len, (int, np.integer)) or max_decode_len < 1:
    raise ValueError(f"max_decode_len must be a positive int, got {max_decode_len!r}")
  encoder_tokens = np.asarray(_check_tokens(encoder_tokens, "encoder_tokens",
                                            model.vocab_size))
  V, L = model.vocab_size, int(max_decode_len)
  N = V ** (L - 1)
  if N > max_prefixes:
    raise ValueError(f"enumerating {V}^{L - 1} = {N} prefixes exceeds max_prefixes="
                     f"{max_prefixes}")
  strings = np.array(np.meshgrid(*[np.arange(V)] * (L - 1), indexing="ij"),
                     np.int32).reshape(L - 1, N).T  # row i: i written in base V
  inputs = np.concatenate([np.full((N, 1), BOS_ID, np.int32), strings], axis=1)
  B = encoder_tokens.shape[0]
  encoded = model.encode(params, np.repeat(encoder_tokens, N, axis=0))
  cache = model.init_cache(params, encoded, L)
  logits = model.decode(params, cache, np.tile(inputs, (B, 1))).logits
  probs = np.asarray(sampling.probs(logits), np.float64).reshape(B, N, L, V)
  probs /= probs.sum(axis=-1, keepdims=True)
  out = []
  for row in probs:
    law: dict[tuple[int, ...], float] = {}
    stack = [((), 1.0, 0)]  # (prefix, its probability, index of a string extending it)
    while stack:
      prefix, weight, index = stack.pop()
      t = len(prefix)
      for tok in np.flatnonzero(row[index, t] > 0):
        seq, w = prefix + (int(tok),), weight * row[index, t, tok]
        if tok == EOS_ID or t + 1 == L:
          law[seq] = w
        else:
          stack.append((seq, w, index + int(tok) * V ** (L - 2 - t)))
    out.append(law)
  return out


@dataclasses.dataclass(frozen=True)
class GoodnessOfFit:
  """Pearson chi-square of samples against exact laws (several groups summed).

  statistic, dof, p_value: of the merged-bin test; samples: total count;
  impossible: samples of probability 0 (any makes p_value 0); tv: total
  variation between empirical and exact laws, averaged over groups.
  """
  statistic: float
  dof: int
  p_value: float
  samples: int
  impossible: int
  tv: float


def chi_square(samples: Sequence[Sequence[Hashable]],
               laws: Sequence[Mapping[Hashable, float]], *,
               min_expected: float = 5.0) -> GoodnessOfFit:
  """Tests samples[g] ~ laws[g] for every group g (e.g. one group per encoder input).

  Within a group, outcomes whose expected count is below `min_expected` are
  pooled into one bin (which absorbs the next smallest bins while still below it);
  the statistics of the groups are summed, with dof = sum of (bins - 1).
  """
  if len(samples) != len(laws) or not samples:
    raise ValueError(f"need one law per sample group, got {len(samples)} groups of samples "
                     f"and {len(laws)} laws")
  stat, dof, total, impossible, tvs = 0.0, 0, 0, 0, []
  for group, law in zip(samples, laws):
    n = len(group)
    if n == 0:
      raise ValueError("every sample group must be non-empty")
    counts = collections.Counter(group)
    impossible += sum(c for k, c in counts.items() if law.get(k, 0.0) <= 0.0)
    keys = sorted((k for k in law if law[k] > 0), key=lambda k: law[k])
    expected = np.array([n * law[k] for k in keys])
    observed = np.array([counts.get(k, 0) for k in keys], np.float64)
    tvs.append(0.5 * (np.abs(observed / n - expected / n).sum()
                      + sum(c for k, c in counts.items() if law.get(k, 0.0) <= 0.0) / n))
    cut = int(np.sum(expected < min_expected))  # small bins: a prefix, sorted ascending
    while 0 < cut < len(keys) and expected[:cut].sum() < min_expected:
      cut += 1  # the pool absorbs the next smallest bins until it is large enough
    pool = lambda x: np.concatenate([[x[:cut].sum()], x[cut:]]) if cut else x
    bins_e, bins_o = pool(expected), pool(observed)
    stat += float(np.sum((bins_o - bins_e) ** 2 / bins_e))
    dof += len(bins_e) - 1
    total += n
  import scipy.stats  # pylint: disable=g-import-not-at-top  (scipy is a test extra)
  p = 0.0 if impossible else float(scipy.stats.chi2.sf(stat, dof)) if dof > 0 else 1.0
  return GoodnessOfFit(statistic=stat, dof=dof, p_value=p, samples=total,
                       impossible=impossible, tv=float(np.mean(tvs)))
