"""From a seqio task to decoder inputs: examples, fixed-shape batches, detokenization.

`load_examples` runs the task's own pipeline (`Task.get_dataset`, unshuffled,
one epoch, so example i is the same on every run and process; or, for the
package's generated tasks, `offline.OfflineTask.token_examples`, the same
steps without TensorFlow) and keeps each example's index, text and tokens.
Sequences are cut to the feature lengths the way seqio's
`append_eos_after_trim` cuts them (first length - 1 tokens, then EOS); each
example keeps its uncut lengths so `truncation_counts` can report how many
were cut. Batching is plain numpy: rows padded with
PAD = 0 to the input feature length, and a short final batch filled with
copies of its last row so every batch has one shape (one compilation).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from spec_decode.models.t5 import EOS_ID, PAD_ID


@dataclasses.dataclass(frozen=True)
class Example:
  """One example: its position in the split, texts and token ids (each ending in EOS).

  inputs / targets are the pretokenized strings after the task's text
  preprocessing (inputs include the task prefix); targets is the metric's reference.
  """
  index: int
  inputs: str
  targets: str
  input_tokens: tuple[int, ...]
  target_tokens: tuple[int, ...]
  input_source_length: int | None = None   # tokens before cutting (EOS included)
  target_source_length: int | None = None


def check_feature_lengths(feature_lengths: Mapping[str, int]) -> dict[str, int]:
  if not isinstance(feature_lengths, Mapping) or set(feature_lengths) != {"inputs", "targets"}:
    raise ValueError(f"feature_lengths must map exactly 'inputs' and 'targets' to lengths, "
                     f"got {feature_lengths!r}")
  for k, v in feature_lengths.items():
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 2:
      raise ValueError(f"feature_lengths[{k!r}] must be an int >= 2, got {v!r}")
  return {k: int(v) for k, v in feature_lengths.items()}


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _cut(tokens: tuple[int, ...], length: int) -> tuple[int, ...]:
  """seqio's append_eos_after_trim on an EOS-terminated sequence: at most `length` tokens."""
  return tokens if len(tokens) <= length else tokens[:length - 1] + (EOS_ID,)


def load_examples(task, *, split: str, num_examples: int | None,
                  feature_lengths: Mapping[str, int]) -> list[Example]:
  """The first `num_examples` examples (all if None) of `split`, in the task's order."""
  feature_lengths = check_feature_lengths(feature_lengths)
  if split not in task.splits:
    raise ValueError(f"task {task.name!r} has no split {split!r}; splits: {list(task.splits)}")
  if num_examples is not None and (not isinstance(num_examples, int) or num_examples < 1):
    raise ValueError(f"num_examples must be a positive int or None, got {num_examples!r}")
  if hasattr(task, "token_examples"):  # a generated task served without seqio
    raw = task.token_examples(split, num_examples)
  else:
    _warn_if_tfds_unprepared(task)
    # Uncut sequences (EOS appended), cut below exactly as seqio would, counting the cuts.
    ds = task.get_dataset(sequence_length=None, split=split, shuffle=False, num_epochs=1,
                          use_cached=False)
    if num_examples is not None:
      ds = ds.take(num_examples)
    raw = [(_text(ex["inputs_pretokenized"]), _text(ex["targets_pretokenized"]),
            tuple(int(t) for t in ex["inputs"]), tuple(int(t) for t in ex["targets"]))
           for ex in ds.as_numpy_iterator()]
  out = [Example(index=i, inputs=inputs, targets=targets,
                 input_tokens=_cut(ins, feature_lengths["inputs"]),
                 target_tokens=_cut(outs, feature_lengths["targets"]),
                 input_source_length=len(ins), target_source_length=len(outs))
         for i, (inputs, targets, ins, outs) in enumerate(raw)]
  if not out:
    raise ValueError(f"task {task.name!r} split {split!r} yielded no examples")
  return out


