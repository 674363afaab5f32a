"""Tree speculation: SpecExec's best-first draft tree and its exact acceptance rule.

Oracles: the drafted tree is a connected subtree within budget and depth,
parents first, siblings distinct; greedy tree decoding equals greedy
autoregressive decoding token for token (ragged batches, EOS inside the tree);
sampled tree decoding reproduces the target's exact law of whole sequences
(chi-square against enumeration), and the same test rejects a plausible wrong
rule (after a miss, redrawing the extra token from the node's whole law p, which
counts the children's tokens twice). Redrawing from p with the children removed
would be exact, which is what the real rule's miss draw already is.
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
from spec_decode.decoding import registry, runner
from spec_decode.decoding.types import Committed
from spec_decode.models import testing
from spec_decode.models.testing import MarkovDecoder

P_REJECT = 1e-3


_t5_pair = ex.t5_eos_pair  # EOS made likely enough to end some rows inside the tree


def _tree_algo(**kw):
  return decoding.Speculative(gamma=1, drafter=decoding.TreeDrafter(**kw),
                              verifier=decoding.TreeVerifier())


def test_drafted_tree_is_a_connected_subtree_within_budget():
  target, tp, draft, dp = _t5_pair()
  enc = np.random.RandomState(0).randint(2, 32, (3, 6)).astype(np.int32)
  drafter = decoding.TreeDrafter(budget=9, width=3, expand=2, depth=3, steps=4)
  ctx = runner.LoopContext(target=target, target_params=tp, draft=draft, draft_params=dp,
                           encoder_tokens=jnp.asarray(enc), draft_encoder_tokens=jnp.asarray(enc),
                           rng=jax.random.PRNGKey(0), row_ids=jnp.arange(3),
                           max_decode_len=8, sampling=decoding.Sampling(temperature=1.0))
  state = drafter.init(ctx, 8 + 9 + 1)
  out = jnp.asarray(np.random.RandomState(1).randint(2, 32, (3, 20)).astype(np.int32))
  committed = Committed(tokens=out, length=jnp.array([0, 0, 0]), it=jnp.int32(0))
  prop, state = drafter.propose(ctx, state, committed, None, 1)
  tok, par = np.asarray(prop.tokens), np.asarray(prop.parent)
  depth = np.asarray(prop.depths())
  for b in range(3):
    valid = par[b] >= -1
    assert valid.sum() == 9  # the budget fills: 3 + 2 x 3 + 2 x 3 candidates over 3 rounds
    for i in np.flatnonzero(valid):
      assert par[b, i] < i and (par[b, i] == -1 or valid[par[b, i]])  # parents first
      assert depth[b, i] <= 3
    for parent in set(par[b][valid]):  # distinct siblings
      kids = tok[b][valid & (par[b] == parent)]
      assert len(set(kids.tolist())) == len(kids)
  assert np.all(np.asarray(state.held) == 1)
  # Confidence: the draft's law (t = 1: its softmax) multiplied along each node's path,
  # recomputed by teacher-forcing the path after BOS; 0 for padding.
  conf = np.asarray(prop.confidence)
  for b in range(3):
    for i in range(conf.shape[1]):
      if par[b, i] < -1:
        assert conf[b, i] == 0
        continue
      path, j = [], i
      while j >= 0:
        path.insert(0, int(tok[b, j]))
        j = int(par[b, j])
      logits = draft.forward(dp, enc[b:b + 1], np.array([[0] + path[:-1]], np.int32))[0]
      laws = np.asarray(jax.nn.softmax(logits, axis=-1))
      want = np.prod([laws[k, t] for k, t in enumerate(path)])
      np.testing.assert_allclose(conf[b, i], want, rtol=1e-4)


@pytest.mark.parametrize("kw", tiered([dict(budget=6, width=2, expand=2, depth=3, steps=3),
                                       dict(budget=10, width=3, expand=3, depth=4, steps=4),
                                       dict(budget=3, width=1, expand=1, depth=3, steps=3)],
                                      fast=("b6w2d3",), ids=["b6w2d3", "b10w3d4", "chain_w1"]))
def test_greedy_tree_equals_autoregressive(kw):
  target, tp, draft, dp = _t5_pair()
  enc = np.random.RandomState(2).randint(2, 32, (8, 6)).astype(np.int32)
  enc[3, 3:] = 0
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=12)
  got = decoding.run(_tree_algo(**kw), target, tp, enc, draft=draft, draft_params=dp,
                     max_decode_len=12)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  lengths = np.asarray(ar.lengths)
  assert lengths.min() < 12  # some rows end with EOS
  st = got.stats
  assert np.all(np.asarray(st.accepted) <= np.asarray(st.decisions))
  assert np.all(np.asarray(st.target_calls) < lengths + 1)
  assert np.asarray(st.accepted).sum() > 0


MK_V, MK_L, MK_N = 6, 4, ex.rows(4 / 3)
MK_ENC = np.array([[3, 4, 5, 0]], np.int32)


@functools.lru_cache(maxsize=None)
def _markov():
  target = MarkovDecoder(MK_V, order=2)
  far = MarkovDecoder(MK_V, order=1)
  return target, target.init(jax.random.PRNGKey(10), scale=1.5), far, far.init(
      jax.random.PRNGKey(11))


def _sample(algo, sampling, n=MK_N):
  target, tp, draft, dp = _markov()
  enc = np.repeat(MK_ENC, n, axis=0)
  r = decoding.run(algo, target, tp, enc, draft=draft, draft_params=dp, max_decode_len=MK_L,
                   sampling=sampling, rng=jax.random.PRNGKey(5))
  law = testing.sequence_distribution(target, tp, MK_ENC, max_decode_len=MK_L,
                                      sampling=sampling)[0]
  return testing.chi_square([testing.sequences(r)], [law]), r


@pytest.mark.parametrize("sampling", tiered([decoding.Sampling(temperature=1.0),
                                             decoding.Sampling(temperature=0.7, top_k=3),
                                             decoding.Sampling(temperature=1.3, top_p=0.8)],
                                            fast=("t1",), ids=["t1", "t0.7_topk3", "t1.3_topp0.8"]))
def test_tree_sampling_is_exact(sampling):
  fit, r = _sample(_tree_algo(budget=6, width=2, expand=2, depth=3, steps=3), sampling)
  print("tree exactness", sampling, fit)
  assert fit.impossible == 0 and fit.p_value > P_REJECT, fit
  # the tree is used: more than one token per target call on average
  assert np.asarray(r.lengths).sum() > 1.2 * np.asarray(r.stats.target_calls).sum()
  # beta (the target's mass on the children) estimates the hit rate of the draws
  acc, dec = np.asarray(r.stats.accepted).sum(), np.asarray(r.stats.decisions).sum()
  beta = np.asarray(r.stats.min_pq_sum).sum()
  assert abs(acc - beta) < 4 * np.sqrt(dec * 0.25), (acc, beta, dec)


@pytest.mark.slow
def test_confidence_estimates_tokens_per_call_when_the_draft_is_the_target():
  # With q = p, a node's confidence is the probability that the target's walk reaches it,
  # so the proposal's confidences sum (draft_mass_at) to the expected number of accepted
  # nodes: per-row totals agree up to noise. With the far draft they need not.
  target, tp, far, fp = _markov()
  enc = np.repeat(MK_ENC, 2000, axis=0)
  algo = _tree_algo(budget=6, width=2, expand=2, depth=3, steps=3)
  z = {}
  for name, (draft, dp) in {"self": (target, tp), "far": (far, fp)}.items():
    r = decoding.run(algo, target, tp, enc, draft=draft, draft_params=dp, max_decode_len=MK_L,
                     sampling=decoding.Sampling(temperature=1.0), rng=jax.random.PRNGKey(6))
    mass = np.asarray(r.stats.draft_mass_at)
    assert np.all(np.diff(mass, axis=1) <= 1e-6)  # largest first
    d = np.asarray(r.stats.accepted) - mass.sum(axis=1)
    z[name] = d.mean() / (d.std() / np.sqrt(len(d)))
  print("confidence vs accepted, z:", z)
  assert abs(z["self"]) < 4, z
  assert abs(z["far"]) > 4, z


@registry.verifier("tree_wrong_extra_for_tests")
@dataclasses.dataclass(frozen=True)
class _WrongExtra(decoding.TreeVerifier):
  """Negative control: after a miss, the extra token is redrawn from the node's whole law
  (plausible-looking, biased: a child's token can now also come out as the extra)."""

  def verify(self, p, proposal, accept_keys, correct_keys, *, sampling, lenience=1.0):
    v = super().verify(p, proposal, accept_keys, correct_keys, sampling=sampling)
    last = jnp.where(v.accepted > 0, jnp.take_along_axis(
        v.path, jnp.maximum(v.accepted - 1, 0)[:, None], axis=1)[:, 0], -1)
    p_stop = jnp.take_along_axis(p, (last + 1)[:, None, None], axis=1)[:, 0]
    extra = jax.vmap(decoding.sample_from)(jax.vmap(lambda k: jax.random.fold_in(k, 99))(
        correct_keys), p_stop)
    return v.replace(extra=extra)


@pytest.mark.slow
def test_negative_control_wrong_extra_is_rejected():
  algo = decoding.Speculative(gamma=1, drafter=decoding.TreeDrafter(
      budget=6, width=2, expand=2, depth=3, steps=3), verifier=_WrongExtra())
  fit, _ = _sample(algo, decoding.Sampling(temperature=1.0))
  print("negative control", fit)
  assert fit.p_value < P_REJECT or fit.impossible > 0, fit


def test_tree_settings_are_checked():
  with pytest.raises(ValueError, match="TreeDrafter.budget must be an int >= 1"):
    decoding.TreeDrafter(budget=0)
  with pytest.raises(ValueError, match="width 5 exceeds the budget 4"):
    decoding.TreeDrafter(budget=4, width=5)
  with pytest.raises(ValueError, match="verifies chains only"):
    decoding.Speculative(gamma=2, drafter=decoding.TreeDrafter())
  assert decoding.Speculative(gamma=2, drafter=decoding.TreeDrafter(budget=12),
                              verifier=decoding.TreeVerifier()).max_proposal == 12
