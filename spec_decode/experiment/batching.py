"""Fixed-shape batches: every decode call of a run sees one shape (one compile).

A short last batch repeats its last row; callers keep only the first n rows of
the results. The row ids of the repeats repeat too, so a repeated row draws the
same randomness as the row it copies and never changes another row's output.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


def pad_rows(x: np.ndarray, batch_size: int) -> np.ndarray:
  """x [n, ...] with 1 <= n <= batch_size, padded to [batch_size, ...] by its last row."""
  x = np.asarray(x)
  n = x.shape[0]
  if not 1 <= n <= batch_size:
    raise ValueError(f"need 1..{batch_size} rows for a batch, got {n}")
  return np.concatenate([x, np.repeat(x[-1:], batch_size - n, axis=0)])


def batches(x: np.ndarray, batch_size: int) -> Iterator[tuple[np.ndarray, int]]:
  """(padded batch, number of real rows) for consecutive slices of x [N, ...]."""
  for i in range(0, len(x), batch_size):
    chunk = x[i:i + batch_size]
    yield pad_rows(chunk, batch_size), len(chunk)


def example_batch(examples: Sequence, *, batch_size: int,
                  input_length: int) -> tuple[np.ndarray, np.ndarray]:
  """(encoder tokens [B, S] int32, row ids [B] int32 = the example indices), padded."""
  from spec_decode import data
  enc = data.encoder_batch(examples, batch_size=batch_size, input_length=input_length)
  ids = pad_rows(np.array([ex.index for ex in examples], np.int32), batch_size)
  return enc, ids
