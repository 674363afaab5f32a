"""Vocabularies for the seqio tasks (imports seqio, hence TensorFlow).

T5's tasks use the SentencePiece model `cc_all.32000` with 100 extra ids
(32100 ids; the T5.1.1 embedding has 32128 rows). The path is configurable
because gs://t5-data is reachable only from Google Cloud: pass a local copy
through `get_vocabulary` or the experiment's `vocabulary_path`.
"""

from __future__ import annotations

import os

import seqio

DEFAULT_SPM_PATH = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
DEFAULT_EXTRA_IDS = 100


def get_vocabulary(vocabulary: seqio.Vocabulary | str | os.PathLike | None = None, *,
                   extra_ids: int = DEFAULT_EXTRA_IDS) -> seqio.Vocabulary:
  """A seqio.Vocabulary: `vocabulary` itself, or the SentencePiece model at that path.

  None means T5's default vocabulary (DEFAULT_SPM_PATH with DEFAULT_EXTRA_IDS).
  Local paths must exist; gs:// paths are opened lazily by TensorFlow's gfile.
  """
  if isinstance(vocabulary, seqio.Vocabulary):
    return vocabulary
  path = DEFAULT_SPM_PATH if vocabulary is None else os.fspath(vocabulary)
  if not isinstance(path, str) or not path:
    raise ValueError(f"vocabulary must be a seqio.Vocabulary or a SentencePiece model path, "
                     f"got {vocabulary!r}")
  if "://" not in path and not os.path.isfile(path):
    raise FileNotFoundError(f"SentencePiece model not found: {path}")
  if not isinstance(extra_ids, int) or extra_ids < 0:
    raise ValueError(f"extra_ids must be an int >= 0, got {extra_ids!r}")
  voc = seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)
  if "://" not in path:  # load a local model now, not in the middle of a run
    try:
      voc.vocab_size
    except Exception as e:  # sentencepiece's parse error
      raise ValueError(f"{path} is not a SentencePiece model: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
  return voc
