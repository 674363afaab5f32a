"""seqio tasks: T5's wmt_t2t_ende_v003 and cnn_dailymail_v002, and offline tasks.

Importing this module imports seqio and TensorFlow; `spec_decode.data` loads
it only when a task is used.

The real tasks follow T5's definitions (reference/t5x.md): a TFDS source, a
text preprocessor (`preprocessors.translate` / `summarize`), seqio's
`tokenize`, a cache placeholder and `append_eos_after_trim`; outputs 'inputs'
(optional) and 'targets', both with EOS; metric corpus BLEU / ROUGE with T5's
settings (`spec_decode.metrics`). Offline tasks (`register_offline_task`) run
through the same seqio Task machinery with a FunctionDataSource, so the
pipeline tests and demos exercise is the one a TPU run uses on WMT or CNN/DM.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterable, Mapping, Sequence

import seqio
import tensorflow as tf

from spec_decode import metrics
from spec_decode.data import preprocessors, vocab

METRICS: dict[str, Callable] = {"bleu": metrics.bleu, "rouge": metrics.rouge}

# name: (TFDS name, text preprocessor, metric, splits)
T5_TASKS = {
    "wmt_t2t_ende_v003": (
        "wmt_t2t_translate/de-en:1.0.0",
        functools.partial(preprocessors.translate, source_language="en",
                          target_language="de"),
        "bleu", ("train", "validation", "test")),
    "cnn_dailymail_v002": (
        "cnn_dailymail:3.4.0",
        functools.partial(preprocessors.summarize, article_key="article",
                          summary_key="highlights"),
        "rouge", ("train", "validation", "test")),
}

_t5_vocabulary_ids: dict[str, str] = {}   # task name -> identity of its vocabulary
_offline_tasks: set[str] = set()
_user_offline_tasks: set[str] = set()  # registered by callers, not by this package
_builtin_offline_registered = False
# The TFDS data directory a caller named (`get_task(tfds_data_dir=)`, `set_tfds_data_dir`):
# a dataset not prepared there is refused rather than downloaded (`pipeline`).
_tfds_data_dir: str | None = None


def output_features(vocabulary: seqio.Vocabulary) -> dict[str, seqio.Feature]:
  """T5's features: 'inputs' (not required, so decoder-only use works) and 'targets', EOS on."""
  return {"inputs": seqio.Feature(vocabulary=vocabulary, add_eos=True, required=False),
          "targets": seqio.Feature(vocabulary=vocabulary, add_eos=True)}


def _text_pipeline(text_preprocessor) -> list:
  return [text_preprocessor, seqio.preprocessors.tokenize, seqio.CacheDatasetPlaceholder(),
          seqio.preprocessors.append_eos_after_trim]


def _vocabulary_id(vocabulary) -> str:
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return f"spm:{vocabulary.sentencepiece_model_file}:{vocabulary.extra_ids}"
  return f"{type(vocabulary).__name__}:{id(vocabulary)}"


def _replace(name: str, task_factory: Callable[[], seqio.Task]) -> seqio.Task:
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  return task_factory()


def register_t5_task(name: str, *, vocabulary=None) -> seqio.Task:
  """(Re)registers T5 task `name` with `vocabulary` (default: T5's cc_all.32000 + 100)."""
  if name not in T5_TASKS:
    raise ValueError(f"unknown T5 task {name!r}; known: {sorted(T5_TASKS)}")
  tfds_name, text_preprocessor, metric, splits = T5_TASKS[name]
  voc = vocab.get_vocabulary(vocabulary)
  task = _replace(name, lambda: seqio.TaskRegistry.add(
      name,
      source=seqio.TfdsDataSource(tfds_name=tfds_name, splits=splits),
      preprocessors=_text_pipeline(text_preprocessor),
      output_features=output_features(voc),
      metric_fns=[METRICS[metric]]))
  _t5_vocabulary_ids[name] = _vocabulary_id(voc)
  return task


