"""Oracles of the exit adapter (heads/exit_adapter.py, Kangaroo) and of self-speculation
through it (`LayerSkipDrafter(adapter=True)`), and of its training recipe
(train/exit_adapter.py).

* Identity: an adapter copied from the target's last decoder layer, after the layers before
  it, IS the target: its greedy proposals are all accepted and the output is the target's.
* Greedy identity with autoregressive decoding for a random adapter (chain and block
  verifiers); exactness: sequence-level chi-square against the target's enumerated law at
  t=1 and with top-p, the drafter checked to have proposed and been accepted.
* Training computes what decoding computes: the recipe's teacher-forced adapter states equal
  the draft model's decode of the same tokens, and a short run lowers the KL, exports a
  head checkpoint that `ModelSpec(kind='exit_adapter')` loads and that decodes.
* Errors name the problem: no adapter, a T5 in its place, another exit layer, another shape.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from spec_decode import decoding
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.data.tokenized import TokenizedSplit
from spec_decode.decoding.drafters.layer_skip import LayerSkipDrafter
from spec_decode.experiment import model_specs
from spec_decode.heads.exit_adapter import ExitAdapter, ExitAdapterConfig
from spec_decode.models import t5, testing
from spec_decode.train import exit_adapter as recipe
from spec_decode.train.heads import target_features

L = 12


@functools.lru_cache(maxsize=None)
def _setup():
  """A tiny T5 target (2 decoder layers) with vocab 64, inputs, its greedy outputs."""
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=64))
  tp = target.init(jax.random.PRNGKey(40))
  rs = np.random.RandomState(41)
  enc = rs.randint(2, 64, (8, 10)).astype(np.int32)
  for row, n in enumerate(rs.randint(3, 11, 8)):
    enc[row, n:] = 0
  return target, tp, enc, decoding.autoregressive(target, tp, enc, max_decode_len=L)


def _adapter(target, tp, *, perturb: float | None, seed: int = 0):
  """An adapter after layer 0: the target's layer 1 copied, perturbed by `perturb` (None:
  exactly the copy)."""
  adapter = ExitAdapter(ExitAdapterConfig.for_target(target.config, 1))
  params = adapter.from_target_layer(tp, 1)
  return adapter, params if perturb is None else testing.perturbed(params, seed, perturb)


def _run(target, tp, enc, adapter, params, verifier=decoding.ChainVerifier(), **kw):
  algo = decoding.Speculative(gamma=3, drafter=LayerSkipDrafter(layers=1, adapter=True),
                              verifier=verifier)
  assert algo.needs_draft
  return decoding.run(algo, target, tp, enc, draft=adapter, draft_params=params,
                      max_decode_len=L, **kw)


def test_an_adapter_copying_the_last_layer_is_the_target():
  target, tp, enc, ar = _setup()
  got = _run(target, tp, enc, *_adapter(target, tp, perturb=None))
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  st = got.stats
  assert int(np.sum(st.accepted)) == int(np.sum(st.draft_tokens)) > 0  # every token accepted


@pytest.mark.parametrize("verifier", [decoding.ChainVerifier(), decoding.BlockVerifier()],
                         ids=["chain", "block"])
def test_greedy_with_a_random_adapter_equals_autoregressive(verifier):
  target, tp, enc, ar = _setup()
  got = _run(target, tp, enc, *_adapter(target, tp, perturb=0.05, seed=3), verifier=verifier)
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
  st = got.stats
  assert 0 < int(np.sum(st.accepted)) < int(np.sum(st.draft_tokens))  # right and wrong


@pytest.mark.parametrize("sampling,verifier", [
    (decoding.Sampling(1.0), decoding.ChainVerifier()),
    pytest.param(decoding.Sampling(1.0, top_p=0.9), decoding.BlockVerifier(),
                 marks=pytest.mark.slow)], ids=["chain_t1", "block_topp0.9"])
def test_self_speculation_with_an_adapter_is_exact(sampling, verifier):
  algo = decoding.Speculative(gamma=3, drafter=LayerSkipDrafter(layers=1, adapter=True),
                              verifier=verifier)
  make = lambda target: _adapter(target, ex.t5_models()["target"][1], perturb=0.3, seed=5)
  fit, result = ex.head_law_fit(algo, make, f"exit adapter {verifier} {sampling}",
                                sampling=sampling)
  assert fit.impossible == 0
  assert fit.p_value >= ex.P_REJECT, fit
  assert int(np.sum(result.stats.accepted)) > 0


def test_training_states_are_the_drafts_decode():
  """The recipe's teacher-forced adapter states equal what the draft model (the target's
  first layer, then the adapter) decodes for the same tokens: training and drafting agree."""
  target, tp, enc, ar = _setup()
  adapter, params = _adapter(target, tp, perturb=0.5, seed=7)
  dec_in = np.concatenate([np.zeros((enc.shape[0], 1), np.int32),
                           np.asarray(ar.tokens)[:, :-1]], axis=1)
  encoded, _, _ = target_features(target, tp, enc, dec_in)
  states = recipe.adapted_states(adapter, params, target, tp, encoded, dec_in)
  draft, dp = adapter.draft(target), adapter.draft_params(tp, params)
  out = draft.decode(dp, draft.init_cache(dp, draft.encode(dp, enc), dec_in.shape[1]), dec_in)
  np.testing.assert_allclose(states, out.hidden, rtol=1e-5, atol=1e-5)
  assert dp["decoder"]["layers_0"] is tp["decoder"]["layers_0"]  # the target's own leaves
  assert dp["decoder"]["layers_1"] is params["layers_0"]


def _split(rows: int, seed: int):
  rs = np.random.RandomState(seed)
  inputs = [list(rs.randint(2, 64, rs.randint(4, 10))) + [1] for _ in range(rows)]
  targets = [list(rs.randint(2, 64, rs.randint(4, 10))) + [1] for _ in range(rows)]
  return TokenizedSplit(inputs, targets)


def test_a_short_training_run_lowers_the_kl_and_exports_a_decodable_adapter(tmp_path):
  target, tp, enc, ar = _setup()
  cfg = recipe.ExitAdapterTrainConfig(
      layers=1, init_from_target=False, batch_size=8, num_steps=30, learning_rate=3e-3,
      warmup_steps=0, schedule="constant", log_every=10, eval_every=30, save_every=30,
      eval_examples=16, input_length=12, target_length=12, prefixes="target",
      teacher_examples=32, export_path=str(tmp_path / "adapter"), workdir=None)
  logs = []
  result = cfg.run(report=logs.append, target=target, target_params=tp,
                   train_split=_split(32, 1), eval_split=_split(16, 2))
  kl = [h["kl"] for h in result.history]
  assert kl[-1] < kl[0], logs
  spec = model_specs.ModelSpec(kind="exit_adapter", checkpoint=str(tmp_path / "adapter"))
  adapter, params = model_specs.load(spec, model_specs.LoadContext(role="draft", vocab_size=64))
  assert isinstance(adapter, ExitAdapter) and adapter.layers == 1
  got = _run(target, tp, enc, adapter, params)
  np.testing.assert_array_equal(got.tokens, ar.tokens)


def test_checkpoint_round_trip(tmp_path):
  target, tp, _, _ = _setup()
  adapter, params = _adapter(target, tp, perturb=0.1)
  head_checkpoints.save(str(tmp_path / "a"), adapter, params)
  loaded, lp = head_checkpoints.load(str(tmp_path / "a"))
  assert loaded == adapter
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(lp)):
    np.testing.assert_array_equal(a, b)


def test_errors_name_the_problem():
  target, tp, enc, _ = _setup()
  adapter, params = _adapter(target, tp, perturb=None)
  algo = lambda **kw: decoding.Speculative(gamma=2, drafter=LayerSkipDrafter(**kw))
  with pytest.raises(ValueError, match="needs a draft model"):
    decoding.run(algo(layers=1, adapter=True), target, tp, enc, max_decode_len=4)
  with pytest.raises(ValueError, match="exit adapter"):
    decoding.run(algo(layers=1, adapter=True), target, tp, enc, draft=target, draft_params=tp,
                 max_decode_len=4)
  other = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=64, num_decoder_layers=4))
  deep = ExitAdapter(ExitAdapterConfig.for_target(other.config, 3))
  with pytest.raises(ValueError, match="after 3 decoder layers"):
    decoding.run(algo(layers=1, adapter=True), target, tp, enc, draft=deep,
                 draft_params=deep.init(jax.random.PRNGKey(0)), max_decode_len=4)
  with pytest.raises(ValueError, match="needs a target with more than 3"):
    deep.check_target(target)
  wide = ExitAdapter(ExitAdapterConfig.for_target(target.config, 1, mlp_dim=7))
  with pytest.raises(ValueError, match="mlp_dim differ"):
    decoding.run(algo(layers=1, adapter=True), target, tp, enc, draft=wide,
                 draft_params=wide.init(jax.random.PRNGKey(0)), max_decode_len=4)
  with pytest.raises(ValueError, match="adapter must be True or False"):
    LayerSkipDrafter(adapter=1)
  with pytest.raises(ValueError, match="layers must be an int"):
    ExitAdapterConfig.for_target(target.config, 0)
  with pytest.raises(ValueError, match="exit adapter params"):
    adapter.check_params({"layers_0": {}})


@pytest.mark.parametrize("verify_tokens", [0, 4])
def test_the_adapters_proposals_are_timed_through_the_adapter(verify_tokens):
  """Its cost loops (alone, and each proposal after a verify call) run the draft the decode
  call runs: the target's first layer and the adapter."""
  from spec_decode.decoding import timing
  target, tp, enc, _ = _setup()
  adapter, params = _adapter(target, tp, perturb=0.1)
  w = timing.Workload(target=target, target_params=tp, encoder_tokens=enc[:2],
                      cache_length=L + 5, position=L // 2, draft=adapter, draft_params=params)
  loop = LayerSkipDrafter(layers=1, adapter=True).proposal_loop(
      w, gamma=3, steps=2, verify_tokens=verify_tokens)
  assert np.all(np.isfinite(np.asarray(jax.block_until_ready(loop()))))


def test_refilled_self_speculation_with_an_adapter_equals_autoregressive():
  """A dataset decoded in 3 refilled slots: each row is what it decodes alone (greedy)."""
  target, tp, enc, ar = _setup()
  got = _run(target, tp, enc, *_adapter(target, tp, perturb=0.05, seed=3), refill_batch=3)
  np.testing.assert_array_equal(got.tokens, ar.tokens)
  np.testing.assert_array_equal(got.lengths, ar.lengths)
