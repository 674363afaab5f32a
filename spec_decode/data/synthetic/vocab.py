"""The SentencePiece vocabulary of the synthetic tasks (PAD 0, EOS 1, UNK 2, no BOS).

`VOCAB_PATH` is the shipped model, trained by `train_vocab` on the train splits
of both synthetic tasks (sources and targets), so one vocabulary serves both,
as T5's does. `Vocab` is a small tokenizer over it that needs no TensorFlow.
Rebuild: `python -m spec_decode.data.synthetic.vocab`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Iterable, Sequence

import sentencepiece as spm

VOCAB_PATH = os.path.join(os.path.dirname(__file__), "synthetic_vocab.model")
VOCAB_SIZE = 1536
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def corpus(max_examples: int = 20000) -> Iterable[str]:
  """Training text: inputs and targets of the first train examples of each task."""
  from spec_decode.data.synthetic import splits  # local: generating is the slow part
  for task, n in (("synthetic_ende", max_examples), ("synthetic_cnndm", max_examples // 4)):
    for ex in splits.examples(task, "train", size=n):
      yield ex["inputs"]
      yield ex["targets"]


def train_vocab(model_prefix: str, *, vocab_size: int = VOCAB_SIZE,
                max_examples: int = 20000) -> str:
  """Trains the BPE SentencePiece model; returns the .model path."""
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(corpus(max_examples)), model_prefix=model_prefix,
      vocab_size=vocab_size, model_type="bpe", character_coverage=1.0,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1, num_threads=1,
      input_sentence_size=0, shuffle_input_sentence=False, max_sentence_length=8192,
      minloglevel=2)
  if os.path.exists(model_prefix + ".vocab"):
    os.remove(model_prefix + ".vocab")  # a readable copy of the pieces; not needed
  return model_prefix + ".model"


@dataclasses.dataclass(frozen=True)
class Vocab:
  """Encodes text to ids (no EOS appended) and decodes ids (stops at EOS, drops PAD)."""
  path: str = VOCAB_PATH

  @functools.cached_property
  def _sp(self) -> spm.SentencePieceProcessor:
    if not os.path.exists(self.path):
      raise ValueError(f"SentencePiece model not found: {self.path}")
    return spm.SentencePieceProcessor(model_file=self.path)

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
      ids = ids[:ids.index(EOS_ID)]
    return self._sp.decode([i for i in ids if i != PAD_ID])


if __name__ == "__main__":
  print(train_vocab(VOCAB_PATH[:-len(".model")]))
