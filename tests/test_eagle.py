"""EAGLE head and drafter (spec_decode/heads/eagle.py, decoding/drafters/eagle.py).

* Greedy identity: speculative decoding with the EAGLE drafter equals
  autoregressive greedy decoding (ragged batch, EOS), with a briefly trained head
  (which does get tokens accepted) and with a random one.
* Exactness at temperature 1: the sequence law matches the target's exact law
  (the chi-square oracle of tests/test_speculative.py, via tests/exactness.py), for
  final-state, fused (EAGLE-3) and learned-start heads.
* A learned start: the first call drafts gamma tokens too, from the head's prediction
  of f_0; it trains, and a trained one saves target calls.
* No second target pass: the target is traced once per loop body, and every
  target feature the drafter receives equals the final decoder state of a
  direct teacher-forced target decode of the output.
* Training: the loss decreases; the training-time test's step 1 is the
  head's teacher-forced forward and its step 2 is exactly what a drafting head
  computes; the run resumes from its workdir.
* Checkpoint round trip; a head that does not fit the target is refused.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness as ex
from spec_decode import decoding
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.cli import gin as gin_layer
from spec_decode.data.tokenized import TokenizedSplit
from spec_decode.decoding.drafters.eagle import EagleDrafter, EagleTreeDrafter
from spec_decode.decoding.types import Proposal
from spec_decode.decoding.verifiers.chain import greedy_verdict
from spec_decode.heads import eagle
from spec_decode.kernels import cpu_matmul
from spec_decode.models import base, t5
from spec_decode.train import eagle as train_eagle
from spec_decode.train import heads as train_heads
from test_speculative import _check_greedy_rows

V, N, S, L = 8, 16, 6, 12


def _speculative(gamma=3):
  return decoding.Speculative(gamma=gamma, drafter=EagleDrafter())


@functools.lru_cache(maxsize=None)
def tiny_target_and_split():
  """A tiny target, a ragged batch, its greedy outputs (lengths 3 .. 12) and the split of
  (input, greedy output) pairs a head trains on."""
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=V))
  tp = target.init(jax.random.PRNGKey(7))
  rs = np.random.RandomState(31)
  enc = rs.randint(2, V, (N, S)).astype(np.int32)
  for row, n in enumerate(rs.randint(1, S + 1, N)):
    enc[row, n:] = 0
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=L)
  ar_tokens, ar_lengths = np.asarray(ar.tokens), np.asarray(ar.lengths)
  split = TokenizedSplit(
      tuple(tuple(int(t) for t in row[row > 0]) for row in enc),
      tuple(tuple(int(t) for t in row[:n]) for row, n in zip(ar_tokens, ar_lengths)))
  return target, tp, enc, ar_tokens, ar_lengths, split


@functools.lru_cache(maxsize=None)
def _setup():
  """tiny_target_and_split() and a head trained on it."""
  target, tp, enc, ar_tokens, ar_lengths, split = tiny_target_and_split()
  cfg = train_eagle.EagleTrainConfig(unroll=2, batch_size=16, num_steps=60, input_length=S,
                                     target_length=L, learning_rate=3e-3, warmup_steps=5,
                                     log_every=10, eval_every=1000, eval_examples=N)
  result = train_eagle.train(cfg, report=lambda s: None, train_split=split,
                                  eval_split=split, target=target, target_params=tp)
  return target, tp, enc, ar_tokens, ar_lengths, result


def _teacher_features(target, tp, enc, tokens):
  """(decoder inputs [BOS, tokens[:, :-1]], encoder output, the target's features) of
  teacher-forcing `tokens`."""
  dec_in = np.concatenate([np.zeros((tokens.shape[0], 1), np.int32), tokens[:, :-1]], axis=1)
  encoded, feats, _ = train_heads.target_features(target, tp, enc, dec_in)
  return dec_in, encoded, feats


def test_outputs_are_ragged_and_end_with_eos():
  *_, ar_tokens, ar_lengths, _ = tiny_target_and_split()
  assert len(set(ar_lengths.tolist())) > 1
  ended = [r for r in range(N) if ar_lengths[r] < L]
  assert ended and all(ar_tokens[r, ar_lengths[r] - 1] == t5.EOS_ID for r in ended)


@pytest.mark.slow
def test_training_loss_decreases():
  *_, result = _setup()
  losses = [h["loss"] for h in result.history]
  assert losses[-1] < 0.7 * losses[0], losses
  assert result.history[-1]["agree_1"] > result.history[0]["agree_1"]


@pytest.mark.parametrize("trained", [True, False])
def test_greedy_equals_autoregressive(trained):
  target, tp, enc, ar_tokens, ar_lengths, result = _setup()
  head = result.head
  hp = result.params if trained else head.init(jax.random.PRNGKey(7))
  out = decoding.run(_speculative(), target, tp, enc, draft=head, draft_params=hp,
                     max_decode_len=L)
  near_ties = _check_greedy_rows(target, tp, enc, range(N), np.asarray(out.tokens),
                                 np.asarray(out.lengths), ar_tokens, ar_lengths)
  assert near_ties == 0
  stats = out.stats
  if trained:  # the trained head gets tokens accepted: the acceptance path is exercised
    assert int(np.sum(stats.accepted)) > N
  # The first call proposes nothing (one token); every later call proposes gamma tokens.
  assert np.all(np.asarray(stats.draft_tokens) == 3 * (np.asarray(stats.target_calls) - 1))
  np.testing.assert_array_equal(stats.first_call_tokens, 1)


def _random_head(target):
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config))
  return head, head.init(jax.random.PRNGKey(5))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["final_state", "fused", "start"])
def test_sequence_law_is_exact_at_temperature_1(kind):
  """The final-state head, the EAGLE-3 fused one and one with a learned start (whose first
  call drafts too)."""
  make = {"final_state": _random_head, "fused": _fused_head, "start": _start_head}[kind]
  fit, result = ex.head_law_fit(_speculative(gamma=2), make, f"eagle {kind} t5 T=1")
  assert fit.p_value > ex.P_REJECT
  accepted, decisions = int(np.sum(result.stats.accepted)), int(np.sum(result.stats.decisions))
  assert 0 < accepted < decisions  # both acceptances and rejections happened


class _CountingT5(t5.T5):
  """A T5 that counts how often its decoder and encoder are traced."""
  traces = {"decode": 0, "encode": 0}

  def decode(self, params, cache, tokens, **kw):
    type(self).traces["decode"] += 1
    return super().decode(params, cache, tokens, **kw)

  def encode(self, params, encoder_tokens):
    type(self).traces["encode"] += 1
    return super().encode(params, encoder_tokens)


class _RecordingDrafter(EagleDrafter):
  """Sends each commit's (old length, accepted, target features) to the host."""
  log = []

  def commit(self, ctx, state, committed, verdict, proposal):
    record = lambda m, n, hidden: type(self).log.append(
        (np.asarray(m), np.asarray(n), np.asarray(hidden)))
    jax.debug.callback(record, state.cache.lengths, verdict.accepted, committed.target_hidden,
                       ordered=True)
    return super().commit(ctx, state, committed, verdict, proposal)


def test_target_features_come_from_the_verify_call_alone():
  target0, tp, enc, _, _, result = _setup()
  target = _CountingT5(target0.config)
  _RecordingDrafter.log.clear()
  out = decoding.run(decoding.Speculative(gamma=3, drafter=_RecordingDrafter()), target, tp,
                     enc, draft=result.head, draft_params=result.params, max_decode_len=L)
  jax.block_until_ready(out.tokens)
  assert _CountingT5.traces == {"decode": 1, "encode": 1}  # the verify call; one encoding
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  # The target's own teacher-forced final decoder states on [s_0 .. s_{L-1}].
  dec_in = np.concatenate([np.zeros((N, 1), np.int32), tokens[:, :-1]], axis=1)
  cache = target0.init_cache(tp, target0.encode(tp, enc), L)
  direct = np.asarray(target0.decode(tp, cache, dec_in).hidden)
  checked = 0
  for m, n, hidden in _RecordingDrafter.log:
    for b in range(N):
      for i in range(int(n[b]) + 1):  # f_m .. f_{m+n}: states along the committed tokens
        pos = int(m[b]) + i
        if pos < lengths[b]:
          np.testing.assert_allclose(hidden[b, i], direct[b, pos], atol=2e-5, rtol=1e-4)
          checked += 1
  assert checked >= int(np.sum(lengths))  # every committed position was seen at least once


@pytest.mark.slow
def test_training_time_test_matches_drafting():
  """Unroll step 1 = the head's teacher-forced forward; unroll step 2 at query i = the
  head drafting one token ahead from a cache holding the true pairs 0 .. i."""
  target, tp, enc, ar_tokens, _, result = _setup()
  head, hp = result.head, result.params
  T = 8
  dec_in, encoded, feats = _teacher_features(target, tp, enc, ar_tokens[:, :T])
  embed = lambda x: target.embed(tp, x)
  step1, step2 = train_eagle.unrolled_predictions(head, hp, encoded, feats, embed, dec_in, 2)
  forward = head.forward(hp, encoded, feats, embed(np.roll(dec_in, -1, axis=1)))
  np.testing.assert_allclose(step1[:, :T - 1], forward[:, :T - 1], atol=1e-5)
  step = jax.jit(head.step)
  for i in range(T - 2):
    cache = head.init_cache(hp, encoded, T)
    _, cache = step(hp, cache, feats[:, :i + 1], embed(dec_in[:, 1:i + 2]))
    pred, _ = step(hp, cache, step1[:, i:i + 1], embed(dec_in[:, i + 2:i + 3]))
    np.testing.assert_allclose(step2[:, i], pred[:, 0], atol=1e-5)


def test_loss_weights_the_feature_regression_and_the_cross_entropy():
  """EAGLE-1's loss (feature regression + ce_weight x CE) and EAGLE-3's (CE alone) are the
  step weights' mean of feature_weight x reg_j + ce_weight x ce_j."""
  target, tp, enc, ar_tokens, *_ = tiny_target_and_split()
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, fuse_layers=(0,)))
  hp = head.init(jax.random.PRNGKey(3))
  dec_in = np.concatenate([np.zeros((N, 1), np.int32), ar_tokens[:, :L - 1]], axis=1)
  batch = {"encoder_tokens": enc, "decoder_inputs": dec_in,
           "weights": (ar_tokens > 0).astype(np.float32)}
  loss = lambda **w: train_eagle.eagle_loss(head, hp, target, tp, batch, unroll=2,
                                            unroll_decay=0.5, **w)
  _, m = loss(ce_weight=1.0, feature_weight=1.0)
  assert float(m["reg_1"]) > 0 and float(m["ce_1"]) > 0
  for fw, cw in ((1.0, 0.1), (0.0, 1.0), (2.0, 0.0)):
    value, _ = loss(ce_weight=cw, feature_weight=fw)
    want = sum(w * (fw * m[f"reg_{j}"] + cw * m[f"ce_{j}"])
               for j, w in ((1, 1.0), (2, 0.5))) / 1.5
    np.testing.assert_allclose(value, want, rtol=1e-5)
  # A learned start adds its f_0 term at weight 1 and its first draft's chain (s1, s2),
  # weighted as the unroll's steps.
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, start_feature=True))
  hp = head.init(jax.random.PRNGKey(3))
  value, m = loss(ce_weight=0.1, feature_weight=1.0)
  assert float(m["reg_0"]) > 0 and "agree_0" in m and float(m["reg_s2"]) > 0
  term = lambda j: m[f"reg_{j}"] + 0.1 * m[f"ce_{j}"]
  want = sum(w * term(j) for j, w in (("0", 1.0), ("1", 1.0), ("2", 0.5), ("s1", 1.0),
                                      ("s2", 0.5))) / 4
  np.testing.assert_allclose(value, want, rtol=1e-5)
  # first_draft_weight scales the chain's terms; 0 leaves them out (the loss before them).
  value, _ = loss(ce_weight=0.1, feature_weight=1.0, first_draft_weight=0.5)
  want = sum(w * term(j) for j, w in (("0", 1.0), ("1", 1.0), ("2", 0.5), ("s1", 0.5),
                                      ("s2", 0.25))) / 3.25
  np.testing.assert_allclose(value, want, rtol=1e-5)
  value, m0 = loss(ce_weight=0.1, feature_weight=1.0, first_draft_weight=0.0)
  assert "reg_s1" not in m0
  want = sum(w * term(j) for j, w in (("0", 1.0), ("1", 1.0), ("2", 0.5))) / 2.5
  np.testing.assert_allclose(value, want, rtol=1e-5)
  with pytest.raises(ValueError, match="first_draft_weight"):
    train_eagle.EagleTrainConfig(first_draft_weight=-1.0)