def register_offline_task(name: str, *, examples_fn: Callable[[str], Sequence[Mapping[str, str]]],
                          vocabulary, metric: str, input_prefix: str = "",
                          splits: Iterable[str] = ("train", "validation", "test"),
                          builtin: bool = False) -> seqio.Task:
  """Registers (or replaces) an offline seqio task.

  examples_fn(split) -> [{'inputs': str, 'targets': str}, ...], called once per
  split. vocabulary: a seqio.Vocabulary or the path of a SentencePiece model
  (no extra ids). metric: 'bleu' or 'rouge'. input_prefix is prepended to the
  inputs (like T5's task prefixes). Same tokenize / EOS steps as the T5 tasks.
  builtin: one of this package's generated tasks (`register_builtin_offline_tasks`);
  a caller's own task (the default) takes precedence over a generated one of its name.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"task name must be a non-empty str, got {name!r}")
  if metric not in METRICS:
    raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
  if not callable(examples_fn):
    raise ValueError("examples_fn must be callable: examples_fn(split) -> list of dicts")
  splits = tuple(splits)
  voc = vocab.get_vocabulary(vocabulary, extra_ids=0)

  @functools.lru_cache(maxsize=None)
  def examples(split: str) -> tuple[tuple[str, str], ...]:
    rows = examples_fn(split)
    out = []
    for i, ex in enumerate(rows):
      if not isinstance(ex, Mapping) or not all(isinstance(ex.get(k), str)
                                                for k in ("inputs", "targets")):
        raise ValueError(f"task {name!r} split {split!r} example {i} must be a dict with str "
                         f"'inputs' and 'targets', got {ex!r}")
      out.append((ex["inputs"], ex["targets"]))
    return tuple(out)

  def dataset_fn(split: str, shuffle_files: bool, seed=None) -> tf.data.Dataset:
    del shuffle_files, seed  # one in-memory "file"; order is the examples_fn order
    rows = examples(split)
    return tf.data.Dataset.from_tensor_slices({
        "inputs": tf.constant([r[0] for r in rows], tf.string, shape=[len(rows)]),
        "targets": tf.constant([r[1] for r in rows], tf.string, shape=[len(rows)])})

  task = _replace(name, lambda: seqio.TaskRegistry.add(
      name,
      source=seqio.FunctionDataSource(dataset_fn, splits=splits),
      preprocessors=_text_pipeline(functools.partial(preprocessors.add_prefix,
                                                     prefix=input_prefix)),
      output_features=output_features(voc),
      metric_fns=[METRICS[metric]]))
  _offline_tasks.add(name)
  if builtin:
    _user_offline_tasks.discard(name)
  else:
    _user_offline_tasks.add(name)
  return task


def offline_task_names() -> tuple[str, ...]:
  return tuple(sorted(_offline_tasks))


def user_offline_task_names() -> tuple[str, ...]:
  """Offline tasks registered by callers of `register_offline_task` (not the built-in ones)."""
  return tuple(sorted(_user_offline_tasks))


def register_builtin_offline_tasks() -> None:
  """Registers the package's generated tasks once: the toy tasks (`toy_tasks`) and the
  synthetic ones (`synthetic_tasks`), with the examples `spec_decode.data.offline` serves."""
  global _builtin_offline_registered
  if _builtin_offline_registered:
    return
  from spec_decode.data import synthetic_tasks, toy_tasks
  from spec_decode.data.synthetic import splits as synthetic_splits
  from spec_decode.data.synthetic import vocab as synthetic_vocab
  for name, (metric, prefix) in toy_tasks.TASKS.items():
    register_offline_task(name, examples_fn=functools.partial(toy_tasks.examples, name),
                          vocabulary=seqio.ByteVocabulary(), metric=metric, input_prefix=prefix,
                          splits=tuple(toy_tasks.SPLIT_SIZES), builtin=True)
  for name, (metric, prefix) in synthetic_tasks.TASKS.items():
    register_offline_task(name, examples_fn=functools.partial(synthetic_splits.examples, name),
                          vocabulary=synthetic_vocab.VOCAB_PATH, metric=metric,
                          input_prefix=prefix, builtin=True)
  _builtin_offline_registered = True


def set_tfds_data_dir(path: str | os.PathLike | None) -> None:
  """Where TFDS finds prepared datasets from now on (seqio's override); None: TFDS's own
  default, where a missing dataset is downloaded and prepared."""
  global _tfds_data_dir
  _tfds_data_dir = None if path is None else os.fspath(path)
  seqio.set_tfds_data_dir_override(_tfds_data_dir)


def tfds_data_dir() -> str | None:
  """The TFDS data directory a caller named (`set_tfds_data_dir`), or None."""
  return _tfds_data_dir


def get_task(name: str, *, vocabulary=None, tfds_data_dir: str | os.PathLike | None = None
             ) -> seqio.Task:
  """The seqio Task `name`, registering it first if it is one this package defines.

  vocabulary: for T5's tasks, a SentencePiece path or seqio.Vocabulary to use
  instead of the default (the task is re-registered when it changes).
  tfds_data_dir: where TFDS finds prepared datasets (default: TFDS's own).
  """
  if tfds_data_dir is not None:
    set_tfds_data_dir(tfds_data_dir)
  if name in T5_TASKS:
    if vocabulary is not None or name not in _t5_vocabulary_ids:
      voc = vocab.get_vocabulary(vocabulary)
      if _t5_vocabulary_ids.get(name) != _vocabulary_id(voc):
        register_t5_task(name, vocabulary=voc)
    return seqio.TaskRegistry.get(name)
  if vocabulary is not None:
    raise ValueError(f"vocabulary can only be set for T5's tasks {sorted(T5_TASKS)}; "
                     f"offline task {name!r} carries its own")
  if name not in seqio.TaskRegistry.names():
    register_builtin_offline_tasks()
  if name not in seqio.TaskRegistry.names():
    if name in seqio.MixtureRegistry.names():
      raise ValueError(f"{name!r} is a seqio Mixture; an experiment evaluates one Task")
    known = sorted(set(T5_TASKS) | set(seqio.TaskRegistry.names()))
    raise ValueError(f"unknown task {name!r}; known tasks: {known}")
  return seqio.TaskRegistry.get(name)
