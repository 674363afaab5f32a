"""Oracles of block verification (verifiers/block.py, Sun et al. 2025).

* The formulas: `block_weights` against a float64 reference, including products
  that underflow float32 (log space), and the residual law at a tiny P_tau.
* Exactness of one block, by enumeration: for context-dependent target and
  draft laws over a 3-token vocabulary, the law of (x_1 .. x_tau, Y, then the
  target's own continuation) computed from the verifier's h and residuals
  equals the target's law exactly, for sampled and deterministic drafts and for
  a per-row length that depends only on the drafted prefix. Negative controls
  (same enumeration): stopping at the FIRST failed test, and a length that
  depends on the token after it, are not exact.
* Exactness end to end: sequence-level chi-square of the speculative loop with
  the block verifier against the target's enumerated law (temperatures, top-k,
  top-p, near and far drafts, Markov and T5), and the first-failure variant
  rejected by the same test.
* Temperature 0: the verdict equals token-level verification, and decoding
  equals the chain verifier's and autoregressive decoding.
* Statistics: more tokens per call than token-level, the same alpha estimate.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from tiers import tiered
from spec_decode import decoding
from spec_decode.decoding.sampling import draw
from spec_decode.decoding.verifiers import block
from spec_decode.models import t5
from spec_decode.models.testing import MarkovDecoder

SE_BOUND = 4.0


# ------------------------------------------------------------------ the formulas
def _reference(p, q, x, length):
  """float64 (P [B, K], h [B, K]) straight from the formulas (`verifiers/block.py`)."""
  p, q = p.astype(np.float64), q.astype(np.float64)
  B, K = x.shape
  P, h = np.zeros((B, K)), np.zeros((B, K))
  for b in range(B):
    prev = 1.0
    for i in range(1, length[b] + 1):
      prev = min(1.0, prev * p[b, i - 1, x[b, i - 1]] / q[b, i - 1, x[b, i - 1]])
      P[b, i - 1] = prev
    for i in range(1, length[b] + 1):
      if i == length[b]:
        h[b, i - 1] = P[b, i - 1]
        continue
      r = np.sum(np.maximum(P[b, i - 1] * p[b, i] - q[b, i], 0.0))
      den = r + 1.0 - P[b, i - 1]
      h[b, i - 1] = r / den if den > 0 else 1.0
  return P, h


def _random_laws(rs, B, K, V, zero_frac=0.3):
  p = rs.dirichlet(np.ones(V) * 0.7, size=(B, K + 1))
  q = rs.dirichlet(np.ones(V) * 0.7, size=(B, K))
  q = np.where(rs.rand(B, K, V) < zero_frac, 0.0, q) + 1e-12 * (np.arange(V) == 0)
  q /= q.sum(-1, keepdims=True)
  p = np.where(rs.rand(B, K + 1, V) < zero_frac, 0.0, p) + 1e-12 * (np.arange(V) == 1)
  p /= p.sum(-1, keepdims=True)
  x = np.array([[rs.choice(V, p=q[b, i]) for i in range(K)] for b in range(B)], np.int32)
  return p.astype(np.float32), q.astype(np.float32), x


def test_block_weights_match_float64_reference():
  rs = np.random.RandomState(0)
  B, K, V = 64, 5, 8
  p, q, x = _random_laws(rs, B, K, V)
  length = rs.randint(1, K + 1, B).astype(np.int32)
  log_P, h = block.block_weights(jnp.asarray(p), jnp.asarray(q), jnp.asarray(x),
                                 jnp.asarray(length))
  P_ref, h_ref = _reference(p, q, x, length)
  valid = np.arange(1, K + 1)[None] <= length[:, None]
  np.testing.assert_allclose(np.where(valid, np.exp(log_P[:, 1:]), 0.0), P_ref, atol=1e-6)
  np.testing.assert_allclose(h, h_ref, atol=1e-5)
  assert np.all(np.asarray(h)[~valid] == 0.0)
  assert 0.05 < np.mean(h_ref[valid]) < 0.95  # the cases are not degenerate
  np.testing.assert_array_equal(log_P[:, 0], 0.0)


def test_log_space_survives_underflow():
  # Eight ratios of 1e-12: P_8 = 1e-96 underflows float32 in linear space.
  K, V = 8, 4
  q = np.full((1, K, V), 0.25, np.float32)
  p = np.tile(np.array([3e-12, 0.5, 0.5 - 3e-12, 0.0], np.float32), (1, K + 1, 1))
  q[0, :, 3] = 0.0
  q[0] /= q[0].sum(-1, keepdims=True)  # 1/3 on tokens 0..2
  x = np.zeros((1, K), np.int32)
  log_P, h = block.block_weights(jnp.asarray(p), jnp.asarray(q), jnp.asarray(x),
                                 jnp.array([K], jnp.int32))
  want = np.cumsum(np.full(K, np.log(3e-12 * 3)))
  np.testing.assert_allclose(np.asarray(log_P)[0, 1:], want, rtol=1e-5)
  assert np.all(np.isfinite(log_P)) and np.all(np.isfinite(h))
  # The residual at tau = 7: norm(max(P_7 p_8 - q_8, 0)); P_7 = 1e-77 leaves mass only
  # where q_8 = 0 and p_8 > 0 (token 3 has p = 0 here), so it is the fallback p itself;
  # with p_8(3) > 0 the law is the point mass at token 3.
  res = block.residual_law(jnp.asarray(p[:, 7]), jnp.asarray(q[:, 7]), log_P[:, 7])
  np.testing.assert_allclose(res, p[:, 7], atol=1e-7)
  p2 = np.array([[0.2, 0.3, 0.3, 0.2]], np.float32)
  res = block.residual_law(jnp.asarray(p2), jnp.asarray(q[:, 7]), log_P[:, 7])
  np.testing.assert_allclose(res, [[0.0, 0.0, 0.0, 1.0]], atol=1e-7)
  # and at a moderate P the scaled form equals the plain one
  res = block.residual_law(jnp.asarray(p2), jnp.asarray(q[:, 7]), jnp.log(jnp.array([0.9])))
  plain = np.maximum(0.9 * p2 - q[:, 7], 0)
  np.testing.assert_allclose(res, plain / plain.sum(), atol=1e-6)


# ------------------------------------------------- exactness of one block, enumerated
E_V, E_K = 3, 3


def _tables(seed, deterministic=False):
  """Target and draft laws for every prefix of length 0..K (some zero entries)."""
  rs = np.random.RandomState(seed)
  p, q = {}, {}
  for n in range(E_K + 1):
    for prefix in itertools.product(range(E_V), repeat=n):
      pl = rs.dirichlet(np.ones(E_V))
      pl[rs.randint(E_V)] *= rs.rand() < 0.3  # sometimes a zero (as top-k makes)
      p[prefix] = pl / pl.sum()
      ql = np.eye(E_V)[rs.randint(E_V)] if deterministic else rs.dirichlet(np.ones(E_V))
      if not deterministic and rs.rand() < 0.3:
        ql[rs.randint(E_V)] = 0.0
      q[prefix] = ql / ql.sum()
  return p, q


def _law(p, prefix, n):
  """The target's probability of each continuation of `prefix` to n tokens."""
  if len(prefix) == n:
    return {prefix: 1.0}
  out = {}
  for y in range(E_V):
    if p[prefix][y] > 0:
      for seq, w in _law(p, prefix + (y,), n).items():
        out[seq] = out.get(seq, 0.0) + p[prefix][y] * w
  return out