@pytest.mark.parametrize("fuse_layers", [(), (0,)])
def test_start_chain_is_the_first_draft(fuse_layers):
  """The loss's start chain (`train.eagle.start_chain`) computes what the drafter computes
  on a row's first call: teacher-forced on the drafted tokens, its f'_0 is the drafter's
  feature and its predictions' LM-head argmaxes are the drafted tokens (final-state and
  fused heads)."""
  from spec_decode.decoding.runner import LoopContext
  from spec_decode.decoding.types import Committed
  target, tp, enc, *_ = tiny_target_and_split()
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, start_feature=True,
                                                      fuse_layers=fuse_layers))
  hp = head.init(jax.random.PRNGKey(11))
  gamma = 4
  ctx = LoopContext(target=target, target_params=tp, draft=head, draft_params=hp,
                    encoder_tokens=jnp.asarray(enc), draft_encoder_tokens=None,
                    rng=jax.random.PRNGKey(0), row_ids=jnp.arange(N), max_decode_len=L,
                    sampling=decoding.Sampling(temperature=0.0))
  drafter = EagleDrafter()
  state = drafter.init(ctx, L + gamma + 1)
  committed = Committed(tokens=jnp.zeros((N, L + gamma + 1), jnp.int32),
                        length=jnp.zeros((N,), jnp.int32), it=jnp.int32(0))
  proposal, _ = drafter.propose(ctx, state, committed, jnp.zeros((N, gamma, 2), jnp.uint32),
                                gamma)
  drafted = np.asarray(proposal.tokens)
  assert np.all(np.asarray(proposal.length) == gamma)
  dec_in = np.concatenate([np.zeros((N, 1), np.int32), drafted], axis=1)
  chain = train_eagle.start_chain(head, hp, target.encode(tp, enc),
                                  lambda x: target.embed(tp, x), dec_in, gamma - 1)
  np.testing.assert_allclose(chain[0][:, 0], state.feature, atol=1e-5)
  chosen = [np.argmax(np.asarray(target.logits_from_hidden(tp, f))[:, 0], -1) for f in chain]
  np.testing.assert_array_equal(np.stack(chosen, 1), drafted)


