"""Sampled draft trees and recursive rejection sampling (drafters/sampled_tree.py,
verifiers/tree_rrs.py).

Oracles:
* The drafted tree: the fixed shape (parents first), distinct siblings drawn
  from the draft's support, each node's q equal to the draft's own law after
  its path (teacher-forced), padding below the support when top-k leaves fewer
  tokens than the width.
* Greedy identity with autoregressive decoding (widths/depths, a chain, the
  deterministic best-first TreeDrafter under the point-mass semantics; ragged
  batch, EOS inside the tree).
* Exactness: the sequence-level chi-square test against the target's
  enumerated law (tests/exactness.py) at temperature 1, 0.7 and top-k, with
  near, far and uniform drafts; the with-replacement rule is exact for children
  drawn with replacement.
* Negative control: the with-replacement rule applied to children drawn
  WITHOUT replacement is rejected by the same test.
* beta (per-test acceptance probabilities) estimates the number accepted.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from tiers import tiered
from spec_decode import decoding
from spec_decode.decoding import registry, runner
from spec_decode.decoding.drafters.sampled_tree import tree_shape
from spec_decode.decoding.types import Committed

ROWS = ex.rows()
SE_BOUND = 4.0


def _algo(width, depth, *, with_replacement=False, verifier=None):
  drafter = decoding.SampledTreeDrafter(width=width, depth=depth,
                                        with_replacement=with_replacement)
  verifier = verifier or decoding.TreeRRSVerifier(with_replacement=with_replacement)
  return decoding.Speculative(gamma=1, drafter=drafter, verifier=verifier)


# ---------------------------------------------------------------- the drafted tree
def _propose(drafter, sampling, committed_len, seed=0):
  """One proposal of `drafter` with the order-2 Markov model as the draft (3 rows)."""
  draft, dp = ex.markov_models()["target"]
  B, V = 3, ex.MK_V
  enc = ex.MK_ENC
  ctx = runner.LoopContext(target=draft, target_params=dp, draft=draft, draft_params=dp,
                           encoder_tokens=jnp.asarray(enc), draft_encoder_tokens=jnp.asarray(enc),
                           rng=jax.random.PRNGKey(0), row_ids=jnp.arange(B),
                           max_decode_len=8, sampling=sampling)
  K = drafter.proposal_size(1)
  state = drafter.init(ctx, 8 + K + 1)
  out = jnp.asarray(np.random.RandomState(1).randint(2, V, (B, 20)).astype(np.int32))
  committed = Committed(tokens=out, length=jnp.full((B,), committed_len), it=jnp.int32(0))
  keys = jax.random.split(jax.random.PRNGKey(seed), B)[:, None]
  prop, state = jax.jit(lambda s, c, k: drafter.propose(ctx, s, c, k, 1))(state, committed, keys)
  return prop, state, (draft, dp, enc, np.asarray(out))


def test_sampled_tree_shape_and_laws():
  sampling = decoding.Sampling(temperature=1.0)
  drafter = decoding.SampledTreeDrafter(width=3, depth=2)
  prop, state, (draft, dp, enc, out) = _propose(drafter, sampling, committed_len=2)
  offsets, parent, level, _ = tree_shape(3, 2)
  assert prop.size == 12 and list(offsets) == [0, 3, 12]
  tok, par, q = np.asarray(prop.tokens), np.asarray(prop.parent), np.asarray(prop.q)
  np.testing.assert_array_equal(par, np.broadcast_to(parent, par.shape))
  np.testing.assert_array_equal(np.asarray(prop.depths()), np.broadcast_to(level, par.shape))
  for b in range(3):
    for node in [-1] + list(range(3)):
      kids = np.flatnonzero(par[b] == node)
      assert len(kids) == 3 and len(set(tok[b, kids].tolist())) == 3  # without replacement
      for k in kids:
        np.testing.assert_array_equal(q[b, k], q[b, kids[0]])  # siblings share the law
        assert q[b, k, tok[b, k]] > 0
      # q at the node is the draft's law after s_0 .. s_2 and the node's path
      path = [] if node < 0 else [tok[b, node]]
      inputs = np.array([[0] + list(out[b, :2]) + path], np.int32)
      logits = draft.forward(dp, enc[b:b + 1], inputs)[0, -1]  # order 2: sees s_2 and path
      np.testing.assert_allclose(q[b, kids[0]], np.asarray(sampling.probs(logits)), atol=1e-5)
  assert np.all(np.asarray(state.held) == 3)


def test_support_smaller_than_width_pads_the_tree():
  drafter = decoding.SampledTreeDrafter(width=2, depth=3)
  prop, _, _ = _propose(drafter, decoding.Sampling(temperature=1.0, top_k=1), committed_len=0)
  par = np.asarray(prop.parent)
  assert np.all(np.asarray(prop.proposed) == 3)  # one child per node: a chain of 3
  offsets, parent, _, _ = tree_shape(2, 3)
  kept = par >= -1
  np.testing.assert_array_equal(par[kept], np.broadcast_to(parent, par.shape)[kept])
  assert np.all(kept[:, offsets[:-1]])  # each level's first node: the one child


def test_greedy_tree_is_deterministic_top_width():
  prop, _, _ = _propose(decoding.SampledTreeDrafter(width=3, depth=2), decoding.Sampling(),
                        committed_len=1)
  again, _, _ = _propose(decoding.SampledTreeDrafter(width=3, depth=2), decoding.Sampling(),
                         committed_len=1, seed=7)
  assert prop.q is None
  np.testing.assert_array_equal(prop.tokens, again.tokens)


# ------------------------------------------------------------------ greedy identity
def _check_greedy(algo, target, tp, draft, dp, enc, L):
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=L)
  got = decoding.run(algo, target, tp, enc, draft=draft, draft_params=dp, max_decode_len=L)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  lengths = np.asarray(ar.lengths)
  assert lengths.min() < L and len(set(lengths.tolist())) > 1  # EOS ends rows raggedly
  st = got.stats
  assert np.all(np.asarray(st.accepted) <= np.asarray(st.decisions))
  assert np.all(np.asarray(st.target_calls) < lengths + 1)
  assert np.asarray(st.accepted).sum() > 0
  # at temperature 0 beta is the acceptance indicator: their sums agree exactly
  np.testing.assert_allclose(np.asarray(st.min_pq_sum), np.asarray(st.accepted))


@pytest.mark.slow
def test_greedy_equals_autoregressive_t5():
  """A real attention model (tree masks, positions m + depth), EOS inside the tree."""
  target, tp, draft, dp = ex.t5_eos_pair()
  enc = np.random.RandomState(2).randint(2, 32, (8, 6)).astype(np.int32)
  enc[3, 3:] = 0
  _check_greedy(_algo(2, 3), target, tp, draft, dp, enc, 12)


@pytest.mark.parametrize("algo", [_algo(1, 4),
                                  decoding.Speculative(gamma=1, drafter=decoding.TreeDrafter(
                                      budget=6, width=2, expand=2, depth=3, steps=3),
                                      verifier=decoding.TreeRRSVerifier())],
                         ids=["chain_w1d4", "best_first_point_mass"])
def test_greedy_equals_autoregressive_markov(algo):
  """A chain (one child per node) and TreeDrafter's deterministic tree (q None: point masses,
  padding nodes)."""
  (target, tp), (draft, dp) = ex.markov_models()["target"], ex.markov_models()["far"]
  enc = np.random.RandomState(3).randint(2, ex.MK_V, (16, 4)).astype(np.int32)
  enc[5, 2:] = 0
  _check_greedy(algo, target, tp, draft, dp, enc, 10)


# ---------------------------------------------------------------------- exactness
def _sample(algo, draft, sampling, seed):
  result, groups = ex.sample(algo, "mk", draft, sampling, rows=ROWS, seed=seed)
  return result, ex.fit(f"{draft} {sampling} {algo.drafter} {algo.verifier}", groups,
                        ex.target_laws("mk", 1, sampling))


def _check_beta(result):
  st = result.stats
  acc, dec = np.asarray(st.accepted).sum(), np.asarray(st.decisions).sum()
  beta = np.asarray(st.min_pq_sum).sum()
  assert abs(acc - beta) < SE_BOUND * np.sqrt(dec * 0.25), (acc, beta, dec)


EXACT = {  # name: (draft, sampling, width, depth, siblings drawn with replacement, seed)
    "far_t1_w3d2": ("far", decoding.Sampling(1.0), 3, 2, False, 300),
    "uniform_t1_w3d2": ("uniform", decoding.Sampling(1.0), 3, 2, False, 301),
    "close_t0.7_topk3_w2d2": ("close", decoding.Sampling(0.7, top_k=3), 2, 2, False, 302),
    # the with-replacement rule is exact for children drawn with replacement
    "iid_far_t1_w3d2": ("far", decoding.Sampling(1.0), 3, 2, True, 303),
}


@pytest.mark.parametrize("case", tiered(list(EXACT), fast=("far_t1_w3d2",)))
def test_sampled_tree_rrs_is_exact(case):
  draft, sampling, width, depth, replace, seed = EXACT[case]
  result, fit = _sample(_algo(width, depth, with_replacement=replace), draft, sampling, seed)
  assert fit.impossible == 0 and fit.p_value > ex.P_REJECT, fit
  _check_beta(result)
  # the tree is used: more than one token per target call on average
  assert np.asarray(result.lengths).sum() > 1.2 * np.asarray(result.stats.target_calls).sum()


@registry.verifier("tree_rrs_unchecked_for_tests")
@dataclasses.dataclass(frozen=True)
class _UncheckedRRS(decoding.TreeRRSVerifier):
  """The with-replacement rule without the drafter check, to apply it where it is wrong."""

  def check_drafter(self, drafter):
    pass


@pytest.mark.slow
def test_negative_control_with_replacement_rule_on_distinct_children_is_rejected():
  algo = _algo(3, 2, verifier=_UncheckedRRS(with_replacement=True))
  _, fit = _sample(algo, "far", decoding.Sampling(1.0), 310)  # tv ~ 0.12 at 30k rows
  assert fit.p_value < ex.P_REJECT or fit.impossible > 0, fit


def test_settings_are_checked():
  with pytest.raises(ValueError, match="width must be an int >= 1"):
    decoding.SampledTreeDrafter(width=0)
  with pytest.raises(ValueError, match="with_replacement must be a bool"):
    decoding.SampledTreeDrafter(with_replacement=1)
  with pytest.raises(ValueError, match="more than 1024"):
    decoding.SampledTreeDrafter(width=4, depth=6)
  with pytest.raises(ValueError, match="verifies chains only"):
    decoding.Speculative(gamma=1, drafter=decoding.SampledTreeDrafter())
  with pytest.raises(ValueError, match="drawn with replacement, but SampledTreeDrafter draws "
                     "them without"):
    _algo(2, 2, verifier=decoding.TreeRRSVerifier(with_replacement=True))
  with pytest.raises(ValueError, match="drawn without replacement, but SampledTreeDrafter draws "
                     "them with"):
    decoding.Speculative(gamma=1, drafter=decoding.SampledTreeDrafter(with_replacement=True),
                         verifier=decoding.TreeRRSVerifier())
  # chains and deterministic trees serve either rule
  decoding.Speculative(gamma=3, verifier=decoding.TreeRRSVerifier(with_replacement=True))
  assert _algo(2, 3).max_proposal == 14
  assert registry.get("drafter", "sampled_tree", width=3).proposal_size(1) == 3 + 9 + 27
  assert isinstance(registry.get("verifier", "tree_rrs"), decoding.TreeRRSVerifier)


def test_verifier_respects_chain_length_and_padding_nodes():
  """Positions at or past a chain's length, and padding nodes (parent -2), are never tested;
  the extra token then comes from p after the last accepted node."""
  V, K = 4, 3
  sampling = decoding.Sampling(1.0)
  p = np.full((2, K + 1, V), 0.25, np.float32)
  p[0, 1] = p[1, 3] = np.eye(V, dtype=np.float32)[3]  # the law after 1 (row 0), 3 (row 1) nodes
  tok = np.array([[2, 2, 2], [1, 2, 3]], np.int32)
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  verifier = decoding.TreeRRSVerifier()
  # q == p at every proposed position: every proposed token is accepted
  chain = decoding.Proposal.chain(jnp.asarray(tok), q=jnp.asarray(p[:, :K]),
                                  length=jnp.array([1, 3]))
  v = verifier.verify(jnp.asarray(p), chain, keys, keys, sampling=sampling)
  np.testing.assert_array_equal(v.accepted, [1, 3])
  np.testing.assert_array_equal(v.decided, [1, 3])
  np.testing.assert_array_equal(v.extra, [3, 3])
  np.testing.assert_array_equal(np.asarray(v.path)[1], [0, 1, 2])
  # a tree whose node 1 (row 0) is padding: the walk stops at node 0
  tree = decoding.Proposal(tokens=jnp.asarray(tok), q=jnp.asarray(p[:, :K]),
                           parent=jnp.array([[-1, -2, -2], [-1, 0, 1]], jnp.int32))
  v = verifier.verify(jnp.asarray(p), tree, keys, keys, sampling=sampling)
  np.testing.assert_array_equal(v.accepted, [1, 3])
  np.testing.assert_array_equal(v.extra, [3, 3])
