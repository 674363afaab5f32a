"""DeepSeek-V3-style MTP modules and their drafter (heads/mtp.py, heads/train_mtp.py,
decoding/drafters/mtp.py).

* Greedy identity: speculative decoding with the MTP drafter equals autoregressive
  greedy decoding (ragged batch, EOS), with briefly trained modules (which get tokens
  accepted) and random ones, at gamma = D and gamma < D; the target is traced once
  per loop body (the modules read the verify call's states: no second target pass).
* Exactness at temperature 1: the sequence law matches the target's exact law (the
  chi-square oracle of tests/exactness.py).
* The drafter's incremental state is the teacher-forced network: every proposal's
  law q_k equals the softmax of module k's teacher-forced logits at position m - 1
  on [s_0 .. s_m, x_1 .. x_{k-1}] with the target's own features.
* Training lowers the loss; checkpoints round-trip; misuse gets a clear error.
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
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.decoding.drafters.mtp import MtpDrafter
from spec_decode.heads import mtp
from spec_decode.kernels import cpu_matmul
from spec_decode.models import base, t5
from spec_decode.train import mtp as train_mtp
from test_eagle import L, N, S, V, _CountingT5, tiny_target_and_split
from test_speculative import _check_greedy_rows

D = 3


def _speculative(gamma=D):
  return decoding.Speculative(gamma=gamma, drafter=MtpDrafter())


@functools.lru_cache(maxsize=None)
def _setup():
  """test_eagle's tiny target, ragged batch and greedy outputs, and D modules trained on
  them."""
  target, tp, enc, ar_tokens, ar_lengths, split = tiny_target_and_split()
  cfg = train_mtp.MtpTrainConfig(num_modules=D, batch_size=16, num_steps=60, input_length=S,
                                 target_length=L, learning_rate=3e-3, warmup_steps=5,
                                 log_every=10, eval_every=1000, eval_examples=N)
  result = train_mtp.train(cfg, report=lambda s: None, train_split=split,
                                   eval_split=split, target=target, target_params=tp)
  return target, tp, enc, ar_tokens, ar_lengths, result


@pytest.mark.slow
def test_training_loss_decreases():
  *_, result = _setup()
  losses = [h["loss"] for h in result.history]
  assert losses[-1] < 0.7 * losses[0], losses
  assert result.history[-1]["agree_1"] > result.history[0]["agree_1"]
  assert result.head.num_modules == D and set(result.params) == {"mtp_1", "mtp_2", "mtp_3"}


@pytest.mark.parametrize("trained,gamma", tiered([(True, D), (True, 2), (False, D)],
                                                 fast=((True, D),)))
def test_greedy_equals_autoregressive(trained, gamma):
  target0, tp, enc, ar_tokens, ar_lengths, result = _setup()
  modules = result.head
  params = result.params if trained else modules.init(jax.random.PRNGKey(7))
  # A counting target for the trained cases (each gamma compiles its own loop).
  target = _CountingT5(target0.config) if trained else target0
  _CountingT5.traces.update(decode=0, encode=0)
  out = decoding.run(_speculative(gamma), target, tp, enc, draft=modules, draft_params=params,
                     max_decode_len=L)
  if trained:
    assert _CountingT5.traces == {"decode": 1, "encode": 1}  # the verify call; one encoding
  near_ties = _check_greedy_rows(target0, tp, enc, range(N), np.asarray(out.tokens),
                                 np.asarray(out.lengths), ar_tokens, ar_lengths)
  assert near_ties == 0
  stats = out.stats
  if trained:  # the trained modules get tokens accepted: the acceptance path is exercised
    assert int(np.sum(stats.accepted)) > N
  # The first call proposes nothing; every later call proposes gamma tokens.
  assert np.all(np.asarray(stats.draft_tokens) == gamma * (np.asarray(stats.target_calls) - 1))


@pytest.mark.slow
def test_sequence_law_is_exact_at_temperature_1():
  def random_modules(target):
    modules = mtp.MtpModules(mtp.MtpConfig.for_target(target.config, num_modules=2))
    return modules, modules.init(jax.random.PRNGKey(5))

  fit, result = ex.head_law_fit(_speculative(gamma=2), random_modules, "mtp t5 T=1")
  assert fit.p_value > ex.P_REJECT
  accepted, decisions = int(np.sum(result.stats.accepted)), int(np.sum(result.stats.decisions))
  assert 0 < accepted < decisions  # both acceptances and rejections happened


class _RecordingDrafter(MtpDrafter):
  """Sends each proposal's (iteration, committed tokens and length, drafts, laws) to the host."""
  log = []

  def propose(self, ctx, state, committed, keys, num):
    proposal, new_state = super().propose(ctx, state, committed, keys, num)
    record = lambda *a: type(self).log.append(tuple(np.asarray(x) for x in a))
    jax.debug.callback(record, committed.it, committed.tokens, committed.length,
                       proposal.tokens, proposal.q, ordered=True)
    return proposal, new_state


