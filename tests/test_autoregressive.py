"""Autoregressive baseline: greedy oracle, sampled distribution, batch independence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import exactness as ex
from spec_decode import decoding
from spec_decode.decoding import Sampling, runner
from spec_decode.models import base, t5


@pytest.fixture(scope="module")
def tiny():
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  return model, model.init(jax.random.PRNGKey(7))


def _enc(vocab, batch, seed=0, src=8):
  rs = np.random.RandomState(seed)
  enc = rs.randint(2, vocab, (batch, src)).astype(np.int32)
  for b in range(batch):
    enc[b, rs.randint(2, src + 1):] = 0
  return enc


def _eos_heavy():
  """The tiny T5 with EOS's logit scaled up: rows end at different steps."""
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  params = model.init(jax.random.PRNGKey(11))
  dense = params["decoder"]["logits_dense"]["kernel"]
  params["decoder"]["logits_dense"]["kernel"] = dense.at[:, t5.EOS_ID].multiply(4.0)
  return model, params


def _check_layout(result, max_len):
  """Outputs are 0 after each row's end; the end is EOS or the length limit."""
  tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
  for row, n in zip(tokens, lengths):
    assert 1 <= n <= max_len
    assert not row[n:].any()
    eos = np.flatnonzero(row[:n] == t5.EOS_ID)
    if eos.size:
      assert eos[0] == n - 1
    else:
      assert n == max_len


def test_greedy_equals_argmax_of_teacher_forcing(tiny):
  model, params = tiny
  enc = _enc(model.config.vocab_size, 4)
  L = 10
  r = decoding.autoregressive(model, params, enc, max_decode_len=L)
  _check_layout(r, L)
  # Oracle without a cache: extend greedily with forward() on the whole prefix.
  prefix = np.zeros((4, 1), np.int32)
  for _ in range(L):
    logits = model.forward(params, enc, prefix)
    prefix = np.concatenate([prefix, np.argmax(logits[:, -1], -1)[:, None]], 1)
  for b in range(4):
    n = int(r.lengths[b])
    np.testing.assert_array_equal(r.tokens[b, :n], prefix[b, 1:n + 1])
  np.testing.assert_array_equal(r.stats.target_calls, r.lengths)


def test_eos_stops_rows_independently():
  """Force EOS by making its logit dominate for some inputs: rows stop at different steps."""
  model, params = _eos_heavy()
  enc = _enc(model.config.vocab_size, 16, seed=3)
  r = decoding.autoregressive(model, params, enc, max_decode_len=12,
                              sampling=Sampling(temperature=1.0), rng=jax.random.PRNGKey(0))
  _check_layout(r, 12)
  assert len(set(np.asarray(r.lengths).tolist())) > 1


def test_finished_rows_stop_growing_their_cache():
  """The loop body decodes every row of the batch, but a finished row's cache is rewound:
  its filled slots stay at its length (the tokens it consumed), so its attention does not
  read one more slot per later step while slower rows go on."""
  model, params = _eos_heavy()
  enc = jnp.asarray(_enc(model.config.vocab_size, 16, seed=3))
  L = 12
  ctx = runner.LoopContext(
      target=model, target_params=base.decoding_params(model, params), draft=None,
      draft_params=None, encoder_tokens=enc, draft_encoder_tokens=None,
      rng=jax.random.PRNGKey(0), row_ids=jnp.arange(16, dtype=jnp.int32),
      max_decode_len=L, sampling=Sampling(temperature=1.0))
  parts = decoding.Autoregressive().loop_parts(ctx)
  body = jax.jit(parts.make_body(parts.ctx))
  s = parts.init
  for _ in range(L):
    s = body(s)
    np.testing.assert_array_equal(s.cache.lengths, s.lengths)
  lengths = np.asarray(s.lengths)
  assert np.asarray(s.done).all() and lengths.min() < L  # some rows finished early


