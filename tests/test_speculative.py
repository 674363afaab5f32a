"""Oracles of the speculative engine (DESIGN.md, correctness oracles 3-6).

* Exactness: for tiny models whose every output sequence can be enumerated, the
  empirical law of whole sequences from `decoding.speculative` matches the
  target's exact law (`testing.sequence_distribution`), by a chi-square test
  that rejects below P_REJECT; negative controls show the same test rejects the
  draft's law and the lossy lenient variant. Samples are the rows of one large
  batch with distinct row ids: rows are independent because each row's keys
  derive from (rng, row id, step) only, which the batch-independence tests check.
* Greedy identity with autoregressive decoding; near-ties are verified, not skipped.
* Batch independence, acceptance extremes, the alpha estimator, bad input, lenience.

Seeds are fixed, so every statistical test is deterministic; the p-values are
printed (pytest -s) for the record.
"""

import functools

import jax
import numpy as np
import pytest

import exactness as ex
from tiers import tiered
from spec_decode import decoding
from spec_decode.models import t5
from spec_decode.models import testing
from spec_decode.models.testing import MarkovDecoder

P_REJECT = ex.P_REJECT
SE_BOUND = 4.0  # estimator agreement: |accepted - sum beta| within this many standard errors

# ---------------------------------------------------------------------------- models
T5_V, T5_L, T5_B = 7, 3, ex.rows(2 / 3)
MK_V, MK_L, MK_B = 6, 4, ex.rows(5 / 3)
T5_ENC = np.array([[3, 4, 5, 2, 6, 0, 0], [2, 6, 3, 3, 5, 4, 2]], np.int32)  # one padded
MK_ENC = np.array([[3, 4, 5, 0], [2, 2, 0, 0], [5, 1, 4, 3]], np.int32)


def _init(model, seed):
  return model.init(jax.random.PRNGKey(seed))  # eager: cheaper than compiling a jitted init


@functools.lru_cache(maxsize=None)
def _t5_models():
  """Target T5.1.1 tiny; drafts: far (T5 1.0, 1 layer), close (perturbed target), Markov."""
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=T5_V))
  tp = _init(target, 0)
  far = t5.T5(t5.T5Config.preset("t5_tiny", vocab_size=T5_V, num_encoder_layers=1,
                                 num_decoder_layers=1))
  markov = MarkovDecoder(T5_V, order=1)
  return {"target": (target, tp),
          "far": (far, _init(far, 1)),
          "close": (target, testing.perturbed(tp, 2, 0.05)),
          "markov": (markov, markov.init(jax.random.PRNGKey(3)))}


