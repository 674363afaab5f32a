"""The generated tasks without seqio: the same examples as their seqio tasks; truncation; ids."""

import subprocess
import sys

import pytest

from spec_decode import data, paths
from spec_decode.data import offline

LENGTHS = {"inputs": 24, "targets": 20}  # short enough that some examples are cut


@pytest.mark.parametrize("name,split,n", [("toy_reverse", "validation", 40),
                                          ("synthetic_ende", "test", 30),
                                          ("synthetic_cnndm", "test", 8)])
def test_plain_and_seqio_paths_give_identical_examples(name, split, n):
  from spec_decode.data import tasks  # seqio
  plain = data.get_task(name)
  assert isinstance(plain, offline.OfflineTask)
  seqio_task = tasks.get_task(name)
  assert not isinstance(seqio_task, offline.OfflineTask)
  for lengths in (LENGTHS, {"inputs": 512, "targets": 512}):
    a = data.load_examples(plain, split=split, num_examples=n, feature_lengths=lengths)
    b = data.load_examples(seqio_task, split=split, num_examples=n, feature_lengths=lengths)
    assert a == b
  # The cut is seqio's own (append_eos_after_trim with the feature lengths).
  cut = seqio_task.get_dataset(sequence_length=LENGTHS, split=split, shuffle=False, num_epochs=1,
                               use_cached=False).take(n)
  for ex, ref in zip(a := data.load_examples(plain, split=split, num_examples=n,
                                             feature_lengths=LENGTHS), cut.as_numpy_iterator()):
    assert list(ex.input_tokens) == ref["inputs"].tolist()
    assert list(ex.target_tokens) == ref["targets"].tolist()
  assert plain.splits == seqio_task.splits
  assert plain.metric_fns == seqio_task.metric_fns
  pv = plain.output_features["targets"].vocabulary
  sv = seqio_task.output_features["targets"].vocabulary
  assert pv.vocab_size == sv.vocab_size
  for ids in (list(a[0].target_tokens), [7, 8, 1, 9], [0, 5, 6, pv.vocab_size + 3, 1], [3, 4]):
    assert pv.decode(ids) == sv.decode(ids)


def test_more_examples_than_a_split_holds_give_them_all():
  """As a seqio task does (the experiment's summary says how many there were); it was an
  error naming no setting ('size must be in [0, 500] for synthetic_cnndm/test')."""
  task = data.get_task("synthetic_cnndm")
  everything = data.load_examples(task, split="test", num_examples=10 ** 8,
                                  feature_lengths=LENGTHS)
  assert len(everything) == 500
  assert everything[:3] == data.load_examples(task, split="test", num_examples=3,
                                              feature_lengths=LENGTHS)


def test_truncated_examples_are_counted():
  task = data.get_task("synthetic_cnndm")
  exs = data.load_examples(task, split="test", num_examples=6, feature_lengths=LENGTHS)
  counts = data.truncation_counts(exs, LENGTHS)
  assert counts["inputs"] == sum(ex.input_source_length > 24 for ex in exs) > 0
  assert all(len(ex.input_tokens) <= 24 and ex.input_tokens[-1] == 1 for ex in exs)
  long = data.load_examples(task, split="test", num_examples=6,
                            feature_lengths={"inputs": 4096, "targets": 4096})
  assert data.truncation_counts(long, {"inputs": 4096, "targets": 4096})["inputs"] == 0
  assert [ex.input_source_length for ex in long] == [len(ex.input_tokens) for ex in long]


def test_token_ids_outside_the_vocabulary_are_refused():
  task = data.get_task("toy_reverse")
  exs = data.load_examples(task, split="test", num_examples=2,
                           feature_lengths={"inputs": 32, "targets": 32})
  data.encoder_batch(exs, batch_size=2, input_length=32, vocab_size=259)
  with pytest.raises(ValueError, match=r"example 0 has input token ids \[.*\] outside the "
                                       r"model's vocabulary of 64 ids"):
    data.encoder_batch(exs, batch_size=2, input_length=32, vocab_size=64)


def test_default_job_data_path_does_not_import_tensorflow():
  """Loading the default job (task, examples, both models) imports neither seqio nor TF."""
  code = ("import sys; from spec_decode import experiment\n"
          "from spec_decode.cli import gin as gin_layer, main\n"
          "cfg = gin_layer.parse_experiment([main.DEFAULT_GIN_FILE], ['NUM_EXAMPLES = 2'])\n"
          "s = experiment.load(cfg)\n"
          "assert len(s.examples) == 2 and s.task.name == 'synthetic_ende', s.task\n"
          "bad = sorted(m for m in ('tensorflow', 'seqio') if m in sys.modules)\n"
          "assert not bad, bad\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=paths.REPO_ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