@pytest.mark.slow
def test_sampled_pairs_follow_model_distribution():
  """The (first, second) token pair frequencies match the model's exact joint law."""
  cfg = t5.T5Config.preset("t5_1_1_tiny", vocab_size=6)
  model = t5.T5(cfg)
  params = model.init(jax.random.PRNGKey(2))
  s = Sampling(temperature=1.0)
  V, n = cfg.vocab_size, ex.rows()
  enc1 = np.array([[3, 4, 5, 2]], np.int32)
  r = decoding.autoregressive(model, params, np.repeat(enc1, n, 0), max_decode_len=2,
                              sampling=s, rng=jax.random.PRNGKey(5))
  # Exact joint: p(a) * p(b | a), with b = "stopped" (0 count) when a is EOS.
  first = np.asarray(s.probs(model.forward(params, enc1, np.zeros((1, 1), np.int32))))[0, 0]
  dec = np.stack([np.zeros(V, np.int32), np.arange(V, dtype=np.int32)], 1)
  second = np.asarray(s.probs(model.forward(params, np.repeat(enc1, V, 0), dec)))[:, 1]
  exact = first[:, None] * second
  exact[t5.EOS_ID] = 0
  exact[t5.EOS_ID, 0] = first[t5.EOS_ID]  # after EOS the output pads with 0
  toks = np.asarray(r.tokens)
  counts = np.zeros((V, V))
  np.add.at(counts, (toks[:, 0], toks[:, 1]), 1)
  exact = exact.astype(np.float64)
  exact /= exact.sum()
  keep = exact.ravel() > 0
  assert counts.ravel()[~keep].sum() == 0
  chi2 = scipy_stats.chisquare(counts.ravel()[keep], exact.ravel()[keep] * n)
  assert chi2.pvalue > 1e-3, chi2


@pytest.mark.slow
def test_row_independent_of_batch_neighbours(tiny):
  model, params = tiny
  V = model.config.vocab_size
  enc = _enc(V, 6, seed=4)
  kw = dict(max_decode_len=9, sampling=Sampling(temperature=1.0, top_k=20),
            rng=jax.random.PRNGKey(3))
  full = decoding.autoregressive(model, params, enc, **kw)
  alone = decoding.autoregressive(model, params, enc[3:4], row_ids=[3], **kw)
  np.testing.assert_array_equal(alone.tokens[0], full.tokens[3])
  other = enc.copy()
  other[[0, 1, 2, 4, 5]] = _enc(V, 5, seed=99)
  shuffled = decoding.autoregressive(model, params, other, **kw)
  np.testing.assert_array_equal(shuffled.tokens[3], full.tokens[3])
  # Different row ids give different samples (the key really depends on the row id).
  moved = decoding.autoregressive(model, params, enc[3:4], row_ids=[4], **kw)
  assert not np.array_equal(moved.tokens[0], full.tokens[3])