def _one_block_law(p, q, length_rule, first_failure=False):
  """The law of the first K + 1 output tokens after one block-verification step
  (then the target's continuation), from the JAX verifier's h and residuals."""
  blocks = [x for x in itertools.product(range(E_V), repeat=E_K)
            if np.prod([q[x[:i]][x[i]] for i in range(E_K)]) > 0]
  x = np.array(blocks, np.int32)
  pa = np.array([[p[b[:i]] for i in range(E_K + 1)] for b in blocks], np.float32)
  qa = np.array([[q[b[:i]] for i in range(E_K)] for b in blocks], np.float32)
  length = np.array([length_rule(b) for b in blocks], np.int32)
  log_P, h = block.block_weights(jnp.asarray(pa), jnp.asarray(qa), jnp.asarray(x),
                                 jnp.asarray(length))
  h, log_P = np.asarray(h, np.float64), np.asarray(log_P)
  law = {}
  for n, b in enumerate(blocks):
    weight = np.prod([q[b[:i]][b[i]] for i in range(E_K)])
    g = length[n]
    for tau in range(g + 1):
      if first_failure:  # tests pass up to tau, then the first failure
        pr = np.prod(h[n, :tau]) * (1.0 - h[n, tau] if tau < g else 1.0)
      else:  # the last pass is at tau
        pr = (h[n, tau - 1] if tau else 1.0) * np.prod(1.0 - h[n, tau:g])
      if pr == 0:
        continue
      q_next = qa[n, tau] if tau < g else np.zeros(E_V, np.float32)
      res = np.asarray(block.residual_law(jnp.asarray(pa[n, tau][None]),
                                          jnp.asarray(q_next[None]),
                                          jnp.asarray(log_P[n, tau][None])))[0]
      for y in range(E_V):
        if res[y] > 0:
          for seq, w in _law(p, tuple(b[:tau]) + (y,), E_K + 1).items():
            law[seq] = law.get(seq, 0.0) + weight * pr * res[y] * w
  return law