def _disjoint_params(vocab, support, seed):
  """Order-1 Markov params whose logits exceed the rest by 8 on `support` (any context)."""
  rs = np.random.RandomState(seed)
  table = rs.normal(size=(vocab, vocab)).astype(np.float32)
  table[:, list(support)] += 8.0
  return {"table": table, "source": 0.5 * rs.normal(size=(vocab, vocab)).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def _markov_models():
  """Order-2 target; drafts: far (order 1), close (perturbed), identical; a disjoint pair."""
  target = MarkovDecoder(MK_V, order=2)
  tp = target.init(jax.random.PRNGKey(10), scale=1.5)
  far = MarkovDecoder(MK_V, order=1)
  first = MarkovDecoder(MK_V, order=1)
  return {"target": (target, tp),
          "far": (far, far.init(jax.random.PRNGKey(11))),
          "close": (target, testing.perturbed(tp, 12, 0.3)),
          "same": (target, tp),
          # top_k=3 keeps {1, 2, 3} for the target and {0, 4, 5} for the draft.
          "disjoint_target": (first, _disjoint_params(MK_V, (1, 2, 3), 13)),
          "disjoint": (first, _disjoint_params(MK_V, (0, 4, 5), 14))}


# ----------------------------------------------------------------- exactness cases
# name: (family, target key, draft key, sampling, gamma, encoder inputs used, seed, lenience)
# gamma 5 is above both families' L: `decoding.run` decodes it as gamma L (`clamp_gamma`,
# with a warning).
CASES = {
    "t5_far_t1_g3": ("t5", "target", "far", decoding.Sampling(1.0), 3, 1, 100, 1.0),
    "t5_close_t0.7_g5_2inputs": ("t5", "target", "close", decoding.Sampling(0.7), 5, 2, 101,
                                 1.0),
    "t5_markovdraft_topk3_g1": ("t5", "target", "markov", decoding.Sampling(1.0, top_k=3), 1,
                                1, 102, 1.0),
    "t5_far_topp0.8_g5": ("t5", "target", "far", decoding.Sampling(1.0, top_p=0.8), 5, 1, 103,
                          1.0),
    "mk_far_t1_g1": ("mk", "target", "far", decoding.Sampling(1.0), 1, 1, 200, 1.0),
    "mk_close_t0.7_g3_3inputs": ("mk", "target", "close", decoding.Sampling(0.7), 3, 3, 201,
                                 1.0),
    "mk_far_topk3_g5": ("mk", "target", "far", decoding.Sampling(1.0, top_k=3), 5, 1, 202,
                        1.0),
    "mk_far_topp0.85_g3": ("mk", "target", "far", decoding.Sampling(0.9, top_p=0.85), 3, 1,
                           203, 1.0),
    "mk_disjoint_topk3_g3": ("mk", "disjoint_target", "disjoint",
                             decoding.Sampling(1.0, top_k=3), 3, 1, 204, 1.0),
    # gamma 1 with L = 4: rows take 2 target calls, so the draft's catch-up on a fully
    # accepted block (its last token was never fed to the draft) is exercised.
    "mk_same_t1_g1": ("mk", "target", "same", decoding.Sampling(1.0), 1, 1, 205, 1.0),
    # Lossy (appendix A.5): a negative control, and the lenience tests' pair.
    "mk_close_t0.7_g3_lenient0.7": ("mk", "target", "close", decoding.Sampling(0.7), 3, 1, 206,
                                    0.7),
    "mk_close_t0.7_g3_exact": ("mk", "target", "close", decoding.Sampling(0.7), 3, 1, 206,
                               1.0),
}
EXACT_CASES = [n for n, c in CASES.items() if c[7] == 1.0]
FAST = ("mk_far_t1_g1",)  # the fast tier's one chi-square case of the chain verifier


def _setup(name):
  family, tkey, dkey, sampling, gamma, n_inputs, seed, lenience = CASES[name]
  models = _t5_models() if family == "t5" else _markov_models()
  enc_all, B, L = (T5_ENC, T5_B, T5_L) if family == "t5" else (MK_ENC, MK_B, MK_L)
  enc = np.repeat(enc_all[:n_inputs], B // n_inputs, axis=0)  # group g: a block of rows
  return dict(target=models[tkey], draft=models[dkey], sampling=sampling, gamma=gamma,
              enc_groups=enc_all[:n_inputs], enc=enc, L=L, rng=jax.random.PRNGKey(seed),
              lenience=lenience)


def _speculative(s, enc, row_ids):
  (target, tp), (draft, dp) = s["target"], s["draft"]
  return decoding.speculative(target, tp, draft, dp, enc, gamma=s["gamma"],
                              max_decode_len=s["L"], sampling=s["sampling"],
                              rng=s["rng"], row_ids=row_ids, lenience=s["lenience"])


@functools.lru_cache(maxsize=None)
def _run(name):
  """(setup, result, per-group samples, target laws, draft laws) of one case."""
  s = _setup(name)
  result = _speculative(s, s["enc"], np.arange(s["enc"].shape[0]))
  seqs = testing.sequences(result)
  per = len(seqs) // len(s["enc_groups"])
  groups = [seqs[g * per:(g + 1) * per] for g in range(len(s["enc_groups"]))]
  laws = {role: testing.sequence_distribution(*s[role], s["enc_groups"], max_decode_len=s["L"],
                                              sampling=s["sampling"])
          for role in ("target", "draft")}
  return s, result, groups, laws["target"], laws["draft"]


def _report(label, fit):
  print(f"\n[exactness] {label}: n={fit.samples} chi2={fit.statistic:.1f} dof={fit.dof} "
        f"p={fit.p_value:.4g} tv={fit.tv:.4f} impossible={fit.impossible}")


@pytest.mark.parametrize("name", tiered(EXACT_CASES, FAST))
def test_exact_sequence_distribution(name):
  s, _, groups, target_laws, _ = _run(name)
  fit = testing.chi_square(groups, target_laws)
  _report(f"{name} vs target", fit)
  assert fit.impossible == 0, f"{fit.impossible} samples have probability 0 under the target"
  assert fit.p_value >= P_REJECT, fit


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_far_t1_g3", "mk_far_t1_g1", "mk_far_topk3_g5"])
def test_negative_control_draft_law_is_rejected(name):
  # The same samples against the DRAFT's exact law: the test must see the difference.
  _, _, groups, _, draft_laws = _run(name)
  fit = testing.chi_square(groups, draft_laws)
  _report(f"{name} vs draft law (negative control)", fit)
  assert fit.p_value < P_REJECT, fit


@pytest.mark.slow
def test_negative_control_lenient_is_rejected():
  # Lenience 0.7 on a close draft (acceptance 0.85 -> 0.93) is lossy: rejected.
  _, _, groups, target_laws, _ = _run("mk_close_t0.7_g3_lenient0.7")
  fit = testing.chi_square(groups, target_laws)
  _report("mk_close_t0.7_g3_lenient0.7 vs target (negative control)", fit)
  assert fit.p_value < P_REJECT, fit


# ------------------------------------------------------------- batch independence
def _assert_rows_equal(big, idx, small, small_idx):
  np.testing.assert_array_equal(np.asarray(small.tokens)[small_idx],
                                np.asarray(big.tokens)[idx])
  np.testing.assert_array_equal(np.asarray(small.lengths)[small_idx],
                                np.asarray(big.lengths)[idx])
  for field in ("target_calls", "accepted", "decisions"):
    np.testing.assert_array_equal(np.asarray(getattr(small.stats, field))[small_idx],
                                  np.asarray(getattr(big.stats, field))[idx])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_close_t0.7_g5_2inputs", "mk_close_t0.7_g3_3inputs"])
def test_row_alone_equals_row_in_big_batch(name):
  """Batch 1: a row decoded alone (same row id) equals that row of the big batch."""
  s, big, _, _, _ = _run(name)
  B = s["enc"].shape[0]
  for i in (0, 1, B // 2 + 3, B - 1):
    alone = _speculative(s, s["enc"][i:i + 1], np.array([i]))
    _assert_rows_equal(big, [i], alone, [0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5_close_t0.7_g5_2inputs", "mk_close_t0.7_g3_3inputs"])
def test_row_independent_of_neighbours(name):
  s, big, _, _, _ = _run(name)
  B = s["enc"].shape[0]
  idx = np.array([B - 1, 7, B // 2, 2])
  # Rows in another order, among neighbours with other inputs and row ids.
  rs = np.random.RandomState(0)
  strangers = rs.randint(2, s["target"][0].vocab_size, (3, s["enc"].shape[1])).astype(np.int32)
  enc = np.concatenate([strangers[:2], s["enc"][idx], strangers[2:]])
  row_ids = np.concatenate([[B + 5, B + 9], idx, [B + 1]])
  mixed = _speculative(s, enc, row_ids)
  _assert_rows_equal(big, idx, mixed, np.arange(2, 6))


# ---------------------------------------------------------- acceptance statistics
def _totals(result):
  st = result.stats
  return (int(np.sum(st.accepted)), int(np.sum(st.decisions)), float(np.sum(st.min_pq_sum)),
          int(np.sum(st.target_calls)), int(np.sum(st.draft_tokens)))


@pytest.mark.parametrize("name", tiered(
    [n for n in CASES if n not in ("mk_same_t1_g1", "mk_disjoint_topk3_g3")], FAST))
def test_alpha_estimator_matches_acceptance_rate(name):
  """sum of beta over decisions vs accepted count: a martingale, so
  Var(accepted - sum beta) = E[sum beta (1 - beta)] <= D a (1 - a) (a = mean beta, Jensen)."""
  s, result, _, _, _ = _run(name)
  accepted, decisions, beta_sum, calls, drafted = _totals(result)
  a = beta_sum / decisions
  se = np.sqrt(decisions * a * (1 - a))
  print(f"\n[alpha] {name}: decisions={decisions} observed={accepted / decisions:.4f} "
        f"estimated={a:.4f} |diff|/se={abs(accepted - beta_sum) / se:.2f}")
  assert 0.0 < a < 1.0
  assert abs(accepted - beta_sum) <= SE_BOUND * se
  assert drafted == min(s["gamma"], s["L"]) * calls  # (a gamma above L decodes as L)
  assert np.all(np.asarray(result.stats.decisions) <= np.asarray(result.stats.draft_tokens))


@pytest.mark.slow
def test_identical_draft_accepts_everything():
  s, result, _, _, _ = _run("mk_same_t1_g1")
  g, st = s["gamma"], result.stats
  calls, lengths = np.asarray(st.target_calls), np.asarray(result.lengths)
  np.testing.assert_array_equal(st.accepted, g * calls)
  np.testing.assert_array_equal(st.decisions, g * calls)
  np.testing.assert_allclose(st.min_pq_sum, st.decisions, rtol=1e-5)
  # gamma + 1 tokens per target call, except in a row's last call.
  np.testing.assert_array_equal(calls, -(-lengths // (g + 1)))
  assert np.any(calls == 1) and np.any(calls == 2)
  np.testing.assert_array_equal(st.first_call_tokens, np.minimum(lengths, g + 1))


@pytest.mark.slow
def test_disjoint_supports_accept_nothing():
  s, result, _, _, _ = _run("mk_disjoint_topk3_g3")
  st, lengths = result.stats, np.asarray(result.lengths)
  np.testing.assert_array_equal(st.accepted, 0)
  np.testing.assert_array_equal(st.min_pq_sum, 0.0)
  np.testing.assert_array_equal(st.decisions, st.target_calls)  # one rejection per call
  np.testing.assert_array_equal(st.target_calls, lengths)       # one token per call
  np.testing.assert_array_equal(st.first_call_tokens, 1)
  produced = np.asarray(result.tokens)[np.arange(s["L"])[None, :] < lengths[:, None]]
  assert set(np.unique(produced)) == {1, 2, 3}  # exactly the target's support


@pytest.mark.slow
def test_lenience_raises_acceptance_and_is_lossy():
  _, lenient, groups_l, laws, _ = _run("mk_close_t0.7_g3_lenient0.7")
  _, exact, groups_e, laws_e, _ = _run("mk_close_t0.7_g3_exact")
  acc_l, dec_l, _, calls_l, _ = _totals(lenient)
  acc_e, dec_e, _, calls_e, _ = _totals(exact)
  rate_l, rate_e = acc_l / dec_l, acc_e / dec_e
  se = np.sqrt(rate_l * (1 - rate_l) / dec_l + rate_e * (1 - rate_e) / dec_e)
  print(f"\n[lenience] acceptance l=1: {rate_e:.4f}, l=0.7: {rate_l:.4f}; tokens per call "
        f"{np.sum(exact.lengths) / calls_e:.3f} -> {np.sum(lenient.lengths) / calls_l:.3f}")
  assert rate_l - rate_e > SE_BOUND * se
  assert calls_l < calls_e
  # Same keys, same models: only the rule differs, and the outputs' law moves.
  exact_fit = testing.chi_square(groups_e, laws_e)
  lenient_fit = testing.chi_square(groups_l, laws)
  assert exact_fit.p_value >= P_REJECT and lenient_fit.p_value < P_REJECT
  assert lenient_fit.tv > exact_fit.tv


# ----------------------------------------------------------------- greedy identity
G_V, G_L, G_S, G_N = 64, 12, 10, 64


@functools.lru_cache(maxsize=None)
def _greedy_setup():
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))  # vocab 64, float32
  tp = _init(target, 20)
  v10 = t5.T5(t5.T5Config.preset("t5_tiny", num_encoder_layers=1, num_decoder_layers=1))
  narrow = t5.T5(t5.T5Config.preset("t5_1_1_tiny", emb_dim=16, num_heads=2, head_dim=8,
                                    mlp_dim=24, num_encoder_layers=1, num_decoder_layers=3))
  markov = MarkovDecoder(G_V, order=2)
  drafts = {  # gamma: draft of another architecture (or the target itself)
      1: (v10, _init(v10, 21)),
      2: (markov, markov.init(jax.random.PRNGKey(22))),
      3: (target, testing.perturbed(tp, 23, 0.05)),
      4: (narrow, _init(narrow, 24)),
      5: (target, tp),
  }
  rs = np.random.RandomState(25)
  enc = rs.randint(2, G_V, (G_N, G_S)).astype(np.int32)
  for row, n in enumerate(rs.randint(1, G_S + 1, G_N)):
    enc[row, n:] = 0
  ar = [decoding.autoregressive(target, tp, enc[i:i + 8], max_decode_len=G_L)
        for i in range(0, G_N, 8)]
  ar_tokens = np.concatenate([np.asarray(r.tokens) for r in ar])
  ar_lengths = np.concatenate([np.asarray(r.lengths) for r in ar])
  return target, tp, drafts, enc, ar_tokens, ar_lengths


def _check_greedy_rows(target, tp, enc, rows, got_tokens, got_lengths, ar_tokens, ar_lengths):
  """Rows must match; a mismatch is allowed only at a verified logit near-tie."""
  near_ties = 0
  for k, row in enumerate(rows):
    want = tuple(ar_tokens[row, :ar_lengths[row]])
    got = tuple(got_tokens[k, :got_lengths[k]])
    if want == got:
      continue
    t = next(i for i in range(min(len(want), len(got)) + 1)
             if i == min(len(want), len(got)) or want[i] != got[i])
    prefix = np.array([[t5.BOS_ID, *want[:t]]], np.int32)
    logits = np.asarray(target.forward(tp, enc[row:row + 1], prefix))[0, t]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < 1e-4, (
        f"row {row}: greedy speculative {got} != autoregressive {want} at position {t}, "
        f"and the top-2 logit gap there is {top2[1] - top2[0]:.3g} (not a near-tie)")
    near_ties += 1
  return near_ties


@pytest.mark.parametrize("gamma", tiered([1, 2, 3, 4, 5], fast=(3,)))
def test_greedy_equals_autoregressive_batch8(gamma):
  target, tp, drafts, enc, ar_tokens, ar_lengths = _greedy_setup()
  draft, dp = drafts[gamma]
  ties = 0
  for i in range(0, G_N, 8):
    r = decoding.speculative(target, tp, draft, dp, enc[i:i + 8], gamma=gamma,
                             max_decode_len=G_L)
    ties += _check_greedy_rows(target, tp, enc, range(i, i + 8), np.asarray(r.tokens),
                               np.asarray(r.lengths), ar_tokens, ar_lengths)
    if gamma == 5:  # the target as its own draft
      np.testing.assert_array_equal(r.stats.accepted, gamma * np.asarray(r.stats.target_calls))
  print(f"\n[greedy] gamma={gamma} draft={type(draft).__name__}: {G_N} rows, "
        f"{ties} near-tie mismatches")


# batch 1 costs one compile per gamma
@pytest.mark.parametrize("gamma", tiered([1, 2, 4], fast=(1,)))
def test_greedy_equals_autoregressive_batch1(gamma):
  target, tp, drafts, enc, ar_tokens, ar_lengths = _greedy_setup()
  draft, dp = drafts[gamma]
  rows = range(0, G_N, 8)
  got = [decoding.speculative(target, tp, draft, dp, enc[i:i + 1], gamma=gamma,
                              max_decode_len=G_L) for i in rows]
  _check_greedy_rows(target, tp, enc, rows, np.concatenate([np.asarray(r.tokens) for r in got]),
                     np.concatenate([np.asarray(r.lengths) for r in got]), ar_tokens,
                     ar_lengths)


def test_greedy_checker_rejects_a_real_mismatch():
  # The near-tie allowance must not excuse an ordinary difference.
  target, tp, _, enc, ar_tokens, ar_lengths = _greedy_setup()
  assert ar_lengths[0] > 2
  wrong = ar_tokens[:1].copy()
  wrong[0, 2] = (wrong[0, 2] + 1) % G_V
  with pytest.raises(AssertionError, match="not a near-tie"):
    _check_greedy_rows(target, tp, enc, [0], wrong, ar_lengths[:1], ar_tokens, ar_lengths)
  assert _check_greedy_rows(target, tp, enc, [0], ar_tokens[:1], ar_lengths[:1], ar_tokens,
                            ar_lengths) == 0


def test_greedy_outputs_are_not_trivial():
  # Guards the identity tests: varied lengths and tokens, some rows ending at EOS.
  _, _, _, _, ar_tokens, ar_lengths = _greedy_setup()
  assert len({tuple(r[:n]) for r, n in zip(ar_tokens, ar_lengths)}) > G_N // 2
  assert len(np.unique(ar_tokens)) > 10


# ---------------------------------------------------------------------- bad input
def _bad(**overrides):
  models = _markov_models()
  (target, tp), (draft, dp) = models["target"], models["far"]
  kwargs = dict(gamma=2, max_decode_len=3, sampling=decoding.Sampling(1.0),
                rng=jax.random.PRNGKey(0))
  kwargs.update(overrides)
  draft, dp = kwargs.pop("draft", (draft, dp))
  return decoding.speculative(target, tp, draft, dp, MK_ENC, **kwargs)


@pytest.mark.parametrize("overrides,match", [
    (dict(gamma=0), "gamma"),
    (dict(gamma=-3), "gamma"),
    (dict(gamma=2.0), "gamma"),
    (dict(gamma=True), "gamma"),
    (dict(max_decode_len=0), "max_decode_len"),
    (dict(max_decode_len=2.5), "max_decode_len"),
    (dict(lenience=0.0), "lenience"),
    (dict(lenience=1.5), "lenience"),
    (dict(lenience=-0.5), "lenience"),
    (dict(lenience=float("nan")), "lenience"),
    (dict(rng=None), "rng"),
    (dict(row_ids=np.arange(2)), "row_ids"),
])
def test_bad_arguments(overrides, match):
  with pytest.raises(ValueError, match=match):
    _bad(**overrides)


def test_vocab_mismatch():
  other = MarkovDecoder(MK_V + 1)
  with pytest.raises(ValueError, match="vocab"):
    _bad(draft=(other, other.init(jax.random.PRNGKey(0))))


def test_draft_encoder_tokens():
  # The draft may read its own encoder input (here: the same content, padded longer);
  # the Markov draft's conditioning ignores padding, so the outputs must not change.
  models = _markov_models()
  (target, tp), (draft, dp) = models["target"], models["far"]
  run = lambda **kw: decoding.speculative(target, tp, draft, dp, MK_ENC, gamma=2,
                                          max_decode_len=MK_L, sampling=decoding.Sampling(1.0),
                                          rng=jax.random.PRNGKey(7), **kw)
  padded = np.pad(MK_ENC, ((0, 0), (0, 3)))
  a, b = run(), run(draft_encoder_tokens=padded)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.stats.accepted, b.stats.accepted)
  with pytest.raises(ValueError, match="draft_encoder_tokens"):
    run(draft_encoder_tokens=padded[:2])
  with pytest.raises(ValueError, match="draft_encoder_tokens"):
    run(draft_encoder_tokens=padded + MK_V)


# --------------------------------------------------------- the test doubles themselves
def test_markov_decode_chunks_rewinds_match_forward():
  model = MarkovDecoder(5, order=2)
  params = model.init(jax.random.PRNGKey(30))
  enc = np.array([[2, 3, 0], [4, 4, 4]], np.int32)
  dec = np.array([[0, 2, 4, 1, 3, 3], [0, 3, 3, 2, 1, 4]], np.int32)
  full = np.asarray(model.forward(params, enc, dec))
  cache = model.init_cache(params, model.encode(params, enc), 8)
  # Ragged: row 0 takes 1 token, row 1 takes 2 (its first two), via a rewind.
  out = model.decode(params, cache, dec[:, :2])
  logits, cache = out.logits, out.cache
  np.testing.assert_array_equal(logits, full[:, :2])
  cache = cache.rewind(np.array([1, 2]))
  # Feed a wrong token at row 0's position 1, rewind, then re-feed the right ones.
  out = model.decode(params, cache, np.array([[4], [2]], np.int32))
  _, cache = out.logits, out.cache
  cache = cache.rewind(np.array([1, 2]))
  out = model.decode(params, cache, np.stack([dec[0, 1:3], dec[1, 2:4]]))
  logits, cache = out.logits, out.cache
  np.testing.assert_array_equal(logits[0], full[0, 1:3])
  np.testing.assert_array_equal(logits[1], full[1, 2:4])
  np.testing.assert_array_equal(cache.lengths, [3, 4])
  # Hand-computed: logits after position t = table[s_{t-1}, s_t] + mean source rows.
  bias = (params["source"][2] + params["source"][3]) / 2
  np.testing.assert_allclose(full[0, 3], params["table"][4, 1] + bias, rtol=1e-6)
  np.testing.assert_allclose(full[0, 0], params["table"][0, 0] + bias, rtol=1e-6)
  with pytest.raises(ValueError, match="overflows"):
    model.decode(params, cache, np.zeros((2, 5), np.int32))


def test_sequence_distribution_hand_computed_markov():
  model = MarkovDecoder(3, order=1)
  table = np.log(np.array([[1, 1, 2], [1, 1, 1], [3, 1, 0.5]], np.float32))
  params = {"table": table, "source": np.zeros((3, 3), np.float32)}
  law, = testing.sequence_distribution(model, params, np.array([[2]]), max_decode_len=2,
                                       sampling=decoding.Sampling(1.0))
  # From BOS (row 0): 0: 1/4, 1 (EOS): 1/4, 2: 1/2; then rows 0 and 2.
  want = {(1,): 0.25, (0, 0): 1 / 16, (0, 1): 1 / 16, (0, 2): 1 / 8,
          (2, 0): 0.5 * 3 / 4.5, (2, 1): 0.5 / 4.5, (2, 2): 0.25 / 4.5}
  assert set(law) == set(want)
  np.testing.assert_allclose([law[k] for k in want], list(want.values()), rtol=1e-6)
  greedy, = testing.sequence_distribution(model, params, np.array([[2]]), max_decode_len=2,
                                          sampling=decoding.Sampling(0.0))
  assert greedy == {(2, 0): 1.0}


def test_chi_square_accepts_true_law_and_rejects_other():
  rs = np.random.RandomState(31)
  law = {(k,): w for k, w in enumerate(rs.dirichlet(np.ones(40)))}
  keys, probs = list(law), np.array(list(law.values()))
  draw = lambda pr, n: [keys[i] for i in rs.choice(len(keys), n, p=pr)]
  good = testing.chi_square([draw(probs, 20_000)], [law])
  tilted = probs * np.linspace(0.9, 1.1, len(probs))
  bad = testing.chi_square([draw(tilted / tilted.sum(), 20_000)], [law])
  assert good.p_value > P_REJECT and bad.p_value < P_REJECT
  assert testing.chi_square([[(0,), (99,)]], [law]).impossible == 1
