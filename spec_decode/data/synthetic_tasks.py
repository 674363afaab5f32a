"""The offline synthetic tasks: 'synthetic_ende' (BLEU) and 'synthetic_cnndm' (ROUGE).

`offline_source(name)` gives their examples and tokenizer without seqio or
TensorFlow (the trainer and the experiments use it); `spec_decode.data.tasks`
registers them as seqio tasks next to the real T5 tasks, so a gin macro switches
between the stand-ins and WMT/CNN-DM.
"""

from __future__ import annotations

import dataclasses
import functools

from spec_decode.data import tokenized
from spec_decode.data.synthetic import splits, vocab

TASKS = {
    # name: (metric, input prefix)
    "synthetic_ende": ("bleu", ""),
    "synthetic_cnndm": ("rouge", ""),
}


@dataclasses.dataclass(frozen=True)
class OfflineSource:
  """A synthetic task: examples per split, its vocabulary, metric and input prefix."""
  name: str
  metric: str
  input_prefix: str = ""
  vocab_path: str = vocab.VOCAB_PATH

  def examples(self, split: str, max_examples: int | None = None) -> list[dict[str, str]]:
    size = None if max_examples is None else min(max_examples,
                                                 splits.SPLIT_SIZES[self.name][split])
    return splits.examples(self.name, split, size=size)

  @functools.cached_property
  def vocabulary(self) -> vocab.Vocab:
    return vocab.Vocab(self.vocab_path)

  def tokenized(self, split: str, max_examples: int | None = None) -> tokenized.TokenizedSplit:
    return tokenized.tokenize(self.examples(split, max_examples), self.vocabulary.encode,
                               input_prefix=self.input_prefix)


def offline_source(name: str) -> OfflineSource:
  if name not in TASKS:
    raise ValueError(f"unknown offline task {name!r}; known: {sorted(TASKS)}")
  metric, prefix = TASKS[name]
  return OfflineSource(name, metric, prefix)
