"""Tokenized, padded training batches for a text-to-text task, deterministic by step.

A split is a `data.tokenized.TokenizedSplit` (token ids; targets end with EOS).
`batch_at(split, step, ...)` returns the batch a run sees at `step`: epochs are
permutations drawn from (seed, epoch), so a resumed run continues with exactly
the batches an uninterrupted run would have used. Each batch is padded to the
longest row rounded up to a multiple of `pad_multiple` (few distinct shapes, so
few compilations) and cut at the feature lengths.

Batch arrays: encoder_tokens [B, S], decoder_inputs [B, T] (targets shifted
right, BOS = 0 first), decoder_targets [B, T], weights [B, T] float32 (1 at
real target tokens, EOS included).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from spec_decode.data.tokenized import TokenizedSplit, pad_rows
from spec_decode.models.t5 import BOS_ID


def make_batch(split: TokenizedSplit, indices: Sequence[int], *, input_length: int,
               target_length: int, pad_multiple: int = 16) -> dict[str, np.ndarray]:
  """The padded batch of the given example indices."""
  enc = pad_rows([split.inputs[i] for i in indices], input_length, pad_multiple)
  tgt = pad_rows([split.targets[i] for i in indices], target_length, pad_multiple)
  dec_in = np.concatenate([np.full((len(indices), 1), BOS_ID, np.int32), tgt[:, :-1]], axis=1)
  lengths = np.array([min(len(split.targets[i]), tgt.shape[1]) for i in indices])
  weights = (np.arange(tgt.shape[1])[None, :] < lengths[:, None]).astype(np.float32)
  return {"encoder_tokens": enc, "decoder_inputs": dec_in, "decoder_targets": tgt,
          "weights": weights}


def batch_indices(num_examples: int, step: int, batch_size: int, seed: int) -> np.ndarray:
  """Example indices of the batch at `step` (epoch-wise permutations of (seed, epoch))."""
  if batch_size < 1 or num_examples < 1 or step < 0:
    raise ValueError(f"need batch_size >= 1, num_examples >= 1 and step >= 0, got "
                     f"{batch_size}, {num_examples}, {step}")
  start = step * batch_size
  out = []
  while len(out) < batch_size:
    epoch, offset = divmod(start + len(out), num_examples)
    perm = np.random.default_rng([seed, epoch]).permutation(num_examples)
    out.extend(perm[offset:offset + batch_size - len(out)].tolist())
  return np.array(out)


def batch_at(split: TokenizedSplit, step: int, *, batch_size: int, seed: int,
             input_length: int, target_length: int, pad_multiple: int = 16):
  """The training batch of `step`."""
  idx = batch_indices(len(split), step, batch_size, seed)
  return make_batch(split, idx, input_length=input_length, target_length=target_length,
                    pad_multiple=pad_multiple)


def eval_batches(split: TokenizedSplit, *, batch_size: int, input_length: int,
                 target_length: int, max_examples: int | None = None, pad_multiple: int = 16):
  """Batches covering the first `max_examples` examples in order (the last may be smaller)."""
  n = len(split) if max_examples is None else min(max_examples, len(split))
  for start in range(0, n, batch_size):
    yield make_batch(split, range(start, min(n, start + batch_size)), input_length=input_length,
                     target_length=target_length, pad_multiple=pad_multiple)
