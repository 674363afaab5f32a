"""seqio tasks: offline tasks end to end (tokens, lengths, batches), T5's task definitions."""

import numpy as np
import pytest
import seqio  # imports TensorFlow once for this module
import sentencepiece as spm
import tensorflow as tf

from spec_decode import data, metrics
from spec_decode.data import tasks, toy_tasks, vocab

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "house", "tree", "blue"]


def _sentences(split: str, n: int):
  rng = np.random.default_rng(0 if split == "train" else 1)
  out = []
  for _ in range(n):
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=int(rng.integers(2, 12)))]
    out.append({"inputs": " ".join(words), "targets": " ".join(sorted(words))})
  return out


@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
  """A SentencePiece model trained here with T5's special ids (PAD 0, EOS 1, UNK 2)."""
  d = tmp_path_factory.mktemp("spm")
  corpus = d / "corpus.txt"
  corpus.write_text("\n".join("sort: " + ex["inputs"] for ex in _sentences("train", 400)) + "\n")
  spm.SentencePieceTrainer.train(
      input=str(corpus), model_prefix=str(d / "toy"), vocab_size=30, model_type="unigram",
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
      minloglevel=2)
  return str(d / "toy.model")


@pytest.fixture(scope="module")
def spm_task(spm_path):
  return data.register_offline_task("test_sort_words", examples_fn=lambda s: _sentences(s, 30),
                                    vocabulary=spm_path, metric="rouge", input_prefix="sort: ")


def test_offline_task_tokenization_round_trip_and_lengths(spm_task):
  voc = spm_task.output_features["targets"].vocabulary
  assert isinstance(voc, seqio.SentencePieceVocabulary) and voc.vocab_size == 30
  raw = _sentences("validation", 30)
  lengths = {"inputs": 12, "targets": 10}
  examples = data.load_examples(spm_task, split="validation", num_examples=None,
                                feature_lengths=lengths)
  assert [ex.index for ex in examples] == list(range(30))
  truncated = 0
  for ex, r in zip(examples, raw):
    assert ex.inputs == "sort: " + r["inputs"] and ex.targets == r["targets"]
    for tokens, text, cap in ((ex.input_tokens, ex.inputs, 12), (ex.target_tokens, ex.targets, 10)):
      assert tokens[-1] == 1 and 1 not in tokens[:-1] and 0 not in tokens  # EOS once, at the end
      assert len(tokens) <= cap
      full = voc.encode(text)
      if len(full) + 1 <= cap:
        assert list(tokens[:-1]) == full
        assert data.detokenize(voc, tokens) == text  # round trip
      else:  # trimmed to cap - 1 tokens, then EOS (append_eos_after_trim)
        truncated += 1
        assert len(tokens) == cap and list(tokens[:-1]) == full[:cap - 1]
  assert 0 < truncated < 60  # both cases occur (30 inputs + 30 targets)
  assert spm_task.metric_fns == [metrics.rouge]


def test_num_examples_and_order_are_stable(spm_task):
  lengths = {"inputs": 16, "targets": 16}
  a = data.load_examples(spm_task, split="train", num_examples=5, feature_lengths=lengths)
  b = data.load_examples(spm_task, split="train", num_examples=8, feature_lengths=lengths)
  assert len(a) == 5 and a == b[:5]


def test_encoder_batch_pads_and_fills(spm_task):
  examples = data.load_examples(spm_task, split="validation", num_examples=3,
                                feature_lengths={"inputs": 20, "targets": 8})
  batch = data.encoder_batch(examples, batch_size=4, input_length=20)
  assert batch.shape == (4, 20) and batch.dtype == np.int32
  for r, ex in enumerate(examples):
    n = len(ex.input_tokens)
    np.testing.assert_array_equal(batch[r, :n], ex.input_tokens)
    np.testing.assert_array_equal(batch[r, n:], 0)
  np.testing.assert_array_equal(batch[3], batch[2])  # short batch: last row repeated
  with pytest.raises(ValueError, match="examples for a batch"):
    data.encoder_batch(examples, batch_size=2, input_length=20)


def test_toy_task_uses_byte_vocabulary():
  task = tasks.get_task("toy_reverse")  # the seqio task (data.get_task serves it without seqio)
  voc = task.output_features["inputs"].vocabulary
  assert isinstance(voc, seqio.ByteVocabulary) and voc.vocab_size == toy_tasks.BYTE_VOCAB_SIZE
  [ex] = data.load_examples(task, split="test", num_examples=1,
                            feature_lengths={"inputs": 64, "targets": 64})
  raw = toy_tasks.examples("toy_reverse", "test")[0]
  assert ex.inputs == "reverse: " + raw["inputs"]
  assert ex.targets == " ".join(reversed(raw["inputs"].split()))
  assert list(ex.target_tokens) == [b + 3 for b in ex.targets.encode()] + [1]
  assert data.detokenize(voc, list(ex.target_tokens) + [7, 8]) == ex.targets  # cut at EOS
  assert toy_tasks.examples("toy_reverse", "test") == toy_tasks.examples("toy_reverse", "test")


