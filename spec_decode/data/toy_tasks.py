"""A tiny built-in offline task for smoke runs and tests: 'toy_reverse'.

Inputs are short random word sequences, targets the same words in reverse
order; the vocabulary is seqio's ByteVocabulary (259 ids: PAD, EOS, UNK and
256 bytes), so no vocabulary file is needed. Examples are a pure function of
(task, split), so every process and rerun sees the same data. Nothing here needs
seqio or TensorFlow: `spec_decode.data.offline` serves the task without them, and
`spec_decode.data.tasks` registers it as a seqio task.
"""

from __future__ import annotations

import zlib

import numpy as np

WORDS = ("red", "blue", "green", "cat", "dog", "bird", "runs", "sees", "eats", "big",
         "small", "old", "new", "tree", "house", "river", "stone", "sun", "moon", "star",
         "one", "two", "three", "four")
SPLIT_SIZES = {"train": 2000, "validation": 200, "test": 200}
TASKS = {
    # name: (metric, input prefix)
    "toy_reverse": ("bleu", "reverse: "),
}
BYTE_VOCAB_SIZE = 259


def examples(name: str, split: str) -> list[dict[str, str]]:
  """The examples of `split` (deterministic): 3..8 words in, the same reversed out."""
  if name not in TASKS:
    raise ValueError(f"unknown toy task {name!r}; known: {sorted(TASKS)}")
  if split not in SPLIT_SIZES:
    raise ValueError(f"unknown split {split!r} of {name!r}; known: {sorted(SPLIT_SIZES)}")
  rng = np.random.default_rng(zlib.crc32(f"{name}/{split}".encode()))
  out = []
  for _ in range(SPLIT_SIZES[split]):
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=int(rng.integers(3, 9)))]
    out.append({"inputs": " ".join(words), "targets": " ".join(reversed(words))})
  return out
