"""The package's generated tasks (toy_reverse, synthetic_ende, synthetic_cnndm) without seqio.

`get_task(name)` returns an `OfflineTask` with the attributes an experiment
uses of a seqio Task (name, splits, output_features[...].vocabulary,
metric_fns) plus `token_examples(split, n)`: texts and token ids computed the
way the seqio task computes them (input prefix, SentencePiece or byte
tokenization, EOS appended), so `load_examples` gives identical examples on
either path without importing seqio or TensorFlow (a test compares them). The
same tasks stay registered as seqio tasks (`spec_decode.data.tasks`) for
seqio users.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from spec_decode import metrics
from spec_decode.models.t5 import EOS_ID

METRICS: dict[str, Callable] = {"bleu": metrics.bleu, "rouge": metrics.rouge}


class ByteVocabulary:
  """seqio.ByteVocabulary without TensorFlow: PAD 0, EOS 1, UNK 2, then the 256 bytes."""
  num_special = 3
  vocab_size = 259
  eos_id, unk_id = 1, 2

  def encode(self, text: str) -> list[int]:
    return [b + self.num_special for b in text.encode("utf-8")]

  def decode(self, ids: Sequence[int]) -> str:
    ids = _until_eos([self.unk_id if int(i) >= self.vocab_size else int(i) for i in ids])
    data = bytes(i - self.num_special for i in ids if self.num_special <= i < self.vocab_size)
    return data.decode("utf-8", errors="ignore")


class SentencePieceVocabulary:
  """seqio.SentencePieceVocabulary (no extra ids) without TensorFlow."""

  def __init__(self, path: str):
    self.path = path

  @functools.cached_property
  def _sp(self):
    import sentencepiece as spm
    return spm.SentencePieceProcessor(model_file=self.path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  @property
  def eos_id(self) -> int:
    return self._sp.eos_id()

  @property
  def unk_id(self) -> int:
    return self._sp.unk_id()

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode_as_ids(text))

  def decode(self, ids: Sequence[int]) -> str:
    ids = _until_eos([self.unk_id if int(i) >= self.vocab_size else int(i) for i in ids])
    return self._sp.decode_ids(ids)


def _until_eos(ids: list[int]) -> list[int]:
  return ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


@dataclasses.dataclass(frozen=True)
class Feature:
  vocabulary: object
  add_eos: bool = True


@dataclasses.dataclass(frozen=True, eq=False)
class OfflineTask:
  """A generated task served in plain Python (the seqio Task's fields an experiment reads)."""
  name: str
  splits: tuple[str, ...]
  vocabulary: object
  metric: str
  examples_fn: Callable[[str, int | None], Sequence[dict]]  # (split, first n or None)
  input_prefix: str = ""

  @property
  def output_features(self) -> dict[str, Feature]:
    return {"inputs": Feature(self.vocabulary), "targets": Feature(self.vocabulary)}

  @property
  def metric_fns(self) -> list[Callable]:
    return [METRICS[self.metric]]

  def token_examples(self, split: str, num_examples: int | None):
    """[(inputs text, targets text, input ids + EOS, target ids + EOS)], untruncated."""
    rows = self.examples_fn(split, num_examples)
    voc = self.vocabulary
    return [(self.input_prefix + ex["inputs"], ex["targets"],
             tuple(voc.encode(self.input_prefix + ex["inputs"])) + (EOS_ID,),
             tuple(voc.encode(ex["targets"])) + (EOS_ID,)) for ex in rows]


def task_names() -> tuple[str, ...]:
  from spec_decode.data import synthetic_tasks, toy_tasks
  return tuple(sorted(set(toy_tasks.TASKS) | set(synthetic_tasks.TASKS)))


@functools.lru_cache(maxsize=None)
def get_task(name: str) -> OfflineTask:
  """The built-in generated task `name` as an OfflineTask (no seqio, no TensorFlow)."""
  from spec_decode.data import synthetic_tasks, toy_tasks
  from spec_decode.data.synthetic import splits, vocab
  if name in toy_tasks.TASKS:
    metric, prefix = toy_tasks.TASKS[name]
    return OfflineTask(name, tuple(toy_tasks.SPLIT_SIZES), ByteVocabulary(), metric,
                       functools.partial(_toy_examples, name), prefix)
  if name in synthetic_tasks.TASKS:
    metric, prefix = synthetic_tasks.TASKS[name]
    return OfflineTask(name, splits.SPLITS, SentencePieceVocabulary(vocab.VOCAB_PATH), metric,
                       functools.partial(_synthetic_examples, name), prefix)
  raise ValueError(f"unknown generated task {name!r}; known: {task_names()}")


def _toy_examples(name: str, split: str, n: int | None) -> list[dict]:
  from spec_decode.data import toy_tasks
  return toy_tasks.examples(name, split)[:n]


def _synthetic_examples(name: str, split: str, n: int | None) -> list[dict]:
  """The first n examples (all if None); more than the split holds gives them all, as a
  seqio task does (the experiment's summary says so), not an error naming no setting."""
  from spec_decode.data.synthetic import splits
  full = splits.SPLIT_SIZES.get(name, {}).get(split)
  return splits.examples(name, split, size=n if n is None or full is None else min(n, full))