def test_argument_errors(tiny):
  model, params = tiny
  enc = _enc(model.config.vocab_size, 2)
  with pytest.raises(ValueError, match="max_decode_len"):
    decoding.autoregressive(model, params, enc, max_decode_len=0)
  with pytest.raises(ValueError, match="rng is required"):
    decoding.autoregressive(model, params, enc, max_decode_len=3, sampling=Sampling(1.0))
  with pytest.raises(ValueError, match="row_ids"):
    decoding.autoregressive(model, params, enc, max_decode_len=3, row_ids=[1, 2, 3])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    decoding.autoregressive(model, params, enc + 100, max_decode_len=3)
  # float ids were cast to int32 (0.5 -> 0: rows silently shared a random stream); ragged
  # lists gave numpy's "inhomogeneous shape" without naming the argument
  for ids in (np.array([0.5, 1.5]), np.array([True, False]), [0.0, 1.0]):
    with pytest.raises(ValueError, match=r"row_ids must be integers \(they key each row's "):
      decoding.autoregressive(model, params, enc, max_decode_len=3, row_ids=ids,
                              sampling=Sampling(1.0), rng=jax.random.PRNGKey(0))
  decoding.autoregressive(model, params, enc, max_decode_len=2, row_ids=[3, 4])
  with pytest.raises(ValueError, match=r"encoder_tokens must be a rectangular \[batch, length\] "
                                       r"array of token ids; its rows have different lengths"):
    decoding.autoregressive(model, params, [[3, 4, 5], [6, 7]], max_decode_len=3)
  # a seed where a key belongs was a TypeError from inside JAX; missing params a TypeError
  # from inside the model; an option this jaxlib lacks a raw JaxRuntimeError at compile time
  for seed in (3, 1.5, np.int32(3)):
    with pytest.raises(ValueError, match="rng must be a JAX PRNG key, e.g. "):
      decoding.autoregressive(model, params, enc, max_decode_len=3, rng=seed)
  for key in (jax.random.PRNGKey(3), jax.random.key(3)):  # both kinds of key are accepted
    decoding.autoregressive(model, params, enc, max_decode_len=2, rng=key)
  with pytest.raises(ValueError, match=r"the target model needs its parameters: pass "
                                       r"target_params= \(got None\)"):
    decoding.autoregressive(model, None, enc, max_decode_len=3)
  with pytest.raises(ValueError, match="the draft model needs its parameters"):
    decoding.speculative(model, params, model, None, enc, gamma=2, max_decode_len=3)
  # a gamma above max_decode_len ran as given, sizing the cache and the verify call for
  # tokens no row may keep (the experiment config refused it, the library said nothing)
  with pytest.warns(UserWarning, match=r"gamma 4 is larger than max_decode_len 3, the most "
                                       r"tokens a row decodes: decoding with gamma 3"):
    clamped = decoding.speculative(model, params, model, params, enc, gamma=4,
                                   max_decode_len=3)
  assert clamped.stats.accepted_at.shape[-1] == 3  # K = 3 per-position counters
  three = decoding.speculative(model, params, model, params, enc, gamma=3, max_decode_len=3)
  np.testing.assert_array_equal(clamped.tokens, three.tokens)
  with pytest.raises(ValueError, match=r"compiler_options \{'xla_no_such_option': 1\}: this "
                                       r"jaxlib .* refuses one of them: .*xla_no_such_option"):
    decoding.run(decoding.Autoregressive(), model, params, enc, max_decode_len=3,
                 compiler_options={"xla_no_such_option": 1})


class TestTrimmedInputs:
  """`decoding.run` encodes inputs without their all-padding columns (`trim_inputs`)."""

  def test_input_length_buckets(self):
    row = lambda n, S=64: np.pad(np.full((1, n), 5, np.int32), ((0, 0), (0, S - n)))
    assert runner.input_length(row(5)) == 8
    assert runner.input_length(row(8)) == 8
    assert runner.input_length(row(9)) == 16
    assert runner.input_length(row(33)) == 64
    assert runner.input_length(row(3, S=6)) == 6  # never more than S
    assert runner.input_length(np.zeros((2, 64), np.int32)) == 8
    # A batch runs at its longest row; PAD inside a row does not end it.
    batch = np.concatenate([row(3), row(20)])
    batch[1, 2:19] = 0
    assert runner.input_length(batch) == 32
    trimmed = runner.trim_padding(jnp.asarray(batch))
    assert trimmed.shape == (2, 32)
    np.testing.assert_array_equal(trimmed, batch[:, :32])

  def test_traced_tokens_are_left_alone(self):
    shapes = []
    jax.jit(lambda t: shapes.append(runner.trim_padding(t).shape) or t)(
        np.zeros((2, 40), np.int32))
    assert shapes == [(2, 40)]

  @pytest.mark.slow
  def test_same_outputs_as_untrimmed(self, tiny):
    """Trimming changes only the encoder's length, so one temperature checks it (sampled)."""
    model, params = tiny
    draft = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
    dparams = draft.init(jax.random.PRNGKey(3))
    enc = np.pad(_enc(model.config.vocab_size, 3, seed=4, src=10), ((0, 0), (0, 30)))
    assert runner.input_length(enc) == 16  # the trimmed runs encode 16 of the 40 columns
    kw = dict(max_decode_len=8, sampling=Sampling(temperature=1.0),
              rng=jax.random.PRNGKey(5))
    for algo, extra in ((decoding.Autoregressive(), {}),
                        (decoding.Speculative(gamma=3), dict(draft=draft, draft_params=dparams))):
      a = decoding.run(algo, model, params, enc, **extra, **kw)
      b = decoding.run(algo, model, params, enc, trim_inputs=False, **extra, **kw)
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_array_equal(a.lengths, b.lengths)