@pytest.mark.slow
def test_training_resumes_from_its_workdir(tmp_path):
  target, tp, *_ = _setup()
  split = TokenizedSplit(((3, 4, 1), (5, 1)), ((6, 7, 1), (7, 1)))  # ids < V
  cfg = train_eagle.EagleTrainConfig(unroll=2, batch_size=2, num_steps=2, input_length=4,
                                     target_length=4, workdir=str(tmp_path / "w"),
                                     export_path=str(tmp_path / "head"))
  kw = dict(train_split=split, eval_split=split, target=target, target_params=tp)
  train_eagle.train(cfg, report=lambda s: None, **kw)
  messages = []
  more = dataclasses.replace(cfg, num_steps=3, export_path=str(tmp_path / "head3"))
  resumed = train_eagle.train(more, report=messages.append, **kw)
  assert any("resumed from step 2" in m for m in messages)
  head, params = head_checkpoints.load(str(tmp_path / "head3"), kind="eagle")
  assert head == resumed.head
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, jax.device_get(resumed.params))


def test_checkpoint_round_trip(tmp_path):
  *_, result = _setup()
  head_checkpoints.save(str(tmp_path / "h"), result.head, result.params, step=7)
  head, params = head_checkpoints.load(str(tmp_path / "h"), kind="eagle")
  assert head == result.head
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, jax.device_get(result.params))
  half, hparams = head_checkpoints.load(str(tmp_path / "h"), kind="eagle", dtype="bfloat16")
  assert half.config.dtype == jnp.bfloat16 and hparams["fc"]["kernel"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="not an EAGLE head"):
    head_checkpoints.load("demo_models/ende_target", kind="eagle")
  with pytest.raises(ValueError, match="do not match"):
    head.check_params({"fc": {"kernel": np.zeros((2, 2))}})