def _max_error(law, p):
  want = _law(p, (), E_K + 1)
  keys = set(law) | set(want)
  return max(abs(law.get(k, 0.0) - want.get(k, 0.0)) for k in keys)


def _stop_after_zero(x):
  """Propose up to the first token 0 (included): decided by x_1 .. x_length only."""
  return next((i + 1 for i, t in enumerate(x) if t == 0), E_K)


def _drop_before_zero(x):
  """Stop before the first token 0 at position >= 2: depends on the token after the block."""
  return next((i for i, t in enumerate(x) if t == 0 and i >= 1), E_K)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled", "point_mass"])
def test_one_block_is_exact_by_enumeration(seed, deterministic):
  p, q = _tables(seed, deterministic)
  for rule in (lambda x: E_K, lambda x: 1, lambda x: 2, _stop_after_zero):
    law = _one_block_law(p, q, rule)
    np.testing.assert_allclose(sum(law.values()), 1.0, atol=1e-5)
    assert _max_error(law, p) < 2e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_enumeration_rejects_first_failure_and_peeking_lengths(seed):
  p, q = _tables(seed)
  first = _max_error(_one_block_law(p, q, lambda x: E_K, first_failure=True), p)
  peek = _max_error(_one_block_law(p, q, _drop_before_zero), p)
  print(f"\n[enumeration] seed {seed}: first-failure error {first:.3g}, "
        f"peeking length error {peek:.3g}")
  assert first > 1e-3 and peek > 1e-3  # vs < 2e-6 for the exact rules above


# ------------------------------------------------------------ exactness end to end
@dataclasses.dataclass(frozen=True)
class FirstFailureBlock(decoding.BlockVerifier):
  """WRONG on purpose (negative control): tau = the position before the FIRST failed test."""

  def verify(self, p, proposal, accept_keys, correct_keys, *, sampling, lenience=1.0):
    x, q, length = proposal.tokens, proposal.q, proposal.proposed
    B, K = x.shape
    log_P, h = block.block_weights(p, q, x, length)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (K,)))(accept_keys)
    tau = jnp.sum(jnp.cumprod((u <= h).astype(jnp.int32), axis=1), axis=1)
    p_next = jnp.take_along_axis(p, tau[:, None, None], axis=1)[:, 0]
    q_ext = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    q_next = jnp.take_along_axis(q_ext, tau[:, None, None], axis=1)[:, 0]
    q_next = jnp.where((tau < length)[:, None], q_next, 0.0)
    log_P_tau = jnp.take_along_axis(log_P, tau[:, None], axis=1)[:, 0]
    extra = draw(correct_keys, block.residual_law(p_next, q_next, log_P_tau), greedy=False)
    return decoding.Verdict(accepted=tau, path=jnp.broadcast_to(jnp.arange(K), (B, K)),
                            extra=extra, decided=jnp.minimum(tau + 1, length),
                            beta=jnp.sum(jnp.minimum(p[:, :K], q), axis=-1))