@pytest.mark.slow
def test_proposals_are_the_teacher_forced_modules():
  """The drafter's caches and feature window reproduce the modules run teacher-forced on
  the whole prefix: q_k = softmax(LM(h^k_{m-1})) on [s_0 .. s_m, x_1 .. x_{k-1}], f from
  a direct target pass (ragged rows, accepted and rejected proposals)."""
  target, tp, enc, _, _, result = _setup()
  modules, params = result.head, result.params
  _RecordingDrafter.log.clear()
  out = decoding.run(decoding.Speculative(gamma=D, drafter=_RecordingDrafter()), target, tp,
                     enc, draft=modules, draft_params=params, max_decode_len=L,
                     sampling=decoding.Sampling(temperature=1.0), rng=jax.random.PRNGKey(3),
                     row_ids=np.arange(N))
  jax.block_until_ready(out.tokens)
  T = L + D + 1
  encoded = target.encode(tp, enc)

  @jax.jit
  def teacher_forced_laws(seq_BT):
    cache = target.init_cache(tp, encoded, T)
    feats = target.decode(tp, cache, seq_BT).hidden
    states = modules.forward(params, encoded, feats, lambda x: target.embed(tp, x), seq_BT)
    return jnp.stack([jax.nn.softmax(target.logits_from_hidden(tp, h), axis=-1)
                      for h in states], axis=1)  # [B, D, T, V]

  checked = 0
  for it, tokens, length, drafts, q in _RecordingDrafter.log:
    if it == 0:
      continue
    seq = np.zeros((N, T), np.int32)
    for b in range(N):
      m = int(length[b])
      seq[b, 1:m + 1] = tokens[b, :m]
      seq[b, m + 1:m + 1 + D] = drafts[b]
    laws = np.asarray(teacher_forced_laws(seq))
    for b in range(N):
      m = int(length[b])
      if m >= L:
        continue
      np.testing.assert_allclose(q[b], laws[b, :, m - 1], atol=2e-5)
      checked += 1
  assert checked >= N  # every row, over several iterations
  assert 0 < int(np.sum(out.stats.accepted)) < int(np.sum(out.stats.decisions))