def test_mismatched_head_is_refused():
  target, tp, enc, *_ = _setup()
  wide = eagle.EagleHead(eagle.EagleConfig(vocab_size=V, d_model=48))
  with pytest.raises(ValueError, match="does not match the target"):
    decoding.run(_speculative(), target, tp, enc, draft=wide,
                 draft_params=wide.init(jax.random.PRNGKey(0)), max_decode_len=L)
  other_vocab = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, vocab_size=V + 1))
  with pytest.raises(ValueError, match="vocabularies differ"):
    decoding.run(_speculative(), target, tp, enc, draft=other_vocab,
                 draft_params=other_vocab.init(jax.random.PRNGKey(0)), max_decode_len=L)
  with pytest.raises(ValueError, match="needs an EagleHead"):
    decoding.run(_speculative(), target, tp, enc, draft=target, draft_params=tp,
                 max_decode_len=L)
  with pytest.raises(ValueError, match="needs a T5 target"):
    wide.check_target(ex.markov_models()["target"][0])


def test_empty_proposal_is_a_plain_step():
  """Proposal.length 0: nothing accepted or decided; the extra token comes from p at the root."""
  B, K, Vs = 2, 3, 5
  p = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (B, K + 1, Vs)), axis=-1)
  proposal = Proposal.chain(jnp.argmax(p[:, 1:], -1).astype(jnp.int32),
                            length=jnp.zeros((B,), jnp.int32))
  v = greedy_verdict(jnp.argmax(p, -1).astype(jnp.int32), proposal)
  assert np.all(np.asarray(v.accepted) == 0) and np.all(np.asarray(v.decided) == 0)
  np.testing.assert_array_equal(v.extra, jnp.argmax(p[:, 0], -1))
  q = jax.nn.one_hot(proposal.tokens, Vs)
  keys = jax.random.split(jax.random.PRNGKey(1), B)
  verify = jax.jit(lambda ck: decoding.ChainVerifier().verify(
      p, Proposal.chain(proposal.tokens, q, proposal.length), keys, ck,
      sampling=decoding.Sampling(temperature=1.0)))
  draws = []
  for seed in range(400):
    v = verify(jax.random.split(jax.random.PRNGKey(seed), B))
    assert np.all(np.asarray(v.accepted) == 0) and np.all(np.asarray(v.decided) == 0)
    draws.append(np.asarray(v.extra))
  freq = np.stack([np.bincount(np.asarray(draws)[:, b], minlength=Vs) / 400 for b in range(B)])
  np.testing.assert_allclose(freq, np.asarray(p[:, 0]), atol=0.08)


