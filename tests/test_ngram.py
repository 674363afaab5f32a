"""n-gram drafters: exact counts, the Decoder protocol, and exactness inside speculative decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from spec_decode import decoding
from spec_decode.models import base, ngram, t5, testing

TOY = [[3, 4, 1], [3, 5, 1], [4, 4, 4, 1], [5, 1]]


def test_unigram_probabilities_equal_counts():
  params = ngram.fit(TOY, order=1, vocab_size=6)
  # tokens: 3 x2, 4 x4, 5 x2, EOS x4 -> total 12
  expected = np.array([0, 4, 0, 2, 4, 2]) / 12
  np.testing.assert_allclose(np.exp(np.asarray(params["log_probs"])), expected, atol=1e-6)
  assert float(params["log_probs"][0]) == ngram.LOG_ZERO


def test_bigram_probabilities_equal_counts_with_backoff():
  p = np.exp(np.asarray(ngram.fit(TOY, order=2, vocab_size=6)["log_probs"]))
  np.testing.assert_allclose(p[0], [0, 0, 0, 2 / 4, 1 / 4, 1 / 4], atol=1e-6)  # after BOS
  np.testing.assert_allclose(p[3], [0, 0, 0, 0, 1 / 2, 1 / 2], atol=1e-6)
  np.testing.assert_allclose(p[4], [0, 2 / 4, 0, 0, 2 / 4, 0], atol=1e-6)
  np.testing.assert_allclose(p[5], [0, 1, 0, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(p[2], [0, 4, 0, 2, 4, 2] / np.float64(12), atol=1e-6)  # unseen
  smoothed = np.exp(np.asarray(ngram.fit(TOY, order=2, vocab_size=6, smoothing=1.0)["log_probs"]))
  np.testing.assert_allclose(smoothed[5], np.array([1, 3, 1, 1, 1, 1]) / 8, atol=1e-6)
  # Tokens after the first EOS are ignored.
  np.testing.assert_array_equal(ngram.counts([[3, 1, 4, 4]], order=1, vocab_size=6),
                                [0, 1, 0, 1, 0, 0])


def test_decoder_protocol_chunks_and_rewind():
  draft = ngram.NGramDecoder(vocab_size=6, order=2)
  assert isinstance(draft, base.Decoder) and hash(draft) == hash(ngram.NGramDecoder(6, 2))
  params = ngram.fit(TOY, order=2, vocab_size=6)
  enc = np.array([[3, 4, 0], [5, 0, 0]], np.int32)
  cache = draft.init_cache(params, draft.encode(params, enc), 8)
  assert isinstance(cache, base.Cache) and cache.max_length == 8
  tokens = np.array([[0, 3, 4], [0, 5, 5]], np.int32)
  out = draft.decode(params, cache, tokens)
  whole, c_whole = out.logits, out.cache
  out = draft.decode(params, cache, tokens[:, :1])
  l1, c = out.logits, out.cache
  out = draft.decode(params, c, tokens[:, 1:])
  l2, c = out.logits, out.cache
  np.testing.assert_array_equal(np.concatenate([l1, l2], 1), whole)
  np.testing.assert_array_equal(c.lengths, [3, 3])
  np.testing.assert_array_equal(whole, np.asarray(params["log_probs"])[tokens])
  np.testing.assert_array_equal(c_whole.rewind(jnp.array([1, 2])).lengths, [1, 2])
  uni = ngram.NGramDecoder(vocab_size=6, order=1)
  up = ngram.fit(TOY, order=1, vocab_size=6)
  logits = uni.forward(up, enc, tokens)
  assert logits.shape == (2, 3, 6)
  np.testing.assert_array_equal(logits[1, 2], up["log_probs"])


def test_bad_arguments():
  with pytest.raises(ValueError, match="order"):
    ngram.NGramDecoder(vocab_size=6, order=3)
  with pytest.raises(ValueError, match="vocab_size"):
    ngram.NGramDecoder(vocab_size=1)
  draft = ngram.NGramDecoder(vocab_size=6)
  cache = draft.init_cache({}, jnp.zeros((1,), jnp.int32), 4)
  with pytest.raises(ValueError, match="log_probs"):
    draft.decode({"log_probs": jnp.zeros((6,))}, cache, np.zeros((1, 1), np.int32))
  with pytest.raises(ValueError, match="no tokens"):
    ngram.fit([], order=1, vocab_size=6)


def _markov_target(V=6):
  target = testing.MarkovDecoder(vocab_size=V, order=2)
  params = target.init(jax.random.PRNGKey(3), scale=1.5, source_scale=0.5)
  return target, params


def test_speculative_with_bigram_draft_is_exact():
  target, tparams = _markov_target()
  enc = np.array([[2, 3, 4]], np.int32)
  s = decoding.Sampling(temperature=1.0)
  # Fit the bigram on target samples.
  n = ex.rows(1 / 10)
  samples = decoding.autoregressive(target, tparams, np.repeat(enc, 256, 0), max_decode_len=4,
                                    sampling=s, rng=jax.random.PRNGKey(1))
  dparams = ngram.fit(testing.sequences(samples), order=2, vocab_size=6, smoothing=0.1)
  draft = ngram.NGramDecoder(vocab_size=6, order=2)
  r = decoding.speculative(target, tparams, draft, dparams, np.repeat(enc, n, 0), gamma=3,
                           max_decode_len=4, sampling=s, rng=jax.random.PRNGKey(7))
  law = testing.sequence_distribution(target, tparams, enc, max_decode_len=4, sampling=s)[0]
  fit = testing.chi_square([testing.sequences(r)], [law])
  assert fit.impossible == 0 and fit.p_value > 1e-3, fit
  accepted = np.asarray(r.stats.accepted).sum() / np.asarray(r.stats.decisions).sum()
  alpha = np.asarray(r.stats.min_pq_sum).sum() / np.asarray(r.stats.decisions).sum()
  assert accepted > 0.2  # the fitted bigram is a useful draft for this chain
  np.testing.assert_allclose(accepted, alpha, atol=0.03)


@pytest.mark.parametrize("order", [1, 2])
def test_greedy_speculative_with_ngram_draft_equals_autoregressive(order):
  cfg = t5.T5Config.preset("t5_1_1_tiny")
  target = t5.T5(cfg)
  tparams = target.init(jax.random.PRNGKey(0))
  enc = np.random.default_rng(0).integers(2, cfg.vocab_size, (4, 5)).astype(np.int32)
  rng = np.random.default_rng(1)
  corpus = [list(rng.integers(1, cfg.vocab_size, 6)) for _ in range(50)]
  draft = ngram.NGramDecoder(vocab_size=cfg.vocab_size, order=order)
  dparams = ngram.fit(corpus, order=order, vocab_size=cfg.vocab_size, smoothing=0.5)
  ar = decoding.autoregressive(target, tparams, enc, max_decode_len=10)
  sp = decoding.speculative(target, tparams, draft, dparams, enc, gamma=3, max_decode_len=10)
  np.testing.assert_array_equal(sp.tokens, ar.tokens)
  np.testing.assert_array_equal(sp.lengths, ar.lengths)