class TestPackedInputs:
  """Rows of different lengths are encoded packed (`pack_inputs`, `base.packing_index`)."""

  def test_packing_index(self):
    tokens = np.zeros((3, 8), np.int32)
    tokens[0, :2], tokens[1, :8], tokens[2, [0, 3]] = 5, 6, 7  # a PAD inside row 2
    idx = base.packing_index(tokens)
    real = [0, 1, 8, 9, 10, 11, 12, 13, 14, 15, 16, 19]
    np.testing.assert_array_equal(idx, real + [24] * 4)  # 12 real -> P = 16, pad = B * S
    assert base.packing_index(np.full((2, 8), 5, np.int32)) is None  # nothing to save
    assert base.packing_index(tokens[:1, :2]) is None  # one trimmed row

  def test_packed_encoder_equals_padded(self, tiny):
    model, params = tiny
    enc = _enc(model.config.vocab_size, 6, seed=4, src=16)
    enc[np.argmax((enc > 0).sum(1)), 1] = 0  # a PAD inside the longest row
    idx = base.packing_index(enc)
    assert idx is not None and idx.size < enc.size
    padded, packed = model.encode(params, enc), model.encode(params, enc, packed_index=idx)
    mask = np.asarray(padded.mask)
    np.testing.assert_allclose(np.asarray(packed.hidden)[mask], np.asarray(padded.hidden)[mask],
                               atol=1e-6)
    assert not np.asarray(packed.hidden)[~mask].any()  # PAD positions: zeros
    dec = np.random.RandomState(2).randint(2, model.config.vocab_size, (6, 4))
    logits = [model.decode(params, model.init_cache(params, e, 6), dec).logits
              for e in (padded, packed)]
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5)
    with pytest.raises(ValueError, match="packed_index must be a 1-D integer array"):
      model.encode(params, enc, packed_index=np.zeros((2, 2), np.int32))

  @pytest.mark.slow
  def test_same_outputs_as_unpacked(self, tiny):
    """Packing changes only how the encoder runs, so one temperature checks it: sampled,
    where every row also draws its keys from its own row id. A compacting speculative loop
    on the packed input gives the same rows too (the T5 caches gathered as rows finish);
    its stages compile a loop body each, so it runs once, against the plain loop."""
    model, params = tiny
    draft = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
    dparams = draft.init(jax.random.PRNGKey(3))
    enc = _enc(model.config.vocab_size, 6, seed=4, src=16)
    assert runner.pack_index(model, runner.trim_padding(enc)) is not None  # packing runs
    kw = dict(max_decode_len=8, sampling=Sampling(temperature=1.0),
              rng=jax.random.PRNGKey(5))
    drafts = dict(draft=draft, draft_params=dparams)
    for algo, extra in ((decoding.Autoregressive(), {}), (decoding.Speculative(gamma=3), drafts)):
      a = decoding.run(algo, model, params, enc, **extra, **kw)
      b = decoding.run(algo, model, params, enc, pack_inputs=False, **extra, **kw)
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_array_equal(a.lengths, b.lengths)
    c = decoding.run(decoding.Speculative(gamma=3, compact_batch=True), model, params, enc,
                     **drafts, **kw)
    assert len(set(np.asarray(a.lengths).tolist())) > 1  # rows finish apart: stages shrink
    np.testing.assert_array_equal(c.tokens, a.tokens)
    np.testing.assert_array_equal(c.lengths, a.lengths)
