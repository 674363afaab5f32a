"""Tasks and data: seqio tasks (T5's WMT EnDe and CNN/DM, offline tasks), examples, batches.

Importing this package is cheap: seqio and TensorFlow are imported only when a
seqio task is used (`get_task` of T5's tasks or of a registered offline task,
`register_offline_task`). The package's generated tasks (toy_reverse,
synthetic_ende, synthetic_cnndm) are served by `spec_decode.data.offline`
without seqio or TensorFlow, so the demo runs never import them; they are also
registered as seqio tasks (`spec_decode.data.tasks.get_task`) for seqio users,
with identical examples.

  task = data.get_task("wmt_t2t_ende_v003", vocabulary="/path/sentencepiece.model")
  examples = data.load_examples(task, split="validation", num_examples=100,
                                feature_lengths={"inputs": 64, "targets": 64})
"""

from __future__ import annotations

import sys

from spec_decode.data import offline, toy_tasks
from spec_decode.data.pipeline import (Example, check_feature_lengths, check_token_ids, detokenize,
                                       encoder_batch, load_examples, output_tokens,
                                       truncation_counts)

T5_TASK_NAMES = ("wmt_t2t_ende_v003", "cnn_dailymail_v002")

__all__ = ["Example", "T5_TASK_NAMES", "check_feature_lengths", "check_token_ids", "detokenize",
           "encoder_batch", "get_task", "load_examples", "output_tokens", "register_offline_task",
           "task_names", "truncation_counts"]


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
  """The task `name`: a generated one without seqio, else the seqio Task.

  For seqio tasks see `spec_decode.data.tasks.get_task` (imports seqio). An
  offline task registered under a generated task's name takes precedence.
  """
  registered = ("spec_decode.data.tasks" in sys.modules
                and name in sys.modules["spec_decode.data.tasks"].user_offline_task_names())
  if name in offline.task_names() and not registered:
    if kwargs.get("vocabulary") is not None:
      raise ValueError(f"vocabulary can only be set for T5's tasks {list(T5_TASK_NAMES)}; "
                       f"the generated task {name!r} carries its own")
    return offline.get_task(name)
  try:
    from spec_decode.data import tasks
  except ImportError as e:
    if e.name and e.name.split(".")[0] in ("seqio", "tensorflow", "tensorflow_datasets"):
      raise ImportError(f"task {name!r} needs seqio and TensorFlow: pip install -e '.[data]' "
                        f"({e})", name=e.name) from e
    raise
  return tasks.get_task(name, **kwargs)


def register_offline_task(name: str, **kwargs):
  """Registers an offline seqio task (see `spec_decode.data.tasks.register_offline_task`)."""
  from spec_decode.data import tasks
  return tasks.register_offline_task(name, **kwargs)
