"""From a seqio task to decoder inputs: examples, fixed-shape batches, detokenization.

`load_examples` runs the task's own pipeline (`Task.get_dataset`, unshuffled,
one epoch, so example i is the same on every run and process) and keeps each
example's index, text and tokens. Batching is plain numpy: rows padded with
PAD = 0 to the input feature length, and a short final batch filled with
copies of its last row so every batch has one shape (one compilation).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from spec_decode.models.t5 import EOS_ID, PAD_ID


@dataclasses.dataclass(frozen=True)
class Example:
  """One example: its position in the split, texts and token ids (each ending in EOS).

  inputs / targets are the pretokenized strings after the task's text
  preprocessing (inputs include the task prefix); targets is the metric's reference.
  """
  index: int
  inputs: str
  targets: str
  input_tokens: tuple[int, ...]
  target_tokens: tuple[int, ...]


def check_feature_lengths(feature_lengths: Mapping[str, int]) -> dict[str, int]:
  if not isinstance(feature_lengths, Mapping) or set(feature_lengths) != {"inputs", "targets"}:
    raise ValueError(f"feature_lengths must map exactly 'inputs' and 'targets' to lengths, "
                     f"got {feature_lengths!r}")
  for k, v in feature_lengths.items():
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 2:
      raise ValueError(f"feature_lengths[{k!r}] must be an int >= 2, got {v!r}")
  return {k: int(v) for k, v in feature_lengths.items()}


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def load_examples(task, *, split: str, num_examples: int | None,
                  feature_lengths: Mapping[str, int]) -> list[Example]:
  """The first `num_examples` examples (all if None) of `split`, in the task's order."""
  feature_lengths = check_feature_lengths(feature_lengths)
  if split not in task.splits:
    raise ValueError(f"task {task.name!r} has no split {split!r}; splits: {list(task.splits)}")
  if num_examples is not None and (not isinstance(num_examples, int) or num_examples < 1):
    raise ValueError(f"num_examples must be a positive int or None, got {num_examples!r}")
  ds = task.get_dataset(sequence_length=feature_lengths, split=split, shuffle=False,
                        num_epochs=1, use_cached=False)
  if num_examples is not None:
    ds = ds.take(num_examples)
  out = []
  for i, ex in enumerate(ds.as_numpy_iterator()):
    out.append(Example(index=i, inputs=_text(ex["inputs_pretokenized"]),
                       targets=_text(ex["targets_pretokenized"]),
                       input_tokens=tuple(int(t) for t in ex["inputs"]),
                       target_tokens=tuple(int(t) for t in ex["targets"])))
  if not out:
    raise ValueError(f"task {task.name!r} split {split!r} yielded no examples")
  return out


def encoder_batch(examples: Sequence[Example], *, batch_size: int,
                  input_length: int) -> np.ndarray:
  """[batch_size, input_length] int32 input tokens, PAD-padded.

  A short batch repeats its last row (same shape, same work per row).
  """
  if not examples or len(examples) > batch_size:
    raise ValueError(f"need 1..{batch_size} examples for a batch, got {len(examples)}")
  out = np.full((batch_size, input_length), PAD_ID, np.int32)
  for r in range(batch_size):
    tokens = examples[min(r, len(examples) - 1)].input_tokens[:input_length]
    out[r, :len(tokens)] = tokens
  return out


def output_tokens(tokens: np.ndarray, length: int) -> list[int]:
  """A decoded row's tokens (EOS included when produced)."""
  return [int(t) for t in np.asarray(tokens)[:int(length)]]


def detokenize(vocabulary, tokens: Sequence[int]) -> str:
  """Text of a decoded row up to (not including) its first EOS; unknown ids decode as UNK."""
  tokens = list(tokens)
  if EOS_ID in tokens:
    tokens = tokens[:tokens.index(EOS_ID)]
  return vocabulary.decode(tokens)
