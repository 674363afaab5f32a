"""Examples as token ids: a split's inputs and targets, and padded encoder batches of them.

`TokenizedSplit` holds one split as tuples of token ids (both sides end with EOS, as
seqio appends it); `tokenize` makes one from text examples; `pad_rows` pads rows of ids
into one [B, S] int32 array (the trainer's batches, teacher decodes, demo scoring).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from spec_decode.models.base import EOS_ID


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
  """inputs, targets: tuples of token-id tuples (targets end with EOS)."""
  inputs: tuple[tuple[int, ...], ...]
  targets: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    if len(self.inputs) != len(self.targets) or not self.inputs:
      raise ValueError(f"need as many inputs as targets and at least one example, got "
                       f"{len(self.inputs)} inputs and {len(self.targets)} targets")

  def __len__(self) -> int:
    return len(self.inputs)


def tokenize(examples: Sequence[Mapping[str, str]], encode: Callable[[str], Sequence[int]],
             *, input_prefix: str = "") -> TokenizedSplit:
  """Encodes {'inputs', 'targets'} examples; appends EOS to both sides (as seqio does)."""
  ins = tuple(tuple(encode(input_prefix + ex["inputs"])) + (EOS_ID,) for ex in examples)
  outs = tuple(tuple(encode(ex["targets"])) + (EOS_ID,) for ex in examples)
  return TokenizedSplit(ins, outs)


def pad_rows(rows: Sequence[Sequence[int]], cap: int, multiple: int) -> np.ndarray:
  """[len(rows), W] int32: the rows cut at `cap` and padded with 0, W the longest row
  rounded up to a multiple of `multiple` (few distinct shapes, so few compilations), at
  most `cap`."""
  longest = min(max(len(r) for r in rows), cap)
  width = min(cap, -(-longest // multiple) * multiple)
  out = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    r = list(r)[:width]
    out[i, :len(r)] = r
  return out