S = decoding.Sampling
# name: (family, draft, sampling, gamma, encoder inputs, rows, seed)
CASES = {
    "mk_far_t1_g3": ("mk", "far", S(1.0), 3, 1, ex.rows(), 300),
    "mk_close_t0.7_g5_3inputs": ("mk", "close", S(0.7), 5, 3, ex.rows(6 / 5), 301),
    "mk_far_topk3_g4": ("mk", "far", S(1.0, top_k=3), 4, 1, ex.rows(), 302),
    "mk_far_t0.9_topp0.85_g3": ("mk", "far", S(0.9, top_p=0.85), 3, 1, ex.rows(), 303),
    "t5_far_t1_g3": ("t5", "far", S(1.0), 3, 1, ex.rows(2 / 3), 304),
}


@functools.lru_cache(maxsize=None)
def _run(name, verifier=decoding.BlockVerifier()):
  fam, draft, sampling, gamma, n_inputs, rows, seed = CASES[name]
  algo = decoding.Speculative(gamma=gamma, verifier=verifier)
  result, groups = ex.sample(algo, fam, draft, sampling, rows=rows, n_inputs=n_inputs,
                             seed=seed)
  return result, groups, ex.target_laws(fam, n_inputs, sampling)


@pytest.mark.parametrize("name", tiered(list(CASES), fast=("mk_far_t1_g3",)))
def test_block_verification_is_exact(name):
  _, groups, laws = _run(name)
  fit = ex.fit(f"block {name}", groups, laws)
  assert fit.impossible == 0
  assert fit.p_value >= ex.P_REJECT, fit


@pytest.mark.slow
def test_negative_control_first_failure_is_rejected():
  _, groups, laws = _run("mk_far_t1_g3", FirstFailureBlock())
  fit = ex.fit("first-failure block mk_far_t1_g3 (negative control)", groups, laws)
  assert fit.p_value < ex.P_REJECT, fit


# ------------------------------------------------------------------- statistics
def _rates(result):
  st = result.stats
  calls, dec = np.sum(st.target_calls), np.sum(st.decisions)
  return {"tokens_per_call": np.sum(result.lengths) / calls, "accepted": np.sum(st.accepted) / dec,
          "alpha": np.sum(st.min_pq_sum) / dec, "decisions": dec, "calls": calls}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mk_far_t1_g3", "mk_close_t0.7_g5_3inputs"])
def test_block_beats_token_level_with_the_same_alpha(name):
  block_r, chain_r = _run(name)[0], _run(name, decoding.ChainVerifier())[0]
  b, c = _rates(block_r), _rates(chain_r)
  print(f"\n[block vs chain] {name}: tokens/call {b['tokens_per_call']:.4f} vs "
        f"{c['tokens_per_call']:.4f}; accepted/decision {b['accepted']:.4f} vs "
        f"{c['accepted']:.4f}; alpha {b['alpha']:.4f} vs {c['alpha']:.4f}")
  # Both runs emit the target's law, so their output lengths are alike and fewer calls
  # mean more tokens per call; the per-call gain must exceed the sampling noise.
  per_call = lambda r: np.asarray(r.lengths) / np.asarray(r.stats.target_calls)
  diff = per_call(block_r) - per_call(chain_r)
  assert np.mean(diff) > SE_BOUND * np.std(diff) / np.sqrt(diff.size)
  assert b["accepted"] > c["accepted"]
  # alpha (mean beta over positions with a committed prefix) is the draft's, not the
  # verifier's: the two estimates agree to within 0.01.
  assert abs(b["alpha"] - c["alpha"]) < 0.01
  assert np.all(np.asarray(block_r.stats.decisions) <= np.asarray(block_r.stats.draft_tokens))