def test_eagle_is_registered_and_gin_configurable():
  import gin

  assert decoding.registry.get("drafter", "eagle") == EagleDrafter()
  gin_layer.register_gin()
  gin.clear_config()
  gin.parse_config("eagle/Speculative.drafter = @EagleDrafter()\neagle/Speculative.gamma = 5")
  with gin.config_scope("eagle"):
    algo = gin.get_configurable(decoding.Speculative)()
  gin.clear_config()
  assert algo == _speculative(gamma=5)


@pytest.mark.parametrize("task", ["ende", "cnndm"])
def test_demo_head_config_and_shipped_head(task):
  from gin_files import shipped_head
  _, head, params = shipped_head(task, "eagle", train_eagle.EagleTrainConfig,
                                 head_checkpoints.load)
  head.check_params(params)


def _tree_speculative(**tree):
  return decoding.Speculative(gamma=3, drafter=EagleTreeDrafter(**tree),
                              verifier=decoding.TreeVerifier())


@pytest.mark.slow
def test_tree_step_equals_the_chain_along_each_path():
  """EagleHead.step on a tree (positions m + depth - 1, ancestor mask): every node's
  prediction equals a chain step over its own path from the same cache."""
  target, tp, enc, ar_tokens, _, result = _setup()
  head, hp = result.head, result.params
  m = 3
  dec_in, encoded, feats = _teacher_features(target, tp, enc, ar_tokens[:, :m])
  embed = lambda x: target.embed(tp, x)
  cache = head.init_cache(hp, encoded, L)
  _, cache = head.step(hp, cache, feats, embed(ar_tokens[:, :m]))  # the pairs of s_0 .. s_{m-1}
  parent = np.array([-1, -1, 0, 0, 1, 3], np.int32)
  proposal = Proposal(tokens=jnp.zeros((N, 6), jnp.int32), q=None,
                      parent=jnp.broadcast_to(parent, (N, 6)))
  depth = np.asarray(proposal.depths())
  rs = np.random.RandomState(0)
  node_feats = rs.normal(size=(N, 6, head.d_model)).astype(np.float32)
  node_tokens = rs.randint(2, V, (N, 6)).astype(np.int32)
  tree, _ = head.step(hp, cache, node_feats, embed(node_tokens), positions=m + depth - 1,
                      tree_mask=proposal.ancestor_mask())
  for i in range(6):
    path = [i]
    while parent[path[0]] >= 0:
      path.insert(0, int(parent[path[0]]))
    chain, _ = head.step(hp, cache, node_feats[:, path], embed(node_tokens[:, path]))
    np.testing.assert_allclose(tree[:, i], chain[:, -1], atol=1e-5)


@pytest.mark.slow
def test_width_1_tree_is_the_chain_drafter():
  """A one-child-per-node tree grown for gamma rounds is the chain drafter's proposal, so
  the greedy decode (tokens, target calls, acceptances per row) is the chain's: the tree
  scoring and the commit along the accepted path feed the head what the chain does."""
  target, tp, enc, ar_tokens, ar_lengths, result = _setup()
  kw = dict(draft=result.head, draft_params=result.params, max_decode_len=L)
  chain = decoding.run(_speculative(gamma=3), target, tp, enc, **kw)
  tree = decoding.run(_tree_speculative(budget=3, width=1, expand=1, depth=3, steps=3),
                      target, tp, enc, **kw)
  np.testing.assert_array_equal(tree.tokens, chain.tokens)
  for name in ("target_calls", "accepted", "draft_tokens"):
    np.testing.assert_array_equal(getattr(tree.stats, name), getattr(chain.stats, name))
  assert int(np.sum(chain.stats.accepted)) > N


