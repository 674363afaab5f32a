"""Tasks and data: seqio tasks (T5's WMT EnDe and CNN/DM, offline tasks), examples, batches.

Importing this package is cheap: seqio and TensorFlow are imported only when a
task is used (`get_task`, `register_offline_task`, `load_examples`), so the
models, decoding and `spec_decode.main` stay TensorFlow-free until then.

  task = data.get_task("wmt_t2t_ende_v003", vocabulary="/path/sentencepiece.model")
  examples = data.load_examples(task, split="validation", num_examples=100,
                                feature_lengths={"inputs": 64, "targets": 64})
"""

from __future__ import annotations

import sys

from spec_decode.data import toy_tasks
from spec_decode.data.pipeline import (Example, check_feature_lengths, detokenize, encoder_batch,
                                       load_examples, output_tokens)

T5_TASK_NAMES = ("wmt_t2t_ende_v003", "cnn_dailymail_v002")

__all__ = ["Example", "T5_TASK_NAMES", "check_feature_lengths", "detokenize", "encoder_batch",
           "get_task", "load_examples", "output_tokens", "register_offline_task", "task_names"]


def task_names() -> tuple[str, ...]:
  """Names `get_task` knows, without importing TensorFlow (unless tasks are already loaded)."""
  names = set(T5_TASK_NAMES) | set(toy_tasks.TASKS)
  try:
    from spec_decode.data import synthetic_tasks
  except ModuleNotFoundError as e:
    if e.name != "spec_decode.data.synthetic_tasks":
      raise
  else:
    names |= set(synthetic_tasks.TASKS)
  if "spec_decode.data.tasks" in sys.modules:
    names |= set(sys.modules["spec_decode.data.tasks"].offline_task_names())
  return tuple(sorted(names))


def get_task(name: str, **kwargs):
  """The seqio Task `name` (see `spec_decode.data.tasks.get_task`); imports seqio."""
  from spec_decode.data import tasks
  return tasks.get_task(name, **kwargs)


def register_offline_task(name: str, **kwargs):
  """Registers an offline seqio task (see `spec_decode.data.tasks.register_offline_task`)."""
  from spec_decode.data import tasks
  return tasks.register_offline_task(name, **kwargs)
