"""Sampling: exact adjusted distributions on hand-made logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_decode.decoding import Sampling, sample_from
from spec_decode.decoding.sampling import draw


def _softmax(x):
  e = np.exp(x - np.max(x))
  return e / e.sum()


LOGITS = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)


def test_greedy_is_one_hot_first_max():
  np.testing.assert_array_equal(Sampling(temperature=0.0).probs(LOGITS), [0, 1, 0, 0, 0])
  batch = np.stack([LOGITS, -LOGITS])
  np.testing.assert_array_equal(Sampling().probs(batch)[1], [0, 0, 0, 0, 1])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_temperature(temperature):
  np.testing.assert_allclose(Sampling(temperature=temperature).probs(LOGITS),
                             _softmax(LOGITS / temperature), rtol=1e-6, atol=1e-7)


def test_top_k_keeps_ties_of_kth():
  # k = 2: the two tokens with logit 3 survive.
  probs = Sampling(temperature=1.0, top_k=2).probs(LOGITS)
  np.testing.assert_allclose(probs, [0, 0.5, 0, 0.5, 0], atol=1e-7)
  # k = 3: logits 3, 3, 2.
  probs = Sampling(temperature=1.0, top_k=3).probs(LOGITS)
  e = np.exp([3.0, 2.0, 3.0])
  np.testing.assert_allclose(probs, [0, e[0], e[1], e[2], 0] / e.sum(), rtol=1e-6)
  # k >= V is a no-op.
  np.testing.assert_allclose(Sampling(temperature=1.0, top_k=5).probs(LOGITS),
                             _softmax(LOGITS), rtol=1e-6)


def test_top_p_keeps_token_that_crosses_threshold():
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
  # Mass before each sorted token: 0, 0.5, 0.8, 0.95.
  np.testing.assert_allclose(Sampling(temperature=1.0, top_p=0.5).probs(logits),
                             [1, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(Sampling(temperature=1.0, top_p=0.7).probs(logits),
                             [0.625, 0.375, 0, 0], rtol=1e-5)
  np.testing.assert_allclose(Sampling(temperature=1.0, top_p=0.9).probs(logits),
                             np.array([0.5, 0.3, 0.15, 0]) / 0.95, rtol=1e-5)
  # Unsorted input order gives the same per-token answer.
  perm = np.array([2, 0, 3, 1])
  np.testing.assert_allclose(Sampling(temperature=1.0, top_p=0.7).probs(logits[perm]),
                             np.array([0.625, 0.375, 0, 0])[perm], rtol=1e-5)


def test_top_k_then_top_p_then_temperature_order():
  logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
  # temperature 0.5 squares the probabilities: [.16, .09, .04, .01] / .30
  # top_k 3 drops the last: [.16, .09, .04] / .29 = [.5517, .3103, .1379]
  # top_p 0.8: mass before = [0, .5517, .8621] -> keep two: [.64, .36]
  probs = Sampling(temperature=0.5, top_k=3, top_p=0.8).probs(logits)
  np.testing.assert_allclose(probs, [0.64, 0.36, 0, 0], rtol=1e-5)


def test_probs_sum_to_one_on_batches():
  logits = jax.random.normal(jax.random.PRNGKey(0), (4, 7, 50)) * 3
  for s in [Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.6),
            Sampling(0.9, top_k=10, top_p=0.9), Sampling(0.0)]:
    np.testing.assert_allclose(jnp.sum(s.probs(logits), axis=-1), 1.0, rtol=1e-5)


def test_sample_from_frequencies():
  probs = np.array([0.1, 0.0, 0.6, 0.3], np.float32)
  n = 40_000
  draws = sample_from(jax.random.PRNGKey(1), np.broadcast_to(probs, (n, 4)))
  freq = np.bincount(np.asarray(draws), minlength=4) / n
  assert freq[1] == 0  # zero-probability tokens are never drawn
  # 5 standard errors of a binomial proportion.
  np.testing.assert_allclose(freq, probs, atol=5 * np.sqrt(0.25 / n))


@pytest.mark.parametrize("V", [50, 1536])
def test_sample_from_large_vocabularies_blocks_and_zeros(V):
  """The two-level inverse CDF: whole zero blocks, zeros inside blocks, a padded last block."""
  from scipy import stats
  rng = np.random.default_rng(V)
  p = rng.dirichlet(np.full(V, 0.3)).astype(np.float64)
  p[rng.random(V) < 0.3] = 0.0
  p[: V // 3] = 0.0  # whole blocks without mass
  p[-1] = max(p[-1], 0.05)  # mass in the (padded) last block
  p = (p / p.sum()).astype(np.float32)
  n = 100_000
  keys = jax.random.split(jax.random.PRNGKey(2), n)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sample_from(k, jnp.asarray(p))))(keys))
  counts = np.bincount(draws, minlength=V)
  assert counts[p == 0].sum() == 0
  expected = p.astype(np.float64) * n
  big = expected >= 5  # pool the rare tokens into one cell
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  keep = exp > 0
  chi2 = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
  assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3
  point = np.zeros(V, np.float32)
  point[V - 1] = 1.0  # a point mass on the very last index
  assert set(np.asarray(jax.vmap(lambda k: sample_from(k, point))(keys[:100]))) == {V - 1}


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf"), top_k=5), "temperature must be finite"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=1e-38), "below 1e-06.*use 0 for greedy"),
    (dict(temperature=5e-7), "below 1e-06.*use 0 for greedy"),
])
def test_invalid_sampling(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kwargs)


def test_smallest_allowed_temperature_gives_a_distribution():
  """At MIN_TEMPERATURE large logits still give finite probabilities (the argmax, here)."""
  from spec_decode.decoding.sampling import MIN_TEMPERATURE
  probs = Sampling(temperature=MIN_TEMPERATURE).probs(LOGITS * 1000)
  assert np.all(np.isfinite(probs))
  np.testing.assert_allclose(probs, [0, 0.5, 0, 0.5, 0], atol=1e-6)


def test_greedy_draw_equals_sampling_from_the_one_hot():
  """draw(greedy=True) takes the argmax; it must be the token sample_from would draw."""
  logits = jax.random.normal(jax.random.PRNGKey(3), (16, 50)) * 3.0
  keys = jax.random.split(jax.random.PRNGKey(4), 16)
  p = Sampling(temperature=0.0).probs(logits)
  q = Sampling(temperature=0.0).probs(jnp.roll(logits, 1, axis=0))
  residual = jnp.maximum(p - q, 0.0)
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p)
  for probs in (p, residual):
    np.testing.assert_array_equal(draw(keys, probs, greedy=True),
                                  jax.vmap(sample_from)(keys, probs))
  np.testing.assert_array_equal(draw(keys, p, greedy=True), jnp.argmax(logits, -1))
  # Not greedy: exactly the per-row sample_from draws.
  soft = Sampling(temperature=1.0).probs(logits)
  np.testing.assert_array_equal(draw(keys, soft, greedy=False),
                                jax.vmap(sample_from)(keys, soft))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_argmax_is_jnp_argmax(dtype):
  """sampling.argmax (two plain reductions) gives jnp.argmax's index everywhere: ties take the
  first, a NaN counts as the largest (the first NaN), infinities, all-equal rows, a row of
  -inf, one entry, vocabulary-sized rows, and leading axes."""
  from spec_decode.decoding.sampling import argmax
  rng = np.random.default_rng(0)
  rows = [rng.normal(size=1536) * 4, np.full(7, 2.0), np.array([1.0, 5.0, 5.0, 3.0]),
          np.array([3.0]), rng.integers(-3, 3, size=300).astype(float)]
  if jnp.issubdtype(dtype, jnp.floating):
    rows += [np.array([1.0, np.nan, 3.0, np.nan]), np.full(5, np.nan), np.full(4, -np.inf),
             np.array([np.inf, 1.0, np.inf]), np.array([-np.inf, np.nan, np.inf])]
  for row in rows:
    x = jnp.asarray(row, dtype)
    want = int(jnp.argmax(x))
    assert want == int(np.argmax(np.asarray(x, np.float64))), row
    got = argmax(x)
    assert got.dtype == jnp.int32 and int(got) == want, (row, int(got), want)
  x = jnp.asarray(rng.integers(-4, 4, size=(3, 5, 64)), dtype)  # many ties, leading axes
  np.testing.assert_array_equal(jax.jit(argmax)(x), jnp.argmax(x, axis=-1))