# ---------------------------------------------------------------- temperature 0
def test_greedy_verdict_equals_token_level():
  rs = np.random.RandomState(7)
  B, K, V = 256, 5, 4
  x = rs.randint(V, size=(B, K)).astype(np.int32)
  q = jax.nn.one_hot(x, V)
  match = rs.rand(B, K) < 0.7  # the target agrees with the draft at ~70% of positions
  target = np.where(match, x, (x + 1 + rs.randint(V - 1, size=(B, K))) % V)
  target = np.concatenate([target, rs.randint(V, size=(B, 1))], axis=1)
  p = jax.nn.one_hot(target, V)
  keys = jax.random.split(jax.random.PRNGKey(0), B)
  for length in (jnp.full((B,), K, jnp.int32), jnp.asarray(rs.randint(1, K + 1, B), jnp.int32)):
    prop = decoding.Proposal.chain(jnp.asarray(x), q, length=length)
    want = decoding.ChainVerifier().verify(p, prop, keys, keys, sampling=decoding.Sampling(0.0))
    # The block formulas with one-hot laws: h is exactly 0 or 1, and the last pass is the
    # matched prefix; the residual there is the target's argmax.
    log_P, h = block.block_weights(p, q, jnp.asarray(x), length)
    assert set(np.unique(np.asarray(h))) <= {0.0, 1.0}
    tau = np.max(np.where(np.asarray(h) > 0.5, np.arange(1, K + 1), 0), axis=1)
    np.testing.assert_array_equal(tau, want.accepted)
    q_ext = np.concatenate([np.asarray(q), np.zeros((B, 1, V))], axis=1)
    q_next = np.where((tau < np.asarray(length))[:, None], q_ext[np.arange(B), tau], 0.0)
    res = block.residual_law(p[np.arange(B), tau], jnp.asarray(q_next, jnp.float32),
                             log_P[np.arange(B), tau])
    np.testing.assert_array_equal(np.argmax(res, axis=-1), want.extra)
    # and verify() itself (which runs the token-level rule at temperature 0)
    got = decoding.BlockVerifier().verify(p, prop, keys, keys, sampling=decoding.Sampling(0.0))
    for field in ("accepted", "extra", "decided"):
      np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
  assert 0 < np.mean(np.asarray(want.accepted)) < K - 1


G_V, G_L, G_N = 64, 12, 16


@functools.lru_cache(maxsize=None)
def _greedy_setup():
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  tp = target.init(jax.random.PRNGKey(20))
  far = t5.T5(t5.T5Config.preset("t5_tiny", num_encoder_layers=1, num_decoder_layers=1))
  markov = MarkovDecoder(G_V, order=2)
  rs = np.random.RandomState(25)
  enc = rs.randint(2, G_V, (G_N, 10)).astype(np.int32)
  for row, n in enumerate(rs.randint(1, 11, G_N)):
    enc[row, n:] = 0
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=G_L)
  return target, tp, {"t5": (far, far.init(jax.random.PRNGKey(21))),
                      "markov": (markov, markov.init(jax.random.PRNGKey(22)))}, enc, ar


@pytest.mark.parametrize("draft,gamma", tiered([("t5", 3), ("markov", 5)],
                                               fast=(("markov", 5),)))
def test_greedy_block_equals_token_level_and_autoregressive(draft, gamma):
  target, tp, drafts, enc, ar = _greedy_setup()
  dm, dp = drafts[draft]
  kw = dict(draft=dm, draft_params=dp, max_decode_len=G_L)
  got = decoding.run(decoding.Speculative(gamma=gamma, verifier=decoding.BlockVerifier()),
                     target, tp, enc, **kw)
  chain = decoding.run(decoding.Speculative(gamma=gamma), target, tp, enc, **kw)
  np.testing.assert_array_equal(got.tokens, chain.tokens)
  for counter in ("accepted", "decisions", "target_calls", "min_pq_sum"):
    np.testing.assert_array_equal(getattr(got.stats, counter), getattr(chain.stats, counter))
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
  assert len({tuple(r) for r in np.asarray(ar.tokens)}) > G_N // 2  # not trivial outputs


def test_registered_and_refuses_lenience():
  assert isinstance(decoding.registry.get("verifier", "block"), decoding.BlockVerifier)
  with pytest.raises(ValueError, match="does not support lenience"):
    decoding.Speculative(gamma=3, lenience=0.8, verifier=decoding.BlockVerifier())
