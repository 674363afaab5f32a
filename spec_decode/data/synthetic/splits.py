"""Fixed, disjoint train/validation/test splits of the synthetic tasks.

Example i of a split is generated from the string seed "<task>/<split>/<seed>/<i>"
(Python's `random` hashes string seeds with SHA-512, so this is stable across
runs and machines). Splits are made disjoint by source text: test is drawn
first, validation skips test sources, train skips both.
"""

from __future__ import annotations

import functools
from typing import Callable

from spec_decode.data.synthetic import cnndm, ende

GENERATORS: dict[str, Callable[[str], dict[str, str]]] = {
    "synthetic_ende": ende.example,
    "synthetic_cnndm": cnndm.example,
}
SPLIT_SIZES = {
    "synthetic_ende": {"train": 60000, "validation": 1000, "test": 1000},
    "synthetic_cnndm": {"train": 20000, "validation": 500, "test": 500},
}
SPLITS = ("train", "validation", "test")
_ORDER = ("test", "validation", "train")


def examples(task: str, split: str, *, seed: int = 0, size: int | None = None
             ) -> list[dict[str, str]]:
  """The examples {'inputs', 'targets'} of a split (the first `size` if given).

  Only the requested prefix of a split is generated (plus the full smaller
  splits it must avoid), and generated examples are cached per process.
  """
  if task not in GENERATORS:
    raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(GENERATORS)}")
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
  full = SPLIT_SIZES[task][split]
  if size is None:
    size = full
  if not 0 <= size <= full:
    raise ValueError(f"size must be in [0, {full}] for {task}/{split}, got {size}")
  return list(_generator(task, split, seed).take(size))


class _Stream:
  """The examples of one split, generated on demand in order and cached."""

  def __init__(self, task: str, split: str, seed: int):
    self.task, self.split, self.seed = task, split, seed
    self.out: list[dict[str, str]] = []
    self.next_index = 0
    self.taken: set[str] | None = None

  def take(self, n: int) -> list[dict[str, str]]:
    if self.taken is None:
      self.taken = set()
      for earlier in _ORDER[:_ORDER.index(self.split)]:
        self.taken.update(ex["inputs"] for ex in examples(self.task, earlier, seed=self.seed))
    make = GENERATORS[self.task]
    while len(self.out) < n:
      ex = make(f"{self.task}/{self.split}/{self.seed}/{self.next_index}")
      self.next_index += 1
      if ex["inputs"] not in self.taken:
        self.taken.add(ex["inputs"])
        self.out.append(ex)
    return self.out[:n]


@functools.lru_cache(maxsize=None)
def _generator(task: str, split: str, seed: int) -> _Stream:
  return _Stream(task, split, seed)
