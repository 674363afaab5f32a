"""Metrics against sacrebleu / rouge_score used directly; acceptance statistics; timing helpers."""

import jax
import numpy as np
import pytest
import sacrebleu
from rouge_score import rouge_scorer, scoring

from spec_decode import metrics
from spec_decode.decoding import timing
from spec_decode.models import ngram, t5

REFS = ["the cat sat on the mat .", "a dog runs in the park . it is happy .",
        "das ist ein kleines haus", "Es regnet heute nicht ."]
PREDS = ["the cat sat on a mat .", "the dog runs in a park . it is happy",
         "das ist ein haus", "Heute regnet es nicht ."]


def test_bleu_matches_sacrebleu_with_t5_settings():
  expected = sacrebleu.corpus_bleu(PREDS, [REFS], smooth_method="exp", smooth_value=0.0,
                                   force=False, lowercase=False, tokenize="intl",
                                   use_effective_order=False).score
  got = metrics.bleu(REFS, PREDS)
  assert set(got) == {"bleu"}
  np.testing.assert_allclose(got["bleu"], expected, rtol=1e-6)
  assert 0.0 < got["bleu"] < 100.0
  np.testing.assert_allclose(metrics.bleu(REFS, REFS)["bleu"], 100.0, rtol=1e-6)


def test_rouge_matches_rouge_score_with_t5_settings():
  keys = ["rouge1", "rouge2", "rougeLsum"]
  scorer = rouge_scorer.RougeScorer(keys)
  agg = scoring.BootstrapAggregator()
  for ref, pred in zip(REFS, PREDS):
    agg.add_scores(scorer.score(target=ref.replace(" . ", " .\n"),
                                prediction=pred.replace(" . ", " .\n")))
  np.random.seed(0)
  expected = agg.aggregate()
  np.random.seed(123)
  before = np.random.get_state()[1].copy()
  got = metrics.rouge(REFS, PREDS)
  np.testing.assert_array_equal(np.random.get_state()[1], before)  # global state untouched
  assert set(got) == set(keys)
  for k in keys:
    np.testing.assert_allclose(got[k], expected[k].mid.fmeasure * 100, rtol=1e-6)
  # " . " ends a sentence for rougeLsum: swapped sentences still match completely.
  ref, pred = "the cat sat . a dog ran", "a dog ran . the cat sat"
  np.testing.assert_allclose(metrics.rouge([ref], [pred])["rougeLsum"], 100.0, rtol=1e-6)
  unsplit = rouge_scorer.RougeScorer(["rougeLsum"]).score(ref, pred)["rougeLsum"].fmeasure
  assert unsplit < 0.6
  np.testing.assert_allclose(metrics.rouge(REFS, REFS)["rouge2"], 100.0, rtol=1e-6)


def test_metric_input_errors():
  with pytest.raises(ValueError, match="as many targets"):
    metrics.bleu(["a"], ["a", "b"])
  with pytest.raises(ValueError, match="as many targets"):
    metrics.rouge([], [])


def test_quality_merges_metric_dicts():
  got = metrics.quality([metrics.bleu, lambda t, p: {"n": len(p)}], REFS, PREDS)
  assert set(got) == {"bleu", "n"} and got["n"] == 4.0


def test_acceptance_statistics():
  got = metrics.acceptance(accepted=[3, 5], decisions=[6, 6], min_pq_sum=[2.5, 4.5],
                           target_calls=[4, 2], lengths=[7, 8])
  np.testing.assert_allclose(got["alpha_observed"], 8 / 12)
  np.testing.assert_allclose(got["alpha_estimated"], 7 / 12)
  np.testing.assert_allclose(got["tokens_per_target_call"], 15 / 6)
  np.testing.assert_allclose(got["accepted_per_target_call"], 8 / 6)
  assert got["decisions"] == 12 and got["target_calls"] == 6
  with pytest.raises(ValueError, match="inconsistent"):
    metrics.acceptance(accepted=[3], decisions=[2], min_pq_sum=[1.0], target_calls=[1],
                       lengths=[1])