def _warn_if_tfds_unprepared(task) -> None:
  """Says so before TFDS starts a long download-and-prepare (or fails offline after minutes);
  when the caller named the data directory (`tasks.set_tfds_data_dir`, the experiment's
  tfds_data_dir), a dataset not prepared there is refused: a download is not what was asked
  for, and offline it retries for minutes."""
  loader = getattr(getattr(task, "source", None), "tfds_dataset", None)
  if loader is None:
    return
  try:
    builder = loader.builder
    prepared = builder.is_prepared()
    where = builder.data_dir_root
  except Exception:  # the check is advisory; get_dataset reports real failures
    return
  from spec_decode.data import tasks  # (seqio and TensorFlow: only for seqio tasks)
  if not prepared and tasks.tfds_data_dir() is not None:
    raise ValueError(f"TFDS dataset {loader.name} is not prepared in {where} (the "
                     f"tfds_data_dir given, ExperimentConfig.tfds_data_dir): prepare it there "
                     f"first, or leave tfds_data_dir unset to let TFDS download and prepare "
                     f"it (needs network and several GB)")
  if not prepared:
    from absl import logging
    logging.warning("TFDS dataset %s is not prepared in %s: TFDS now downloads and prepares it "
                    "(needs network and several GB, can take long); to use a copy prepared "
                    "elsewhere, set ExperimentConfig.tfds_data_dir", loader.name, where)


def truncation_counts(examples: Sequence[Example],
                      feature_lengths: Mapping[str, int]) -> dict[str, int | None]:
  """How many examples had inputs / targets longer than the feature lengths (and were cut).

  None for a feature whose uncut lengths are unknown.
  """
  out: dict[str, int | None] = {"examples": len(examples)}
  for key, attr in (("inputs", "input_source_length"), ("targets", "target_source_length")):
    lengths = [getattr(ex, attr) for ex in examples]
    out[key] = (None if any(n is None for n in lengths)
                else sum(n > feature_lengths[key] for n in lengths))
    out[f"{key}_length"] = int(feature_lengths[key])
  return out


def check_token_ids(examples: Sequence[Example], vocab_size: int, *, what: str) -> None:
  """Raises ValueError if an input or target token id lies outside [0, vocab_size).

  Under jit an out-of-range id is not an error (the embedding lookup clamps
  or fills it), so this host-side check is what stops a silent wrong decode.
  """
  for ex in examples:
    for name, tokens in (("input", ex.input_tokens), ("target", ex.target_tokens)):
      bad = [t for t in tokens if not 0 <= t < vocab_size]
      if bad:
        raise ValueError(f"example {ex.index} has {name} token ids {sorted(set(bad))[:5]} "
                         f"outside the {what}'s vocabulary of {vocab_size} ids; the task's "
                         "vocabulary does not fit the model: use the model's vocabulary "
                         "(ExperimentConfig.vocabulary) or a model trained with this one")


def encoder_batch(examples: Sequence[Example], *, batch_size: int, input_length: int,
                  vocab_size: int | None = None) -> np.ndarray:
  """[batch_size, input_length] int32 input tokens, PAD-padded.

  A short batch repeats its last row (same shape, same work per row).
  vocab_size: if given, ids outside [0, vocab_size) are an error (see `check_token_ids`).
  """
  if not examples or len(examples) > batch_size:
    raise ValueError(f"need 1..{batch_size} examples for a batch, got {len(examples)}")
  if vocab_size is not None:
    check_token_ids(examples, vocab_size, what="model")
  out = np.full((batch_size, input_length), PAD_ID, np.int32)
  for r in range(batch_size):
    tokens = examples[min(r, len(examples) - 1)].input_tokens[:input_length]
    out[r, :len(tokens)] = tokens
  return out


def output_tokens(tokens: np.ndarray, length: int) -> list[int]:
  """A decoded row's tokens (EOS included when produced)."""
  return [int(t) for t in np.asarray(tokens)[:int(length)]]


def detokenize(vocabulary, tokens: Sequence[int]) -> str:
  """Text of a decoded row up to (not including) its first EOS; unknown ids decode as UNK."""
  tokens = list(tokens)
  if EOS_ID in tokens:
    tokens = tokens[:tokens.index(EOS_ID)]
  return vocabulary.decode(tokens)
