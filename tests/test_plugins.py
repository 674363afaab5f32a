"""The plug-in interface: tree decode and keep, hidden states, registries, runner checks.

Oracles: a tree decode's logits at each node equal a plain decode of that
node's path (T5 float32 atol 1e-5, Markov exact); the tree path with a chain
equals today's decode; after `keep` the cache holds the accepted path; the
speculative loop's tree branch, fed a chain, gives the chain branch's tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tiers import tiered
from spec_decode import decoding
from spec_decode.decoding import registry
from spec_decode.models import base, t5
from spec_decode.models.testing import MarkovDecoder

# A tree of 6 nodes after a cached prefix, parents first:
#   root(prefix end) -> 0 -> 1 -> 3
#                    \     \-> 4
#                     -> 2 -> 5
_PARENT = np.array([-1, 0, -1, 1, 1, 2], np.int32)


def _tree(parent):
  proposal = decoding.Proposal(tokens=jnp.zeros((1, len(parent)), jnp.int32), q=None,
                               parent=jnp.asarray(parent)[None])
  return np.asarray(proposal.depths())[0], np.asarray(proposal.ancestor_mask())[0]


def _path(parent, node):
  out = []
  while node >= 0:
    out.append(node)
    node = parent[node]
  return out[::-1]


def test_proposal_depths_and_ancestors():
  depth, mask = _tree(_PARENT)
  np.testing.assert_array_equal(depth, [1, 2, 1, 3, 3, 2])
  for i in range(len(_PARENT)):
    np.testing.assert_array_equal(np.flatnonzero(mask[i]), sorted(_path(_PARENT, i)))
  chain = decoding.Proposal.chain(jnp.zeros((2, 4), jnp.int32))
  np.testing.assert_array_equal(chain.depths(), [[1, 2, 3, 4]] * 2)
  np.testing.assert_array_equal(chain.ancestor_mask()[0], np.tril(np.ones((4, 4), bool)))


def _models():
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  markov = MarkovDecoder(vocab_size=model.vocab_size, order=3)
  return [(model, model.init(jax.random.PRNGKey(0)), 1e-5),
          (markov, markov.init(jax.random.PRNGKey(1)), 0.0)]


@pytest.mark.parametrize("which", tiered([0, 1], fast=("markov",), ids=["t5", "markov"]))
def test_tree_decode_equals_path_decode_and_keep_commits_the_path(which):
  model, params, atol = _models()[which]
  V = model.vocab_size
  rs = np.random.RandomState(4)
  enc = rs.randint(2, V, (2, 7)).astype(np.int32)
  prefix = rs.randint(2, V, (2, 4)).astype(np.int32)
  prefix[:, 0] = 0
  nodes = rs.randint(2, V, (2, len(_PARENT))).astype(np.int32)
  depth, mask = _tree(_PARENT)
  encoded = model.encode(params, enc)
  cache = model.init_cache(params, encoded, 16)
  # Ragged: row 1 has one prefix token fewer.
  cache = model.decode(params, cache, prefix).cache.rewind(np.array([4, 3]))
  lengths = np.array([4, 3])
  out = model.decode(params, cache, nodes, positions=lengths[:, None] + depth[None] - 1,
                     tree_mask=np.broadcast_to(mask, (2,) + mask.shape))
  for b in range(2):
    for i in range(len(_PARENT)):
      path = _path(_PARENT, i)
      seq = np.concatenate([prefix[b, :lengths[b]], nodes[b, path]])[None]
      fresh = model.init_cache(params, jax.tree.map(lambda x: x[b:b + 1], encoded), 16)
      want = model.decode(params, fresh, seq).logits[0, -1]
      np.testing.assert_allclose(out.logits[b, i], want, atol=atol, rtol=0)
  # Keep the path root -> 0 -> 1 -> 4 in row 0 and root -> 2 in row 1, then decode on.
  kept = out.cache.keep(lengths, np.array([[0, 1, 4], [2, 0, 0]]), np.array([3, 1]))
  np.testing.assert_array_equal(kept.lengths, lengths + [3, 1])
  nxt = rs.randint(2, V, (2, 2)).astype(np.int32)
  got = model.decode(params, kept, nxt).logits
  for b, path in ((0, [0, 1, 4]), (1, [2])):
    seq = np.concatenate([prefix[b, :lengths[b]], nodes[b, path], nxt[b]])[None]
    fresh = model.init_cache(params, jax.tree.map(lambda x: x[b:b + 1], encoded), 16)
    want = model.decode(params, fresh, seq).logits[0, -2:]
    np.testing.assert_allclose(got[b], want, atol=atol, rtol=0)


def test_t5_chain_through_the_tree_path_equals_default_decode():
  model, params, _ = _models()[0]
  rs = np.random.RandomState(5)
  enc = rs.randint(2, model.vocab_size, (3, 6)).astype(np.int32)
  toks = rs.randint(2, model.vocab_size, (3, 5)).astype(np.int32)
  cache = model.init_cache(params, model.encode(params, enc), 12)
  cache = model.decode(params, cache, toks[:, :2]).cache.rewind(np.array([2, 1, 0]))
  plain = model.decode(params, cache, toks)
  lengths = np.asarray(cache.lengths)
  tree = model.decode(params, cache, toks, positions=lengths[:, None] + np.arange(5),
                      tree_mask=np.broadcast_to(np.tril(np.ones((5, 5), bool)), (3, 5, 5)))
  np.testing.assert_allclose(tree.logits, plain.logits, atol=1e-5, rtol=0)
  # hidden states are what the LM head reads
  np.testing.assert_allclose(model.logits_from_hidden(params, plain.hidden), plain.logits,
                             atol=1e-5, rtol=0)
  assert plain.hidden.shape == (3, 5, model.config.emb_dim)


def test_decode_rejects_bad_tree_arguments():
  model, params, _ = _models()[0]
  cache = model.init_cache(params, model.encode(params, np.ones((1, 3), np.int32)), 8)
  with pytest.raises(ValueError, match="positions must be an integer array of shape"):
    model.decode(params, cache, np.zeros((1, 2), np.int32), positions=np.zeros((1, 3), int))
  with pytest.raises(ValueError, match="tree_mask must be a bool array"):
    model.decode(params, cache, np.zeros((1, 2), np.int32), tree_mask=np.ones((1, 2, 2)))
  with pytest.raises(ValueError, match="keep needs start"):
    cache.keep(np.zeros(2, int), np.zeros((1, 2), int), np.zeros(1, int))


@registry.verifier("chain_as_tree_for_tests")
@dataclasses.dataclass(frozen=True)
class _ChainAsTree(decoding.ChainVerifier):
  """The chain verifier routed through the loop's tree branch (positions, mask, keep)."""
  chain_only = False