def test_checkpoint_round_trip_and_errors(tmp_path):
  from spec_decode.experiment import model_specs
  target, tp, enc, *_, result = _setup()
  head_checkpoints.save(str(tmp_path / "m"), result.head, result.params, step=7)
  modules, params = model_specs.load(
      model_specs.ModelSpec(kind="mtp", checkpoint=str(tmp_path / "m")),
      model_specs.LoadContext("draft", vocab_size=V))
  assert modules == result.head
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, jax.device_get(result.params))
  half, hparams = head_checkpoints.load(str(tmp_path / "m"), kind="mtp", dtype="bfloat16")
  assert half.config.dtype == jnp.bfloat16
  assert hparams["mtp_2"]["fc"]["kernel"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="not an MTP module checkpoint"):
    head_checkpoints.load("demo_models/ende_target", kind="mtp")
  with pytest.raises(ValueError, match="do not match"):
    modules.check_params({"mtp_1": params["mtp_1"]})
  with pytest.raises(ValueError, match="gamma 4 exceeds the 3 MTP modules"):
    decoding.run(_speculative(gamma=4), target, tp, enc, draft=modules, draft_params=params,
                 max_decode_len=L)
  wide = mtp.MtpModules(mtp.MtpConfig(vocab_size=V, d_model=48, num_modules=2))
  with pytest.raises(ValueError, match="does not match the target"):
    decoding.run(_speculative(gamma=2), target, tp, enc, draft=wide,
                 draft_params=wide.init(jax.random.PRNGKey(0)), max_decode_len=L)
  with pytest.raises(ValueError, match="needs MTP modules"):
    decoding.run(_speculative(), target, tp, enc, draft=target, draft_params=tp,
                 max_decode_len=L)
  with pytest.raises(ValueError, match="num_modules must be an int >= 1"):
    mtp.MtpConfig(vocab_size=V, d_model=32, num_modules=0)
  with pytest.raises(ValueError, match="not head\\['num_modules'\\]"):
    train_mtp.MtpTrainConfig(head={"num_modules": 2})
  with pytest.raises(ValueError, match="depth_decay"):
    dataclasses.replace(train_mtp.MtpTrainConfig(), depth_decay=0.0)


@pytest.mark.parametrize("task", ["ende", "cnndm"])
def test_demo_modules_config_and_shipped_modules(task):
  from gin_files import shipped_head
  cfg, modules, params = shipped_head(task, "mtp", train_mtp.MtpTrainConfig,
                                      head_checkpoints.load)
  assert modules.num_modules == cfg.num_modules
  modules.check_params(params)


def test_modules_decode_with_the_packed_kernel_as_a_target_does():
  """Modules wide enough for the CPU kernel are laid out for it (`MtpModules.decode_params`:
  each module's layer and fc kernels packed, as an EAGLE head's are), a window step gives the
  unpacked modules' states, and the loop (which decodes with that layout) still equals
  autoregressive greedy decoding."""
  if not cpu_matmul.available():
    pytest.skip(f"the CPU decoding kernel is not available: {cpu_matmul.unavailable_reason()}")
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=V, emb_dim=256, mlp_dim=512))
  tp = target.init(jax.random.PRNGKey(3))
  modules = mtp.MtpModules(mtp.MtpConfig.for_target(target.config, num_modules=2))
  mp = modules.init(jax.random.PRNGKey(4))
  packed = base.decoding_params(modules, mp)
  is_packed = lambda x: isinstance(x, cpu_matmul.PackedKernel)
  for k in (1, 2):
    one = modules.module_params(packed, k)
    assert is_packed(one["fc"]["kernel"]) and is_packed(one["layers_0"]["mlp"]["wo"]["kernel"])
  rs = np.random.RandomState(0)
  enc = rs.randint(2, V, (3, S)).astype(np.int32)
  encoded = target.encode(tp, enc)
  states = jnp.asarray(rs.randn(3, 4, modules.d_model), jnp.float32)
  tokens = jnp.asarray(rs.randint(2, V, (3, 4)), jnp.int32)
  at = jnp.asarray([0, 2, 3], jnp.int32)
  got = []
  for p in (mp, packed):
    cache = modules.init_caches(p, encoded, 8, 2)[1]
    h, _, logits = modules.window_step(p, 2, cache, states, tokens, at, target, tp)
    got.append((np.asarray(h), np.asarray(logits)))
  np.testing.assert_allclose(got[1][0], got[0][0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got[1][1], got[0][1], rtol=1e-4, atol=1e-4)
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=L)
  out = decoding.run(_speculative(2), target, tp, enc, draft=modules, draft_params=mp,
                     max_decode_len=L)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
