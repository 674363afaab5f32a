"""Medusa heads as a drafter: exactness, greedy identity, the hidden-state plumbing, files, training."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exactness
from spec_decode import decoding
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.data.tokenized import TokenizedSplit
from spec_decode.experiment import model_specs
from spec_decode.heads import medusa
from spec_decode.models import t5, testing
from spec_decode.models.testing import MarkovDecoder
from spec_decode.train import medusa as train_medusa


def _target(vocab=7, seed=0):
  model = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=vocab))
  return model, model.init(jax.random.PRNGKey(seed))


def _heads(target, num_heads=3, scale=0.5, seed=1):
  """Heads with random residual blocks (zero-initialised ones would all copy the target)."""
  heads = medusa.MedusaHeads(medusa.MedusaConfig.for_target(target, num_heads))
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = heads.init()
  D = target.config.emb_dim
  params = {"w": scale * jax.random.normal(k1, params["w"].shape) / np.sqrt(D),
            "b": scale * jax.random.normal(k2, params["b"].shape)}
  return heads, params


def _medusa(gamma):
  return decoding.Speculative(gamma=gamma, drafter=decoding.MedusaDrafter())


def test_greedy_equals_autoregressive_ragged_batch():
  target, tp = _target(vocab=32)
  heads, hp = _heads(target, num_heads=4)
  enc = np.array([[3, 4, 5, 6, 1, 0], [7, 8, 1, 0, 0, 0], [9, 10, 11, 12, 13, 1]], np.int32)
  ar = decoding.autoregressive(target, tp, enc, max_decode_len=12)
  for gamma in (1, 4):
    spec = decoding.run(_medusa(gamma), target, tp, enc, draft=heads, draft_params=hp,
                        max_decode_len=12)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
    np.testing.assert_array_equal(spec.lengths, ar.lengths)
  # heads that equal the target's next-token law (zero residual) still verify exactly
  spec = decoding.run(_medusa(2), target, tp, enc, draft=heads, draft_params=heads.init(),
                      max_decode_len=12)
  np.testing.assert_array_equal(spec.tokens, ar.tokens)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_output_follows_the_target_law(temperature):
  target, tp = exactness.t5_models()["target"]
  heads, hp = _heads(target, num_heads=2, scale=1.0)
  sampling = decoding.Sampling(temperature=temperature)
  laws = exactness.target_laws("t5", 1, sampling)
  enc = np.repeat(exactness.T5_ENC[:1], exactness.rows(2 / 15), axis=0)
  result = decoding.run(_medusa(2), target, tp, enc, draft=heads, draft_params=hp,
                        max_decode_len=exactness.T5_L, sampling=sampling,
                        rng=jax.random.PRNGKey(3), row_ids=np.arange(enc.shape[0]))
  fit = exactness.fit(f"medusa t={temperature}", [testing.sequences(result)], laws)
  assert fit.p_value > exactness.P_REJECT and fit.impossible == 0
  # the heads did propose: some proposals accepted, some rejected
  accepted, decisions = int(result.stats.accepted.sum()), int(result.stats.decisions.sum())
  assert 0 < accepted < decisions


def test_the_drafter_reads_the_verify_calls_hidden_states():
  """The state after a commit is the target's own state at the extra token's input: the
  hidden states a direct target decode of the committed prefix gives (no second pass)."""
  target, tp = _target(vocab=32)
  heads, hp = _heads(target, num_heads=3)
  enc = np.array([[3, 4, 5, 6, 1, 0]], np.int32)
  seen = []

  class Recording(decoding.MedusaDrafter):
    def commit(self, ctx, hidden, committed, verdict, proposal):
      new = super().commit(ctx, hidden, committed, verdict, proposal)
      jax.debug.callback(lambda h, m: seen.append((np.asarray(h), int(m[0]))), new,
                         committed.length)
      return new

  algo = decoding.Speculative(gamma=3, drafter=Recording())
  out = decoding.run(algo, target, tp, enc, draft=heads, draft_params=hp, max_decode_len=10)
  tokens = np.asarray(out.tokens)[0]
  encoded = target.encode(tp, enc)
  full = target.decode(tp, target.init_cache(tp, encoded, 12),
                       jnp.asarray(np.concatenate([[0], tokens])[None, :11], jnp.int32))
  assert seen
  for h, m in seen:
    if m < int(out.lengths[0]):  # rows still running: the state that predicts s_{m+1}
      np.testing.assert_allclose(h[0], np.asarray(full.hidden)[0, m - 1], atol=1e-5)


def test_save_load_roundtrip_and_errors(tmp_path):
  """Medusa heads in the one format of draft heads (`checkpoints.heads`)."""
  target, _ = _target(vocab=32)
  heads, hp = _heads(target)
  head_checkpoints.save(str(tmp_path / "h"), heads, hp)
  loaded, lp = head_checkpoints.load(str(tmp_path / "h"))
  assert loaded == heads
  for k in hp:
    np.testing.assert_array_equal(lp[k], hp[k])
    assert lp[k].dtype == jnp.float32
  spec_model, spec_params = model_specs.load(
      model_specs.ModelSpec(kind="medusa", checkpoint=str(tmp_path / "h")),
      model_specs.LoadContext("draft", vocab_size=32))
  assert spec_model == heads
  with pytest.raises(ValueError, match="not empty"):
    head_checkpoints.save(str(tmp_path / "h"), heads, hp)
  with pytest.raises(ValueError, match="not a Medusa heads checkpoint"):
    head_checkpoints.load(str(tmp_path / "missing"), kind="medusa")
  other = medusa.MedusaHeads(medusa.MedusaConfig.for_target(target, 5))
  shutil.copytree(tmp_path / "h", tmp_path / "wide")
  (tmp_path / "wide" / "medusa_config.json").write_text(json.dumps(other.config.to_json()))
  with pytest.raises(ValueError, match="do not match"):
    head_checkpoints.load(str(tmp_path / "wide"))


def _save_legacy(path, heads, params):
  """The Medusa file format before `checkpoints.heads` (medusa.json + params.msgpack)."""
  from spec_decode.checkpoints import msgpack_codec
  os.makedirs(path)
  arrays = {k: np.asarray(v, np.float32) for k, v in params.items()}
  with open(os.path.join(path, "params.msgpack"), "wb") as f:
    f.write(msgpack_codec.encode(arrays))
  meta = {"format": "spec_decode.medusa", "config": dataclasses.asdict(heads.config),
          "info": {"note": "test"}}
  with open(os.path.join(path, "medusa.json"), "w", encoding="utf-8") as f:
    json.dump(meta, f)


def test_old_medusa_files_still_load_or_get_a_clear_error(tmp_path):
  target, _ = _target(vocab=32)
  heads, hp = _heads(target)
  _save_legacy(str(tmp_path / "old"), heads, hp)
  for kind in (None, "medusa"):
    loaded, lp = head_checkpoints.load(str(tmp_path / "old"), kind=kind)
    assert loaded == heads
    for k in hp:
      np.testing.assert_array_equal(lp[k], hp[k])
  os.makedirs(tmp_path / "partial")
  (tmp_path / "partial" / "medusa.json").write_text((tmp_path / "old" / "medusa.json").read_text())
  with pytest.raises(ValueError, match="partial"):
    head_checkpoints.load(str(tmp_path / "partial"))
  (tmp_path / "partial" / "params.msgpack").write_bytes(
      (tmp_path / "old" / "params.msgpack").read_bytes()[:40])
  with pytest.raises(ValueError, match="corrupt"):
    head_checkpoints.load(str(tmp_path / "partial"))
  meta = json.loads((tmp_path / "old" / "medusa.json").read_text())
  meta["config"]["num_heads"] = 5
  (tmp_path / "partial" / "medusa.json").write_text(json.dumps(meta))
  (tmp_path / "partial" / "params.msgpack").write_bytes(
      (tmp_path / "old" / "params.msgpack").read_bytes())
  with pytest.raises(ValueError, match="corrupt.*shape"):
    head_checkpoints.load(str(tmp_path / "partial"))


def test_mismatched_models_and_settings_are_refused():
  target, tp = _target(vocab=32)
  heads, hp = _heads(target, num_heads=2)
  enc = np.array([[3, 4, 1]], np.int32)
  other = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=32, emb_dim=16))
  with pytest.raises(ValueError, match="emb_dim"):
    decoding.run(_medusa(2), other, other.init(jax.random.PRNGKey(0)), enc, draft=heads,
                 draft_params=hp, max_decode_len=4)
  with pytest.raises(ValueError, match="exceeds the 2 Medusa heads"):
    decoding.run(_medusa(3), target, tp, enc, draft=heads, draft_params=hp, max_decode_len=4)
  markov = MarkovDecoder(vocab_size=32, order=1)
  with pytest.raises(ValueError, match="needs Medusa heads"):
    decoding.run(_medusa(2), target, tp, enc, draft=markov,
                 draft_params=markov.init(jax.random.PRNGKey(0)), max_decode_len=4)
  with pytest.raises(ValueError, match="num_heads"):
    medusa.MedusaConfig(num_heads=0, emb_dim=8, vocab_size=8)


@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_agreement(tmp_path):
  from spec_decode import checkpoints
  target, tp = _target(vocab=32, seed=3)
  checkpoints.save(str(tmp_path / "target"), target.config, tp, format="t5x")
  rng = np.random.default_rng(0)
  inputs = tuple(tuple(int(t) for t in rng.integers(3, 32, size=6)) + (1,) for _ in range(64))
  split = TokenizedSplit(inputs, tuple((5, 1) for _ in inputs))
  cfg = train_medusa.MedusaTrainConfig(target_checkpoint=str(tmp_path / "target"), task="unused",
                           export_path=str(tmp_path / "heads"), num_heads=2, num_steps=40,
                           batch_size=16, learning_rate=1e-2, input_length=8, target_length=8,
                           teacher_examples=64, eval_examples=32, log_every=1)
  out = train_medusa.train(cfg, report=lambda msg: None, train_split=split, eval_split=split)
  first, last = out.history[0], out.history[-1]  # after steps 1 and 40
  assert last["loss"] < first["loss"] - 0.05
  assert last["head2_agreement"] >= first["head2_agreement"]
  heads, params = head_checkpoints.load(str(tmp_path / "heads"))
  assert heads.num_heads == 2
  np.testing.assert_allclose(params["w"], out.params["w"], atol=0)
  from spec_decode.checkpoints import storage  # the export names the target it trained on
  assert head_checkpoints.trained_for(str(tmp_path / "heads")) == {
      "target_checkpoint": str(tmp_path / "target"),
      "target_fingerprint": storage.fingerprint(str(tmp_path / "target"))}


@pytest.mark.slow
def test_training_resumes_from_its_workdir(tmp_path):
  import dataclasses

  from spec_decode import checkpoints
  target, tp = _target(vocab=32, seed=3)
  checkpoints.save(str(tmp_path / "target"), target.config, tp, format="t5x")
  split = TokenizedSplit(((3, 4, 1), (5, 1)), ((6, 7, 1), (8, 1)))
  cfg = train_medusa.MedusaTrainConfig(target_checkpoint=str(tmp_path / "target"), task="unused",
                           num_heads=2, num_steps=2, batch_size=2, input_length=4,
                           target_length=4, teacher_examples=2, eval_examples=2,
                           workdir=str(tmp_path / "w"))
  kw = dict(train_split=split, eval_split=split)
  train_medusa.train(cfg, report=lambda s: None, **kw)
  messages = []
  more = dataclasses.replace(cfg, num_steps=3, export_path=str(tmp_path / "heads3"))
  resumed = train_medusa.train(more, report=messages.append, **kw)
  assert any("resumed from step 2" in m for m in messages)
  heads, params = head_checkpoints.load(str(tmp_path / "heads3"))
  np.testing.assert_array_equal(params["w"], np.asarray(resumed.params["w"]))


@pytest.mark.parametrize("task", ["ende", "cnndm"])
def test_demo_heads_config_and_shipped_heads(task):
  from gin_files import shipped_head
  cfg, heads, params = shipped_head(task, "medusa", train_medusa.MedusaTrainConfig,
                                    head_checkpoints.load)
  assert heads.num_heads == cfg.num_heads
  # trained: the residual blocks moved away from their zero start
  assert float(jnp.abs(params["w"]).max()) > 0