def test_tree_greedy_equals_autoregressive_and_accepts_more():
  target, tp, enc, ar_tokens, ar_lengths, result = _setup()
  kw = dict(draft=result.head, draft_params=result.params, max_decode_len=L)
  out = decoding.run(_tree_speculative(budget=8, width=2, expand=2, depth=4, steps=4), target,
                     tp, enc, **kw)
  near_ties = _check_greedy_rows(target, tp, enc, range(N), np.asarray(out.tokens),
                                 np.asarray(out.lengths), ar_tokens, ar_lengths)
  assert near_ties == 0
  chain = decoding.run(_speculative(gamma=3), target, tp, enc, **kw)
  assert int(np.sum(out.stats.target_calls)) <= int(np.sum(chain.stats.target_calls))


@pytest.mark.slow
def test_tree_sequence_law_is_exact_at_temperature_1():
  algo = _tree_speculative(budget=6, width=2, expand=2, depth=3, steps=3)
  fit, result = ex.head_law_fit(algo, _random_head, "eagle tree t5 T=1")
  assert fit.p_value > ex.P_REJECT
  assert 0 < int(np.sum(result.stats.accepted)) < int(np.sum(result.stats.decisions))


class _RecordingTreeDrafter(EagleTreeDrafter):
  """Sends each commit's (new length, the head's predicted next feature) to the host."""
  log = []

  def commit(self, ctx, state, committed, verdict, proposal):
    new = super().commit(ctx, state, committed, verdict, proposal)
    record = lambda *a: type(self).log.append(tuple(np.asarray(x) for x in a))
    jax.debug.callback(record, committed.length, new.feature, ordered=True)
    return new


@pytest.mark.slow
def test_tree_commit_feeds_the_head_the_accepted_paths_states():
  """After each commit of a wide tree, the head's predicted feature equals its
  teacher-forced prediction on the TRUE target states of the output: the target states
  were gathered along the accepted path (not the first nodes)."""
  target, tp, enc, _, _, result = _setup()
  head, hp = result.head, result.params
  _RecordingTreeDrafter.log.clear()
  algo = decoding.Speculative(gamma=3, verifier=decoding.TreeVerifier(),
                              drafter=_RecordingTreeDrafter(budget=8, width=3, expand=2,
                                                            depth=4, steps=4))
  out = decoding.run(algo, target, tp, enc, draft=head, draft_params=hp, max_decode_len=L)
  jax.block_until_ready(out.tokens)
  tokens = np.asarray(out.tokens)
  _, encoded, feats = _teacher_features(target, tp, enc, tokens)
  forward = np.asarray(head.forward(hp, encoded, feats, target.embed(tp, tokens)))
  checked, before = 0, np.zeros(N, int)
  for length, feature in _RecordingTreeDrafter.log:
    for b in range(N):
      if length[b] > before[b]:  # a commit that grew the row (finished rows only idle)
        np.testing.assert_allclose(feature[b], forward[b, length[b] - 1], atol=2e-4)
        checked += 1
    before = np.maximum(before, length)
  assert checked >= N


# ------------------------------------------------------------------ EAGLE-3 feature fusion
def _fused_head(target, layers=(0,)):
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, fuse_layers=layers))
  return head, head.init(jax.random.PRNGKey(5))


def _start_head(target):
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, start_feature=True))
  return head, head.init(jax.random.PRNGKey(5))


@pytest.mark.slow
def test_start_head_drafts_from_the_first_call_and_trains():
  """A head with a learned start proposes gamma tokens on every call, the first too (its
  f_0 predicted from the encoder output), and greedy outputs stay the target's; a briefly
  trained one gets tokens accepted on the first call."""
  target, tp, enc, ar_tokens, ar_lengths, split = tiny_target_and_split()
  cfg = train_eagle.EagleTrainConfig(unroll=2, batch_size=16, num_steps=60, input_length=S,
                                     target_length=L, learning_rate=3e-3, warmup_steps=5,
                                     log_every=10, eval_every=1000, eval_examples=N,
                                     head={"start_feature": True})
  result = train_eagle.train(cfg, report=lambda s: None, train_split=split, eval_split=split,
                             target=target, target_params=tp)
  assert result.head.has_start and "agree_0" in result.history[-1]
  assert result.history[-1]["reg_0"] < 0.7 * result.history[0]["reg_0"]  # f_0 is learned
  for head, hp in (_start_head(target), (result.head, result.params)):
    out = decoding.run(_speculative(), target, tp, enc, draft=head, draft_params=hp,
                       max_decode_len=L)
    assert _check_greedy_rows(target, tp, enc, range(N), np.asarray(out.tokens),
                              np.asarray(out.lengths), ar_tokens, ar_lengths) == 0
    stats = out.stats
    np.testing.assert_array_equal(stats.draft_tokens, 3 * np.asarray(stats.target_calls))
  # The trained start is right often enough that the first calls accept tokens: fewer
  # target calls than the same rows would need with a first call that drafts nothing.
  plain = decoding.run(_speculative(), target, tp, enc, draft=_setup()[-1].head,
                       draft_params=_setup()[-1].params, max_decode_len=L)
  assert int(np.sum(out.stats.target_calls)) < int(np.sum(plain.stats.target_calls))
  assert np.mean(out.stats.first_call_tokens) > 1 and np.all(plain.stats.first_call_tokens == 1)
  tree = decoding.run(_tree_speculative(budget=6), target, tp, enc, draft=result.head,
                      draft_params=result.params, max_decode_len=L)
  assert _check_greedy_rows(target, tp, enc, range(N), np.asarray(tree.tokens),
                            np.asarray(tree.lengths), ar_tokens, ar_lengths) == 0


