"""Fixed, disjoint train/validation/test splits of the synthetic tasks.

Example i of a split is generated from the string seed "<task>/<split>/<seed>/<i>"
(Python's `random` hashes string seeds with SHA-512, so this is stable across
runs and machines). Splits are made disjoint by source text: test is drawn
first, validation skips test sources, train skips both.
"""

from __future__ import annotations

import functools
import random
from typing import Callable, Sequence

from spec_decode.data.synthetic import cnndm, ende

GENERATORS: dict[str, Callable[[str], dict[str, str]]] = {
    "synthetic_ende": ende.example,
    "synthetic_cnndm": cnndm.example,
}
# (example seed, rng) -> another reference for the same input, its choices drawn from rng.
REFERENCES: dict[str, Callable[[str, random.Random], str]] = {
    "synthetic_ende": ende.reference,
    "synthetic_cnndm": cnndm.reference,
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
  return list(_generator(task, split, seed).take(_size(task, split, size)))


def seeds(task: str, split: str, *, seed: int = 0, size: int | None = None) -> list[str]:
  """The generator seed strings of a split's examples (the first `size` if given)."""
  stream = _generator(task, split, seed)
  size = _size(task, split, size)
  stream.take(size)
  return stream.seeds[:size]


class MostLikely(random.Random):
  """An rng that makes every weighted choice its heaviest option, and random() = 0.5.

  The generators draw their stochastic choices with `choices(options,
  weights)` and `random() < p`; with this rng each takes its most likely
  outcome (a branch of probability exactly 0.5 is not taken).
  """

  def random(self) -> float:
    return 0.5

  def choices(self, population: Sequence, weights=None, *, cum_weights=None, k: int = 1):
    if weights is None or cum_weights is not None or k != 1:
      raise ValueError("MostLikely.choices supports choices(population, weights) only")
    return [population[max(range(len(population)), key=lambda i: weights[i])]]


def references(task: str, split: str, *, seed: int = 0, size: int | None = None,
               mode: str = "sample", salt: str = "/resample") -> list[str]:
  """Other references for a split's inputs: 'sample' redraws the stochastic choices
  (rng seeded with the example's seed + salt), 'mode' takes the most likely ones."""
  if mode not in ("sample", "mode"):
    raise ValueError(f"mode must be 'sample' or 'mode', got {mode!r}")
  make = REFERENCES[task]
  return [make(s, random.Random(s + salt) if mode == "sample" else MostLikely(0))
          for s in seeds(task, split, seed=seed, size=size)]


def _size(task: str, split: str, size: int | None) -> int:
  if task not in GENERATORS:
    raise ValueError(f"unknown synthetic task {task!r}; known: {sorted(GENERATORS)}")
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
  full = SPLIT_SIZES[task][split]
  if size is None:
    size = full
  if not 0 <= size <= full:
    raise ValueError(f"size must be in [0, {full}] for {task}/{split}, got {size}")
  return size


class _Stream:
  """The examples of one split, generated on demand in order and cached."""

  def __init__(self, task: str, split: str, seed: int):
    self.task, self.split, self.seed = task, split, seed
    self.out: list[dict[str, str]] = []
    self.seeds: list[str] = []
    self.next_index = 0
    self.taken: set[str] | None = None

  def take(self, n: int) -> list[dict[str, str]]:
    if self.taken is None:
      self.taken = set()
      for earlier in _ORDER[:_ORDER.index(self.split)]:
        self.taken.update(ex["inputs"] for ex in examples(self.task, earlier, seed=self.seed))
    make = GENERATORS[self.task]
    while len(self.out) < n:
      name = f"{self.task}/{self.split}/{self.seed}/{self.next_index}"
      ex = make(name)
      self.next_index += 1
      if ex["inputs"] not in self.taken:
        self.taken.add(ex["inputs"])
        self.out.append(ex)
        self.seeds.append(name)
    return self.out[:n]


@functools.lru_cache(maxsize=None)
def _generator(task: str, split: str, seed: int) -> _Stream:
  return _Stream(task, split, seed)
