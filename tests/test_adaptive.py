"""Oracles of the adaptive draft length (drafters/adaptive.py).

* Exactness: sequence-level chi-square against the target's enumerated law for
  each rule (schedule, threshold, tuned) with token-level and block
  verification, at several temperatures, top-k/top-p, near and far drafts;
  each case also checks the rule really varied the length. Negative control:
  a drafter that DROPS the low-probability token instead of stopping after it
  (its length depends on the token it drops) is rejected by the same test.
* Greedy identity with autoregressive decoding for every rule and verifier.
* The rules themselves: the schedule's lengths (1, 3, 5, 5, .. on full
  acceptance; 5, 4, .., 1 on none), the threshold rule's stop positions
  predicted from the draft's own probabilities, the tuned threshold's update,
  and the early-exit draft loop leaving a row's output independent of its batch
  and of sharding.
* Settings: bad values raise ValueError; gin builds every variant.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from tiers import tiered
from spec_decode import decoding
from spec_decode.cli import gin as gin_layer
from spec_decode.decoding.drafters import adaptive
from spec_decode.models import t5
from spec_decode.models.testing import MarkovDecoder

S = decoding.Sampling
Adaptive = decoding.AdaptiveDrafter
CHAIN, BLOCK = decoding.ChainVerifier(), decoding.BlockVerifier()


@dataclasses.dataclass(frozen=True)
class DroppingDrafter(decoding.AdaptiveDrafter):
  """WRONG on purpose (negative control): the threshold rule, but the token whose
  probability fell below the threshold is dropped from the proposal instead of kept.
  (Valid as written at temperature 1 without top-k/top-p, where q is the raw softmax.)"""

  def propose(self, ctx, state, committed, keys_BK, num):
    proposal, state = super().propose(ctx, state, committed, keys_BK, num)
    g = proposal.proposed
    last = jnp.take_along_axis(proposal.tokens, (g - 1)[:, None], axis=1)
    q_last = jnp.take_along_axis(proposal.q, (g - 1)[:, None, None], axis=1)[:, 0]
    own = jnp.take_along_axis(q_last, last, axis=1)[:, 0]
    dropped = jnp.where((own < state.threshold) & (g > 1), g - 1, g)
    return dataclasses.replace(proposal, length=dropped), state


# name: (family, draft, sampling, gamma, drafter, verifier, encoder inputs, rows, seed)
CASES = {
    "schedule_chain_mk_far_t1_g5": ("mk", "far", S(1.0), 5, Adaptive(), CHAIN, 1, ex.rows(),
                                    400),
    "schedule_block_mk_close_t0.7_g5_3inputs": ("mk", "close", S(0.7), 5, Adaptive(start=2),
                                                BLOCK, 3, ex.rows(6 / 5), 401),
    "threshold_chain_mk_far_topk3_g4": ("mk", "far", S(1.0, top_k=3), 4,
                                        Adaptive(rule="threshold", threshold=0.5), CHAIN, 1,
                                        ex.rows(), 402),
    "threshold_block_mk_far_t1_g4": ("mk", "far", S(1.0), 4,
                                     Adaptive(rule="threshold", threshold=0.3), BLOCK, 1,
                                     ex.rows(), 403),
    "tuned_chain_mk_far_t0.9_topp0.85_g4": ("mk", "far", S(0.9, top_p=0.85), 4,
                                            Adaptive(rule="tuned", threshold=0.3, step=0.2),
                                            CHAIN, 1, ex.rows(), 404),
    "tuned_block_mk_close_t1_g4": ("mk", "close", S(1.0), 4,
                                   Adaptive(rule="tuned", threshold=0.5, step=0.2), BLOCK, 1,
                                   ex.rows(), 405),
    "tuned_block_t5_far_t1_g3": ("t5", "far", S(1.0), 3,
                                 Adaptive(rule="tuned", threshold=0.3, step=0.2), BLOCK, 1,
                                 ex.rows(2 / 3), 406),
    # the negative control and its exact twin (same models, keys and threshold)
    "threshold_chain_mk_far_t1_g4": ("mk", "far", S(1.0), 4,
                                     Adaptive(rule="threshold", threshold=0.2), CHAIN, 1,
                                     ex.rows(), 407),
    "dropping_chain_mk_far_t1_g4": ("mk", "far", S(1.0), 4,
                                    DroppingDrafter(rule="threshold", threshold=0.2), CHAIN, 1,
                                    ex.rows(), 407),
}


@functools.lru_cache(maxsize=None)
def _run(name):
  fam, draft, sampling, gamma, drafter, verifier, n_inputs, rows, seed = CASES[name]
  algo = decoding.Speculative(gamma=gamma, drafter=drafter, verifier=verifier)
  result, groups = ex.sample(algo, fam, draft, sampling, rows=rows, n_inputs=n_inputs,
                             seed=seed)
  return result, groups, ex.target_laws(fam, n_inputs, sampling)


def _mean_drafted(result) -> float:
  return float(np.sum(result.stats.draft_tokens) / np.sum(result.stats.target_calls))


@pytest.mark.parametrize("name", tiered([n for n in CASES if not n.startswith("dropping")],
                                         fast=("threshold_chain_mk_far_t1_g4",)))
def test_adaptive_length_is_exact(name):
  result, groups, laws = _run(name)
  gamma = CASES[name][3]
  drafted = _mean_drafted(result)
  fit = ex.fit(f"{name} (mean drafted length {drafted:.2f} of {gamma})", groups, laws)
  assert fit.impossible == 0
  assert fit.p_value >= ex.P_REJECT, fit
  assert 1.05 < drafted < gamma - 0.05  # the rule did vary the length
  assert np.all(np.asarray(result.stats.decisions) <= np.asarray(result.stats.draft_tokens))


@pytest.mark.slow
def test_negative_control_dropping_the_low_probability_token_is_rejected():
  result, groups, laws = _run("dropping_chain_mk_far_t1_g4")
  fit = ex.fit("dropping drafter (negative control)", groups, laws)
  assert fit.p_value < ex.P_REJECT, fit


# ----------------------------------------------------------------- greedy identity
G_V, G_L, G_N = 64, 12, 16


@functools.lru_cache(maxsize=None)
def _greedy_setup():
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  tp = target.init(jax.random.PRNGKey(30))
  far = t5.T5(t5.T5Config.preset("t5_tiny", num_encoder_layers=1, num_decoder_layers=1))
  rs = np.random.RandomState(31)
  enc = rs.randint(2, G_V, (G_N, 10)).astype(np.int32)
  for row, n in enumerate(rs.randint(1, 11, G_N)):
    enc[row, n:] = 0
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=G_L)
  return target, tp, (far, far.init(jax.random.PRNGKey(32))), enc, ar


# (test_block_verification shows the block verifier equals the chain one at temperature 0)
_GREEDY_IDS = ["schedule_block", "threshold_chain", "tuned_block"]


@pytest.mark.parametrize("drafter,verifier", tiered([
    (Adaptive(start=1), BLOCK), (Adaptive(rule="threshold", threshold=0.4), CHAIN),
    (Adaptive(rule="tuned", threshold=0.4, step=0.1), BLOCK)], fast=("threshold_chain",),
    ids=_GREEDY_IDS))
def test_greedy_equals_autoregressive(drafter, verifier):
  target, tp, (dm, dp), enc, ar = _greedy_setup()
  got = decoding.run(decoding.Speculative(gamma=5, drafter=drafter, verifier=verifier), target,
                     tp, enc, draft=dm, draft_params=dp, max_decode_len=G_L)
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
  assert 1.05 < _mean_drafted(got) < 4.95, _mean_drafted(got)
  assert len({tuple(r) for r in np.asarray(ar.tokens)}) > G_N // 2


# --------------------------------------------------------------------- the rules
MK_V = 6


def _disjoint_params(support, seed):
  """Order-1 Markov params whose logits exceed the rest by 8 on `support`."""
  rs = np.random.RandomState(seed)
  table = rs.normal(size=(MK_V, MK_V)).astype(np.float32)
  table[:, list(support)] += 8.0
  return {"table": table, "source": 0.5 * rs.normal(size=(MK_V, MK_V)).astype(np.float32)}


def _long_run(drafter, draft, gamma=5, L=24, sampling=S(1.0), verifier=CHAIN, rows=64, seed=0):
  target, tp = ex.markov_models()["target"]
  enc = np.repeat(ex.MK_ENC, rows // 3 + 1, axis=0)[:rows]
  if draft == "disjoint":
    first = MarkovDecoder(MK_V, order=1)
    target, tp = first, _disjoint_params((1, 2, 3), 13)
    draft = (first, _disjoint_params((0, 4, 5), 14))
    sampling = S(1.0, top_k=3)
  else:
    draft = ex.markov_models()[draft]
  return decoding.run(decoding.Speculative(gamma=gamma, drafter=drafter, verifier=verifier),
                      target, tp, enc, draft=draft[0], draft_params=draft[1],
                      max_decode_len=L, sampling=sampling, rng=jax.random.PRNGKey(seed))


def _schedule_totals(lengths, calls):
  return np.array([sum(lengths[:c]) for c in calls])


@pytest.mark.slow
def test_schedule_lengths():
  # The target as its own draft: every block is accepted, lengths 1, 3, 5, 5, ...
  full = _long_run(Adaptive(start=1), "same", verifier=CHAIN)
  calls = np.asarray(full.stats.target_calls)
  np.testing.assert_array_equal(full.stats.draft_tokens, _schedule_totals([1, 3] + [5] * 30,
                                                                          calls))
  np.testing.assert_array_equal(full.stats.accepted, full.stats.draft_tokens)
  assert calls.max() >= 4
  # Disjoint supports: nothing is accepted, lengths 5, 4, 3, 2, 1, 1, ...
  none = _long_run(Adaptive(), "disjoint", verifier=BLOCK)
  calls = np.asarray(none.stats.target_calls)
  np.testing.assert_array_equal(none.stats.accepted, 0)
  np.testing.assert_array_equal(none.stats.draft_tokens,
                                _schedule_totals([5, 4, 3, 2] + [1] * 30, calls))
  assert calls.max() >= 6
  # A custom schedule: + 1 / - 2, floor 2.
  custom = _long_run(Adaptive(start=2, grow=1, shrink=2, min_length=2), "same",
                     verifier=BLOCK)
  np.testing.assert_array_equal(custom.stats.draft_tokens,
                                _schedule_totals([2, 3, 4, 5] + [5] * 30,
                                                 np.asarray(custom.stats.target_calls)))


def test_threshold_stops_after_the_first_unlikely_token(threshold=0.4):
  """With the target as its own draft every drafted token is output, so each block's
  length follows from the output and the draft's probabilities: the number of target
  calls is predicted exactly, and the drafted tokens up to the last block."""
  gamma, L = 4, 24
  result = _long_run(Adaptive(rule="threshold", threshold=threshold), "same", gamma=gamma, L=L)
  target, tp = ex.markov_models()["target"]
  tokens, lengths = np.asarray(result.tokens), np.asarray(result.lengths)
  enc = np.repeat(ex.MK_ENC, 64 // 3 + 1, axis=0)[:64]
  dec_in = np.concatenate([np.zeros((64, 1), np.int32), tokens[:, :-1]], axis=1)
  probs = np.asarray(jax.nn.softmax(target.forward(tp, enc, dec_in), axis=-1))
  own = np.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]  # [B, L]
  for b in range(64):
    m, calls, drafted = 0, 0, 0
    while m < lengths[b]:
      g = 1
      while g < gamma and m + g - 1 < lengths[b] and own[b, m + g - 1] >= threshold:
        g += 1
      calls, drafted, m = calls + 1, drafted + g, m + g + 1
    assert calls == result.stats.target_calls[b], b
    # the last block (g tokens predicted) may have drafted past the output's end
    assert drafted <= result.stats.draft_tokens[b] <= drafted - g + gamma, b
  assert 1.2 < _mean_drafted(result) < gamma - 0.2


def test_tuned_threshold_update():
  d = Adaptive(rule="tuned", threshold=0.5, step=0.1, target_full=0.25)
  state = adaptive.AdaptiveState(cache=None, limit=jnp.zeros(4, jnp.int32),
                                 threshold=jnp.array([0.5, 0.5, 0.985, 0.012]))
  proposal = decoding.Proposal.chain(jnp.zeros((4, 3), jnp.int32),
                                     length=jnp.array([3, 2, 1, 3], jnp.int32))
  verdict = decoding.Verdict(accepted=jnp.array([3, 1, 0, 3]), path=None, extra=None,
                             decided=None, beta=None)
  new = d.commit(None, state, None, verdict, proposal)
  # full -> - 0.1 * 0.75; a rejection -> + 0.1 * 0.25; clipped to [0.01, 0.99]
  np.testing.assert_allclose(new.threshold, [0.425, 0.525, 0.99, 0.01], atol=1e-6)
  fixed = Adaptive(rule="threshold").commit(None, state, None, verdict, proposal)
  np.testing.assert_array_equal(fixed.threshold, state.threshold)


@pytest.mark.slow
def test_row_alone_equals_row_in_batch():
  # The draft loop ends when the whole batch has stopped; a row's output must not care.
  drafter = Adaptive(rule="tuned", threshold=0.4, step=0.2)
  target, tp = ex.markov_models()["target"]
  draft, dp = ex.markov_models()["far"]
  rs = np.random.RandomState(3)
  enc = rs.randint(2, MK_V, (12, 4)).astype(np.int32)
  kw = dict(draft=draft, draft_params=dp, max_decode_len=16, sampling=S(1.0),
            rng=jax.random.PRNGKey(9))
  algo = decoding.Speculative(gamma=4, drafter=drafter, verifier=BLOCK)
  batch = decoding.run(algo, target, tp, enc, row_ids=np.arange(12), **kw)
  for i in (0, 5, 11):
    alone = decoding.run(algo, target, tp, enc[i:i + 1], row_ids=np.array([i]), **kw)
    np.testing.assert_array_equal(alone.tokens[0], batch.tokens[i])
    for c in ("draft_tokens", "accepted", "target_calls"):
      np.testing.assert_array_equal(getattr(alone.stats, c)[0], getattr(batch.stats, c)[i])
  assert len(set(np.asarray(batch.stats.draft_tokens).tolist())) > 3


@pytest.mark.slow
def test_sharded_equals_unsharded():
  from spec_decode import partitioning
  target, tp = ex.markov_models()["target"]
  draft, dp = ex.markov_models()["far"]
  enc = np.random.RandomState(4).randint(2, MK_V, (8, 4)).astype(np.int32)
  algo = decoding.Speculative(gamma=4, drafter=Adaptive(rule="tuned", threshold=0.4, step=0.2),
                              verifier=BLOCK)
  kw = dict(draft=draft, draft_params=dp, max_decode_len=12, sampling=S(1.0),
            rng=jax.random.PRNGKey(2))
  ref = decoding.run(algo, target, tp, enc, **kw)
  got = decoding.run(algo, target, tp, enc, mesh=partitioning.make_mesh("data=4,model=2"), **kw)
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  for c in ("draft_tokens", "accepted", "decisions", "target_calls"):
    np.testing.assert_array_equal(getattr(got.stats, c), getattr(ref.stats, c))
  assert len(set(np.asarray(ref.stats.draft_tokens).tolist())) > 2


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize("kwargs,match", [
    (dict(rule="fixed"), "rule must be one of"),
    (dict(rule="threshold", threshold=0.0), "threshold must be in"),
    (dict(rule="threshold", threshold=1.0), "threshold must be in"),
    (dict(threshold=1.5), "threshold must be in"),
    (dict(rule="tuned", threshold=0.995), "tuned threshold starts in"),
    (dict(step=0.0), "step must be in"),
    (dict(target_full=1.0), "target_full must be in"),
    (dict(start=0), "start must be an int"),
    (dict(start=2.0), "start must be an int"),
    (dict(grow=0), "grow must be an int"),
    (dict(shrink=-1), "shrink must be an int"),
    (dict(min_length=0), "min_length must be an int"),
    (dict(start=1, min_length=2), "below min_length"),
])
def test_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Adaptive(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(start=6), dict(min_length=6)])
def test_settings_beyond_gamma(kwargs):
  with pytest.raises(ValueError, match=r"exceeds the maximum draft length 5"):
    _long_run(Adaptive(**kwargs), "far", gamma=5, L=6, rows=3)


def test_gin_builds_the_variants():
  cfg = gin_layer.parse_experiment(["configs/toy_random.gin"], [
      "a/Speculative.gamma = 6", "a/Speculative.drafter = @a/AdaptiveDrafter()",
      "a/AdaptiveDrafter.rule = 'tuned'", "a/AdaptiveDrafter.threshold = 0.3",
      "b/Speculative.gamma = 4", "b/Speculative.verifier = @BlockVerifier()",
      "ExperimentConfig.decoders = {'a': @a/Speculative(), 'b': @b/Speculative()}"])
  a, b = cfg.decoders["a"], cfg.decoders["b"]
  assert a == decoding.Speculative(gamma=6, drafter=Adaptive(rule="tuned", threshold=0.3))
  assert b == decoding.Speculative(gamma=4, verifier=BLOCK)
  desc = cfg.to_json()["decoders"]
  assert desc["a"]["drafter"]["name"] == "adaptive" and desc["b"]["verifier"]["name"] == "block"