def test_start_prediction_leaves_the_cache_empty_and_round_trips(tmp_path):
  target, tp, enc, *_ = tiny_target_and_split()
  head, hp = _start_head(target)
  assert hp["start"]["feature"].shape == (target.config.emb_dim,)
  cache = head.init_cache(hp, target.encode(tp, enc), L)
  bos = target.embed(tp, np.zeros((N, 1), np.int32))
  f0 = head.start_prediction(hp, cache, bos)
  assert f0.shape == (N, target.config.emb_dim) and np.all(np.asarray(cache.lengths) == 0)
  # The same as a step on (start, e(s_0)) over the empty cache: rows differ by their inputs.
  start = np.broadcast_to(np.asarray(hp["start"]["feature"]), (N, 1, target.config.emb_dim))
  np.testing.assert_allclose(f0, head.step(hp, cache, start, bos)[0][:, 0], atol=1e-6)
  assert not np.allclose(f0[0], f0[1])
  head_checkpoints.save(str(tmp_path / "h"), head, hp, step=1)
  loaded, _ = head_checkpoints.load(str(tmp_path / "h"), kind="eagle")
  assert loaded == head and loaded.has_start
  assert "start_feature" not in eagle.EagleConfig.for_target(target.config).to_json()
  plain, pp = _random_head(target)
  with pytest.raises(ValueError, match="has no learned start"):
    plain.start_prediction(pp, cache, bos)
  with pytest.raises(ValueError, match="start_feature must be a bool"):
    eagle.EagleConfig.for_target(target.config, start_feature=1)


def test_decode_returns_the_requested_layers_streams():
  target, tp, enc, ar_tokens, *_ = tiny_target_and_split()
  dec_in = np.concatenate([np.zeros((N, 1), np.int32), ar_tokens[:, :5]], axis=1)
  cache = target.init_cache(tp, target.encode(tp, enc), 6)
  out = target.decode(tp, cache, dec_in, layers=(1, 0))
  plain = target.decode(tp, cache, dec_in)
  assert plain.features is None and out.features.shape == (N, 6, 2 * target.config.emb_dim)
  np.testing.assert_array_equal(np.asarray(out.hidden), np.asarray(plain.hidden))
  D = target.config.emb_dim
  # the last layer's stream, normed, is the final state
  last = target.config.num_decoder_layers - 1
  if last == 1:
    normed = t5._rms_norm(out.features[..., :D], tp["decoder"]["decoder_norm"]["scale"],
                          target.config.layer_norm_epsilon)
    np.testing.assert_allclose(np.asarray(normed), np.asarray(out.hidden), atol=1e-6)
  with pytest.raises(ValueError, match="not decoder layers"):
    target.decode(tp, cache, dec_in, layers=(9,))


def test_fused_head_greedy_equals_autoregressive():
  target, tp, enc, ar_tokens, ar_lengths = tiny_target_and_split()[:5]
  head, hp = _fused_head(target)
  assert head.target_layers == (0,) and "fuse" in hp and "fuse_norm_0" in hp
  out = decoding.run(_speculative(), target, tp, enc, draft=head, draft_params=hp,
                     max_decode_len=L)
  assert _check_greedy_rows(target, tp, enc, range(N), np.asarray(out.tokens),
                            np.asarray(out.lengths), ar_tokens, ar_lengths) == 0
  tree = decoding.run(_tree_speculative(budget=6), target, tp, enc, draft=head,
                      draft_params=hp, max_decode_len=L)
  assert _check_greedy_rows(target, tp, enc, range(N), np.asarray(tree.tokens),
                            np.asarray(tree.lengths), ar_tokens, ar_lengths) == 0