@pytest.mark.parametrize("temperature", tiered([0.0, 1.0], fast=(0.0,)))
def test_speculative_tree_branch_equals_chain_branch(temperature):
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny"))
  draft = t5.T5(t5.T5Config.preset("t5_1_1_tiny", num_decoder_layers=1))
  tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
  enc = np.random.RandomState(2).randint(2, 64, (3, 5)).astype(np.int32)
  kw = dict(draft=draft, draft_params=dp, max_decode_len=12, rng=jax.random.PRNGKey(7),
            sampling=decoding.Sampling(temperature=temperature))
  chain = decoding.run(decoding.Speculative(gamma=3), target, tp, enc, **kw)
  tree = decoding.run(decoding.Speculative(gamma=3, verifier=_ChainAsTree()), target, tp, enc,
                      **kw)
  np.testing.assert_array_equal(tree.tokens, chain.tokens)
  np.testing.assert_array_equal(tree.stats.accepted, chain.stats.accepted)


def test_stats_are_named_counters_sized_by_the_algorithm():
  stats = decoding.Speculative(gamma=5).init_stats(3)
  assert stats.names == ("accepted", "accepted_at", "decided_at", "decisions", "draft_tokens",
                         "first_call_tokens", "min_pq_sum", "nonfinite_calls", "target_calls")
  assert stats.accepted_at.shape == (3, 5) and stats.min_pq_sum.dtype == jnp.float32
  assert decoding.Autoregressive().init_stats(2).names == ("nonfinite_calls", "target_calls")
  bumped = stats.add(accepted=jnp.array([1, 2, 3]))
  np.testing.assert_array_equal(bumped.accepted, [1, 2, 3])
  with pytest.raises(ValueError, match="unknown counters"):
    stats.add(bogus=jnp.zeros(3))
  with pytest.raises(AttributeError, match="no counter 'bogus'"):
    stats.bogus  # noqa: B018


def test_registries_and_runner_checks():
  assert registry.get("algorithm", "speculative", gamma=3) == decoding.Speculative(gamma=3)
  assert isinstance(registry.get("verifier", "chain"), decoding.ChainVerifier)
  assert isinstance(registry.get("drafter", "model"), decoding.ModelDrafter)
  with pytest.raises(ValueError, match="unknown algorithm 'beam'"):
    registry.get("algorithm", "beam")
  hash(decoding.Speculative(gamma=3))  # jit-static
  with pytest.raises(ValueError, match="gamma must be an int >= 1"):
    decoding.Speculative(gamma=0)
  with pytest.raises(ValueError, match="lenience must be in"):
    decoding.Speculative(gamma=2, lenience=0.0)
  model = MarkovDecoder(vocab_size=6)
  params = model.init(jax.random.PRNGKey(0))
  enc = np.ones((1, 2), np.int32)
  with pytest.raises(ValueError, match="needs a draft model"):
    decoding.run(decoding.Speculative(gamma=2), model, params, enc, max_decode_len=4)
  with pytest.raises(ValueError, match="uses no draft model"):
    decoding.run(decoding.Autoregressive(), model, params, enc, draft=model,
                 draft_params=params, max_decode_len=4)
  with pytest.raises(ValueError, match="algorithm must be a decoding Algorithm"):
    decoding.run("speculative", model, params, enc, max_decode_len=4)
  with pytest.raises(ValueError, match="vocabularies differ"):
    other = MarkovDecoder(vocab_size=7)
    decoding.run(decoding.Speculative(gamma=2), model, params, enc, draft=other,
                 draft_params=other.init(jax.random.PRNGKey(0)), max_decode_len=4)


