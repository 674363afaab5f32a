"""Unigram and bigram drafters: the paper's Table 3 baselines, as `Decoder`s.

An n-gram draft is unconditional (it ignores the encoder input) and costs a
table lookup per token. params = {"log_probs": [V] (unigram) or [V, V] (bigram,
row = previous token)}; the logits after feeding token s_t are log_probs
(unigram) or log_probs[s_t] (bigram), so the logits of a position depend only
on the token fed there and a rewind only needs to move the per-row length.

`fit` turns token sequences (a task's targets, or a target model's samples)
into maximum-likelihood tables: probabilities equal counts
divided by totals, plus optional add-`smoothing`. A bigram row whose previous
token was never seen backs off to the unigram law. Zero probabilities are
stored as `LOG_ZERO` (finite, so softmax never produces NaN).

Axis letters: B batch, T tokens in a call, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from spec_decode.models import base
from spec_decode.models.base import BOS_ID, EOS_ID, check_tokens as _check_tokens

LOG_ZERO = -1e9


@flax.struct.dataclass
class NGramCache(base.LengthCache):
  """lengths [B] int32: tokens consumed per row. No history is needed (see module doc)."""
  lengths: jax.Array
  max_len: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def max_length(self) -> int:
    return self.max_len

  def logical_axes(self) -> "NGramCache":
    return self.replace(lengths=("batch",))


@dataclasses.dataclass(frozen=True)
class NGramDecoder:
  """An unconditional n-gram model (order 1 or 2). Hashable: only static config."""
  vocab_size: int
  order: int = 2

  def __post_init__(self):
    if not isinstance(self.vocab_size, (int, np.integer)) or isinstance(self.vocab_size, bool) \
        or self.vocab_size < 2:
      raise ValueError(f"NGramDecoder.vocab_size must be an int >= 2, got {self.vocab_size!r}")
    if self.order not in (1, 2):
      raise ValueError(f"NGramDecoder.order must be 1 (unigram) or 2 (bigram), "
                       f"got {self.order!r}")

  @property
  def table_shape(self) -> tuple[int, ...]:
    return (self.vocab_size,) * self.order

  def _check_params(self, params) -> None:
    shape = getattr(params.get("log_probs") if isinstance(params, dict) else None, "shape", None)
    if shape != self.table_shape:
      raise ValueError(f"n-gram params must be {{'log_probs': array of shape "
                       f"{self.table_shape}}}, got {shape}")

  def logical_axes(self) -> dict:
    return {"log_probs": ("vocab",) * self.order}

  def param_shapes(self) -> dict:
    return {"log_probs": jax.ShapeDtypeStruct(self.table_shape, jnp.float32)}

  def num_params(self) -> int:
    return int(np.prod(self.table_shape))

  def encode(self, params, encoder_tokens) -> jax.Array:
    """Ignores the input (the draft is unconditional); returns the source lengths [B]."""
    encoder_tokens = _check_tokens(encoder_tokens, "encoder_tokens", self.vocab_size)
    return jnp.sum(encoder_tokens > 0, axis=1).astype(jnp.int32)

  def init_cache(self, params, encoded: jax.Array, max_decode_len: int) -> NGramCache:
    if not isinstance(max_decode_len, (int, np.integer)) or max_decode_len < 1:
      raise ValueError(f"max_decode_len must be a positive int, got {max_decode_len!r}")
    return NGramCache(lengths=jnp.zeros(encoded.shape[:1], jnp.int32),
                      max_len=int(max_decode_len))

  def decode(self, params, cache: NGramCache, tokens, *, positions=None,
             tree_mask=None) -> base.DecodeOutput:
    """Appends tokens [B, T]; logits [B, T, V] float32 (log-probabilities), no hidden states.

    The logits of a position depend only on the token fed there, so positions
    and a tree mask (validated) change nothing.
    """
    self._check_params(params)
    tokens = _check_tokens(tokens, "tokens", self.vocab_size)
    base.check_tree_args(tokens, positions, tree_mask)
    cache.check_append(tokens)
    return self._decode(params, cache, tokens)

  @functools.partial(jax.jit, static_argnums=0)
  def _decode(self, params, cache: NGramCache, tokens_BT):
    table = params["log_probs"].astype(jnp.float32)
    if self.order == 1:
      logits = jnp.broadcast_to(table, tokens_BT.shape + (self.vocab_size,))
    else:
      logits = jnp.take(table, tokens_BT, axis=0)
    return base.DecodeOutput(logits=logits,
                             cache=cache.replace(lengths=cache.lengths + tokens_BT.shape[1]))

  def forward(self, params, encoder_tokens, decoder_input_tokens) -> jax.Array:
    """Teacher-forced logits [B, T, V] (decoder inputs start with BOS)."""
    encoded = self.encode(params, encoder_tokens)
    cache = self.init_cache(params, encoded, int(np.shape(decoder_input_tokens)[1]))
    return self.decode(params, cache, decoder_input_tokens).logits


def counts(sequences: Iterable[Sequence[int]], *, order: int, vocab_size: int) -> np.ndarray:
  """n-gram counts of sequences (each read as BOS, s_1, .., s_n; cut after its first EOS).

  Unigram: counts[x] = occurrences of x among s_1..s_n. Bigram: counts[a, b] =
  occurrences of b right after a, with BOS before s_1.
  """
  if order not in (1, 2):
    raise ValueError(f"order must be 1 or 2, got {order!r}")
  table = np.zeros((vocab_size,) * order, np.float64)
  for seq in sequences:
    seq = [int(t) for t in seq]
    if EOS_ID in seq:
      seq = seq[:seq.index(EOS_ID) + 1]
    if any(t < 0 or t >= vocab_size for t in seq):
      raise ValueError(f"token ids must be in [0, {vocab_size}), got {seq}")
    if order == 1:
      np.add.at(table, seq, 1.0)
    else:
      prev = [BOS_ID] + seq[:-1]
      np.add.at(table, (prev, seq), 1.0)
  return table


def fit(sequences: Iterable[Sequence[int]], *, order: int, vocab_size: int,
        smoothing: float = 0.0) -> dict:
  """Maximum-likelihood (add-`smoothing`) n-gram params from token sequences."""
  if smoothing < 0:
    raise ValueError(f"smoothing must be >= 0, got {smoothing}")
  sequences = list(sequences)
  c = counts(sequences, order=order, vocab_size=vocab_size) + smoothing
  if order == 2:
    unigram = counts(sequences, order=1, vocab_size=vocab_size) + smoothing
    unseen = c.sum(axis=1) == 0
    c[unseen] = unigram
  total = c.sum(axis=-1, keepdims=True)
  if np.any(total == 0):
    raise ValueError("cannot fit an n-gram model on no tokens (and no smoothing)")
  probs = c / total
  logp = np.where(probs > 0, np.log(np.where(probs > 0, probs, 1.0)), LOG_ZERO)
  return {"log_probs": jnp.asarray(logp, jnp.float32)}