def test_fused_head_reads_the_verify_calls_layer_streams():
  """A fusing drafter gets [final states; layer streams] from the verify call itself: both
  halves equal a direct teacher-forced decode of the output at every committed position."""
  target, tp, enc, *_ = tiny_target_and_split()
  head, hp = _fused_head(target)
  _RecordingDrafter.log.clear()
  out = decoding.run(decoding.Speculative(gamma=3, drafter=_RecordingDrafter()), target, tp,
                     enc, draft=head, draft_params=hp, max_decode_len=L)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  dec_in = np.concatenate([np.zeros((N, 1), np.int32), tokens[:, :-1]], axis=1)
  direct = target.decode(tp, target.init_cache(tp, target.encode(tp, enc), L), dec_in,
                         layers=(0,))
  want = np.concatenate([np.asarray(direct.hidden), np.asarray(direct.features)], -1)
  checked = 0
  for m, n, hidden in _RecordingDrafter.log:
    assert hidden.shape[-1] == 2 * target.config.emb_dim
    for b in range(N):
      for i in range(int(n[b]) + 1):
        pos = int(m[b]) + i
        if pos < lengths[b]:
          np.testing.assert_allclose(hidden[b, i], want[b, pos], atol=2e-5, rtol=1e-4)
          checked += 1
  assert checked >= int(np.sum(lengths))


def test_fused_head_checkpoint_config_and_refusals(tmp_path):
  target, tp, *_ = tiny_target_and_split()
  head, hp = _fused_head(target)
  head_checkpoints.save(str(tmp_path / "h"), head, hp, step=1)
  loaded, params = head_checkpoints.load(str(tmp_path / "h"), kind="eagle")
  assert loaded == head and loaded.config.fuse_layers == (0,)
  plain = eagle.EagleConfig.for_target(target.config)
  assert "fuse_layers" not in plain.to_json()  # EAGLE-1 files read as before
  with pytest.raises(ValueError, match="fuse_layers must be distinct"):
    eagle.EagleConfig.for_target(target.config, fuse_layers=(0, 0))
  deep, _ = _fused_head(target, layers=(7,))
  with pytest.raises(ValueError, match="needs a target with more than 7 decoder layers"):
    deep.check_target(target)
  with pytest.raises(ValueError, match="needs features of"):
    head.target_input(hp, np.zeros((1, 2, target.config.emb_dim), np.float32))


@pytest.mark.slow
def test_fused_head_training_learns():
  target, tp, enc, ar_tokens, ar_lengths, split = tiny_target_and_split()
  cfg = train_eagle.EagleTrainConfig(unroll=2, batch_size=16, num_steps=40, input_length=S,
                                     target_length=L, learning_rate=3e-3, warmup_steps=5,
                                     log_every=10, eval_every=1000, eval_examples=N,
                                     head={"fuse_layers": (0,)})
  result = train_eagle.train(cfg, report=lambda s: None, train_split=split, eval_split=split,
                             target=target, target_params=tp)
  assert result.head.target_layers == (0,)
  losses = [h["loss"] for h in result.history]
  assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("layers", [(), (0,)])
def test_head_decodes_with_the_packed_kernel_as_a_target_does(layers):
  """A head wide enough for the CPU kernel is laid out for it (`EagleHead.decode_params`:
  its layer's, fc's and fuse's kernels packed, as `T5.decode_params` packs a target's), its
  steps give the unpacked head's features, and the loop (which decodes with that layout)
  still equals autoregressive greedy decoding."""
  if not cpu_matmul.available():
    pytest.skip(f"the CPU decoding kernel is not available: {cpu_matmul.unavailable_reason()}")
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=V, emb_dim=256, mlp_dim=512))
  tp = target.init(jax.random.PRNGKey(3))
  head = eagle.EagleHead(eagle.EagleConfig.for_target(target.config, fuse_layers=layers))
  hp = head.init(jax.random.PRNGKey(4))
  packed = base.decoding_params(head, hp)
  is_packed = lambda x: isinstance(x, cpu_matmul.PackedKernel)
  assert is_packed(packed["fc"]["kernel"]) and is_packed(packed["layers_0"]["mlp"]["wo"]["kernel"])
  assert is_packed(packed["fuse"]["kernel"]) if layers else "fuse" not in packed
  rs = np.random.RandomState(0)
  enc = rs.randint(2, V, (3, S)).astype(np.int32)
  encoded = target.encode(tp, enc)
  D = head.d_model
  feats = jnp.asarray(rs.randn(3, 4, D * (1 + len(layers))), jnp.float32)
  emb = jnp.asarray(rs.randn(3, 4, D), jnp.float32)
  got = [np.asarray(head.step(p, head.init_cache(p, encoded, 8), head.target_input(p, feats),
                              emb)[0]) for p in (hp, packed)]
  np.testing.assert_allclose(got[1], got[0], rtol=1e-4, atol=1e-4)
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=L)
  out = decoding.run(_speculative(), target, tp, enc, draft=head, draft_params=hp,
                     max_decode_len=L)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