def test_params_of_another_model_are_refused_by_role():
  """The target's and the draft's params swapped, or a checkpoint of another shape: a
  ValueError naming the role and a parameter, before anything is traced."""
  big = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=16))
  small = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=16, num_encoder_layers=1,
                                   num_decoder_layers=1))
  wide = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=16, mlp_dim=40))
  pb, ps = big.init(jax.random.PRNGKey(0)), small.init(jax.random.PRNGKey(1))
  enc = np.array([[3, 4, 1]], np.int32)
  with pytest.raises(ValueError, match=r"the target's params do not match its config "
                                       r"\(T5, .*missing \(e.g. decoder/layers_1/.*swapped"):
    decoding.speculative(big, ps, small, pb, enc, gamma=2, max_decode_len=4)
  with pytest.raises(ValueError, match=r"the draft's params do not match .* not in the model"):
    decoding.speculative(big, pb, small, pb, enc, gamma=2, max_decode_len=4)
  with pytest.raises(ValueError, match=r"of another shape \(e.g. .*mlp.*\(\d+, 40\)"):
    decoding.autoregressive(wide, pb, enc, max_decode_len=4)


def test_token_ids_and_checks_are_public_in_base():
  assert (base.PAD_ID, base.BOS_ID, base.EOS_ID) == (0, 0, 1)
  with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 5\)"):
    base.check_tokens(np.array([[1, 5]]), "tokens", 5)


def test_compiler_options_compile_a_separate_executable_with_equal_outputs():
  model = MarkovDecoder(vocab_size=6, order=2)
  params = model.init(jax.random.PRNGKey(0))
  enc = np.array([[2, 3], [4, 0]], np.int32)
  kw = dict(max_decode_len=6, sampling=decoding.Sampling(temperature=1.0),
            rng=jax.random.PRNGKey(1))
  plain = decoding.run(decoding.Autoregressive(), model, params, enc, **kw)
  tuned = decoding.run(decoding.Autoregressive(), model, params, enc, **kw,
                       compiler_options={"xla_cpu_multi_thread_eigen": False})
  np.testing.assert_array_equal(tuned.tokens, plain.tokens)
  from spec_decode import partitioning
  with pytest.raises(ValueError, match="unsharded runs only"):
    decoding.run(decoding.Autoregressive(), model, params, enc, **kw,
                 mesh=partitioning.make_mesh("data=1"), compiler_options={"a": 1})


def test_default_compiler_options_are_probed_and_explicit_ones_win():
  from spec_decode import compile_options
  if jax.default_backend() == "cpu":
    known = dict(compile_options.defaults())
    assert set(known) <= set(compile_options.CPU_DEFAULTS)
    assert known  # this jaxlib knows the CPU options the project measured
  assert compile_options.defaults("gpu") == ()
  assert not compile_options._supported("xla_cpu_no_such_option", 1)
  assert compile_options.resolve(None) == compile_options.defaults()
  assert compile_options.resolve({}) == ()
  assert compile_options.resolve({"b": 1, "a": 2}) == (("a", 2), ("b", 1))
  with pytest.raises(ValueError, match="mapping"):
    compile_options.resolve([("a", 1)])
  # XLA's defaults ({}) and the project's defaults (None) decode the same tokens
  model = MarkovDecoder(vocab_size=6, order=2)
  params = model.init(jax.random.PRNGKey(0))
  enc = np.array([[2, 3], [4, 0]], np.int32)
  kw = dict(draft=model, draft_params=params, max_decode_len=6,
            sampling=decoding.Sampling(temperature=1.0), rng=jax.random.PRNGKey(1))
  algo = decoding.Speculative(gamma=2)
  ours = decoding.run(algo, model, params, enc, **kw)
  xla = decoding.run(algo, model, params, enc, **kw, compiler_options={})
  np.testing.assert_array_equal(ours.tokens, xla.tokens)


def test_a_crowded_process_releases_its_executables():
  from spec_decode import experiment
  if experiment.memory_map_use() is None:
    pytest.skip("no /proc/self/maps here")
  kept = [jax.jit(lambda x, i=i: jnp.sin(x) * i + 1.0) for i in range(20)]
  for f in kept:  # ~6 memory regions each while its executable is cached
    f(jnp.ones(3)).block_until_ready()
  before = experiment.memory_map_use()[0]
  assert not experiment.release_executables_if_crowded(fraction=1.0)
  assert experiment.release_executables_if_crowded(fraction=0.0)
  assert experiment.memory_map_use()[0] < before - 40
