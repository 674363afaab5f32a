"""Text preprocessors of the tasks (tf.data maps; imports TensorFlow).

They turn a source's raw fields into the 'inputs' and 'targets' strings that
seqio's `tokenize` and `append_eos_after_trim` then encode, as T5's own task
definitions do:
  * `translate`: "translate English to German: " + en -> de (wmt_t2t_ende_v003);
  * `summarize`: "summarize: " + article -> highlights (cnn_dailymail_v002);
  * `add_prefix`: the offline tasks, whose sources already give 'inputs' and
    'targets', optionally prefixed.
"""

from __future__ import annotations

import tensorflow as tf

LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "ro": "Romanian"}


def translate(dataset: tf.data.Dataset, *, source_language: str,
              target_language: str) -> tf.data.Dataset:
  """{source_language: s, target_language: t} -> inputs 'translate A to B: s', targets t."""
  for lang in (source_language, target_language):
    if lang not in LANGUAGE_NAMES:
      raise ValueError(f"unknown language code {lang!r}; known: {sorted(LANGUAGE_NAMES)}")
  prefix = (f"translate {LANGUAGE_NAMES[source_language]} to "
            f"{LANGUAGE_NAMES[target_language]}: ")

  def fn(ex):
    return {"inputs": tf.strings.join([prefix, ex[source_language]]),
            "targets": ex[target_language]}

  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def summarize(dataset: tf.data.Dataset, *, article_key: str = "article",
              summary_key: str = "highlights") -> tf.data.Dataset:
  """{article_key: a, summary_key: s} -> inputs 'summarize: a', targets s."""

  def fn(ex):
    return {"inputs": tf.strings.join(["summarize:", ex[article_key]], separator=" "),
            "targets": ex[summary_key]}

  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def add_prefix(dataset: tf.data.Dataset, *, prefix: str = "") -> tf.data.Dataset:
  """{'inputs', 'targets'} -> the same with `prefix` before the inputs."""

  def fn(ex):
    return {"inputs": tf.strings.join([prefix, ex["inputs"]]), "targets": ex["targets"]}

  return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE)