def test_t5_tasks_follow_t5_definitions(spm_path):
  ende = data.get_task("wmt_t2t_ende_v003", vocabulary=spm_path)
  assert isinstance(ende.source, seqio.TfdsDataSource)
  assert ende.source.tfds_dataset.name == "wmt_t2t_translate/de-en:1.0.0"
  assert ende.metric_fns == [metrics.bleu]
  assert ende.output_features["targets"].vocabulary.sentencepiece_model_file == spm_path
  assert ende.output_features["inputs"].add_eos and ende.output_features["targets"].add_eos
  pre = ende.preprocessors
  assert pre[1] is seqio.preprocessors.tokenize
  assert pre[-1] is seqio.preprocessors.append_eos_after_trim
  raw = tf.data.Dataset.from_tensors({"en": "Hello world.", "de": "Hallo Welt."})
  [ex] = list(pre[0](raw).as_numpy_iterator())
  assert ex == {"inputs": b"translate English to German: Hello world.",
                "targets": b"Hallo Welt."}

  cnn = data.get_task("cnn_dailymail_v002", vocabulary=spm_path)
  assert cnn.source.tfds_dataset.name == "cnn_dailymail:3.4.0"
  assert cnn.metric_fns == [metrics.rouge]
  raw = tf.data.Dataset.from_tensors({"article": "A long story.", "highlights": "Short."})
  [ex] = list(cnn.preprocessors[0](raw).as_numpy_iterator())
  assert ex == {"inputs": b"summarize: A long story.", "targets": b"Short."}
  # The default vocabulary is T5's cc_all.32000 with 100 extra ids.
  assert vocab.DEFAULT_SPM_PATH.endswith("cc_all.32000/sentencepiece.model")
  assert vocab.DEFAULT_EXTRA_IDS == 100


def test_task_errors(spm_task):
  with pytest.raises(ValueError, match="unknown task 'no_such_task'.*toy_reverse"):
    data.get_task("no_such_task")
  with pytest.raises(ValueError, match="no split 'dev'"):
    data.load_examples(spm_task, split="dev", num_examples=1,
                       feature_lengths={"inputs": 8, "targets": 8})
  with pytest.raises(ValueError, match="feature_lengths"):
    data.load_examples(spm_task, split="train", num_examples=1, feature_lengths={"inputs": 8})
  with pytest.raises(ValueError, match="metric must be one of"):
    data.register_offline_task("bad", examples_fn=lambda s: [], vocabulary=seqio.ByteVocabulary(),
                               metric="accuracy")
  with pytest.raises(FileNotFoundError, match="SentencePiece model not found"):
    vocab.get_vocabulary("/nonexistent/sp.model")
  bad = data.register_offline_task("bad_rows", examples_fn=lambda s: [{"inputs": "x"}],
                                   vocabulary=seqio.ByteVocabulary(), metric="bleu")
  with pytest.raises(Exception, match="str 'inputs' and 'targets'"):
    data.load_examples(bad, split="train", num_examples=1,
                       feature_lengths={"inputs": 8, "targets": 8})


def test_task_names_lists_builtin_and_registered(spm_task):
  names = data.task_names()
  for n in ("wmt_t2t_ende_v003", "cnn_dailymail_v002", "toy_reverse", "test_sort_words"):
    assert n in names
  assert set(tasks.T5_TASKS) == set(data.T5_TASK_NAMES)


def test_unprepared_tfds_dataset_is_announced(spm_path, tmp_path, caplog, monkeypatch):
  """Before TFDS starts a long download (or fails offline minutes later), the run says so;
  in a data directory the user named, an unprepared dataset is refused (TFDS started a
  download there and, offline, retried for minutes)."""
  import logging
  from spec_decode.data import pipeline
  try:
    task = data.get_task("wmt_t2t_ende_v003", vocabulary=spm_path, tfds_data_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"TFDS dataset wmt_t2t_translate/de-en:1.0.0 is not "
                                         f"prepared in {tmp_path} \\(the tfds_data_dir given"):
      pipeline._warn_if_tfds_unprepared(task)
    tasks.set_tfds_data_dir(None)  # TFDS's own directory: announced, then downloaded
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "default"))
    with caplog.at_level(logging.WARNING):
      pipeline._warn_if_tfds_unprepared(data.get_task("wmt_t2t_ende_v003"))
  finally:
    tasks.set_tfds_data_dir(None)
  assert "wmt_t2t_translate/de-en:1.0.0 is not prepared in " in caplog.text
  assert "set ExperimentConfig.tfds_data_dir" in caplog.text


def test_a_vocabulary_that_is_no_sentencepiece_model_is_refused(tmp_path):
  garbage = tmp_path / "garbage.model"
  garbage.write_bytes(b"\x00not a model" * 10)
  with pytest.raises(ValueError, match=f"{garbage} is not a SentencePiece model"):
    vocab.get_vocabulary(str(garbage))