def test_first_call_split():
  # rows: 3 calls making 7 tokens (4 on the first), 1 call making 2, no call at all
  got = metrics.first_call_split(first_call_tokens=[4, 2, 0], target_calls=[3, 1, 0],
                                 lengths=[7, 2, 0])
  np.testing.assert_allclose(got["tokens_first_call"], 3.0)
  np.testing.assert_allclose(got["tokens_per_later_call"], 3 / 2)
  one_call = metrics.first_call_split(first_call_tokens=[2], target_calls=[1], lengths=[2])
  assert one_call["tokens_first_call"] == 2.0 and np.isnan(one_call["tokens_per_later_call"])
  for bad in (dict(first_call_tokens=[0], target_calls=[2], lengths=[3]),
              dict(first_call_tokens=[4], target_calls=[2], lengths=[3]),
              dict(first_call_tokens=[1], target_calls=[0], lengths=[0])):
    with pytest.raises(ValueError, match="inconsistent"):
      metrics.first_call_split(**bad)


def test_identical_fraction():
  assert metrics.identical_fraction([[1, 2], [3], [4, 1]], [[1, 2], [3, 1], [4, 1]]) == 2 / 3
  with pytest.raises(ValueError):
    metrics.identical_fraction([[1]], [])


def test_per_position_acceptance():
  assert metrics.per_position_acceptance([3, 2, 0], [4, 4, 0]) == [0.75, 0.5, None]
  with pytest.raises(ValueError):
    metrics.per_position_acceptance([3], [2])


def test_timed_runs_warmup_and_repeats():
  calls = []
  t = timing.timed(lambda: calls.append(1) or jax.numpy.ones(3) * len(calls), repeats=3,
                   warmup=2)
  assert len(calls) == 5 and len(t.seconds) == 3
  np.testing.assert_array_equal(np.asarray(t.result), [5.0, 5.0, 5.0])
  assert t.median == sorted(t.seconds)[1]
  with pytest.raises(ValueError):
    timing.timed(lambda: None, repeats=0)


def test_step_time_runs_for_any_decoder():
  enc = np.array([[5, 6, 7, 1], [8, 1, 0, 0]], np.int32)
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  params = model.init(jax.random.PRNGKey(0))
  for m, p in ((model, params),
               (ngram.NGramDecoder(vocab_size=64, order=2),
                ngram.fit([[3, 4, 1]], order=2, vocab_size=64, smoothing=1.0))):
    s = timing.step_time(m, p, enc, num_tokens=3, cache_length=8, repeats=2, warmup=1)
    assert isinstance(s, float) and np.isfinite(s)
    s = timing.step_time(m, p, enc, num_tokens=3, cache_length=8, repeats=2, warmup=1,
                         marginal=False, compiler_options={})
    assert isinstance(s, float) and s > 0
  with pytest.raises(ValueError, match="num_tokens"):
    timing.step_time(model, params, enc, num_tokens=9, cache_length=8)


def test_timed_repeats_take_turns_between_decoders():
  """timing_repeats rounds call every decoder once each, in reverse order every other round
  (so a drift in the machine's speed falls on all alike); each keeps its last result and the
  median of its times."""
  seen = []
  def call(name):
    def f():
      seen.append(name)
      return (name, seen.count(name))
    return f
  outputs, seconds = timing.timed_in_turns({"autoregressive": call("autoregressive"),
                                           "speculative": call("speculative")}, 3)
  assert seen == ["autoregressive", "speculative", "speculative", "autoregressive",
                  "autoregressive", "speculative"]
  assert outputs == {"autoregressive": ("autoregressive", 3), "speculative": ("speculative", 3)}
  assert set(seconds) == {"autoregressive", "speculative"}
  assert all(isinstance(v, float) and v >= 0 for v in seconds.values())
  with pytest.raises(ValueError, match="repeats >= 1"):
    timing.timed_in_turns({"a": call("a")}, 0)
