"""The trainer: losses, deterministic batches, loss decrease, exact resume, distillation."""

import jax
import numpy as np
import pytest

from spec_decode import checkpoints, train
from spec_decode.models import t5
from spec_decode.train import data as train_data
from spec_decode.train import losses

V = 64


def _copy_split(n: int, seed: int) -> train_data.TokenizedSplit:
  """A toy task: the target is the input reversed (ids 3..V-1), both ending with EOS."""
  rng = np.random.default_rng(seed)
  ins, outs = [], []
  for _ in range(n):
    x = tuple(int(t) for t in rng.integers(3, V, rng.integers(2, 7)))
    ins.append(x + (1,))
    outs.append(tuple(reversed(x)) + (1,))
  return train_data.TokenizedSplit(tuple(ins), tuple(outs))


def _cfg(**kw):
  base = dict(model={"preset": "t5_1_1_tiny"}, batch_size=16, num_steps=40, log_every=10,
              eval_every=1000, eval_examples=64, input_length=8, target_length=8,
              learning_rate=3e-3, warmup_steps=5, save_every=1000)
  return train.TrainConfig(**{**base, **kw})


def test_cross_entropy_and_z_loss_match_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = rng.integers(0, 5, (2, 3))
  w = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  loss, z, correct, total = losses.cross_entropy(logits, targets, w, z_loss=1e-4)
  lse = np.log(np.exp(logits).sum(-1))
  nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, ((nll + 1e-4 * lse ** 2) * w).sum(), rtol=1e-5)
  np.testing.assert_allclose(z, (1e-4 * lse ** 2 * w).sum(), rtol=1e-5)
  np.testing.assert_allclose(correct, ((logits.argmax(-1) == targets) * w).sum())
  assert float(total) == 3.0


def test_divergences_match_numpy():
  rng = np.random.default_rng(1)
  a, b = rng.normal(size=(2, 1, 2, 6)).astype(np.float32)
  w = np.ones((1, 2), np.float32)
  p = np.exp(a) / np.exp(a).sum(-1, keepdims=True)
  q = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
  fkl, agree, _ = losses.divergence(a, b, w, kind="fkl")
  np.testing.assert_allclose(fkl, (p * np.log(p / q)).sum(), rtol=1e-5)
  rkl, _, _ = losses.divergence(a, b, w, kind="rkl")
  np.testing.assert_allclose(rkl, (q * np.log(q / p)).sum(), rtol=1e-5)
  tvd, _, _ = losses.divergence(a, b, w, kind="tvd")
  np.testing.assert_allclose(tvd, 0.5 * np.abs(p - q).sum(), rtol=1e-5)
  np.testing.assert_allclose(agree, (a.argmax(-1) == b.argmax(-1)).sum())
  same, _, _ = losses.divergence(a, a, w, kind="fkl")
  np.testing.assert_allclose(same, 0.0, atol=1e-5)
  greedy, _, _ = losses.divergence(a, b, w, kind="fkl", temperature=0.0)
  logq = np.log(q)
  np.testing.assert_allclose(greedy, -np.take_along_axis(logq, a.argmax(-1)[..., None], -1).sum(),
                             rtol=1e-5)
  with pytest.raises(ValueError, match="unknown divergence"):
    losses.divergence(a, b, w, kind="js")


def test_batches_are_a_function_of_the_step():
  split = _copy_split(50, 0)
  seen = np.concatenate([train_data.batch_indices(50, s, 10, seed=3) for s in range(5)])
  assert sorted(seen) == list(range(50))  # one epoch = one permutation
  b1 = train_data.batch_at(split, 7, batch_size=10, seed=3, input_length=8, target_length=8)
  b2 = train_data.batch_at(split, 7, batch_size=10, seed=3, input_length=8, target_length=8)
  for k in b1:
    np.testing.assert_array_equal(b1[k], b2[k])
  np.testing.assert_array_equal(b1["decoder_inputs"][:, 1:], b1["decoder_targets"][:, :-1])
  np.testing.assert_array_equal(b1["decoder_inputs"][:, 0], 0)
  np.testing.assert_array_equal(b1["weights"], b1["decoder_targets"] > 0)


@pytest.mark.slow
def test_loss_decreases_on_a_tiny_run():
  split, val = _copy_split(400, 0), _copy_split(64, 1)
  for opt in ("adamw", "adafactor"):
    r = train.train(_cfg(optimizer=opt, log_every=1), train_split=split, eval_split=val,
                    report=lambda s: None)
    first = r.history[0]  # metrics of step 1 are computed with the initial parameters
    assert r.eval["token_loss"] < first["token_loss"] - 0.5, (opt, first, r.eval)
    assert np.mean([h["loss"] for h in r.history[-5:]]) < first["loss"] - 0.5


def test_data_outside_the_vocabulary_is_refused():
  split = _copy_split(8, 0)
  wide = train_data.TokenizedSplit(split.inputs, tuple(t[:-1] + (10_000, 1) for t in
                                                      split.targets))
  with pytest.raises(ValueError, match="token id 10000, outside the model's vocabulary"):
    train.train(_cfg(), train_split=wide, eval_split=split, report=lambda s: None)


def test_settings_that_would_waste_or_lose_a_run_are_refused_before_training(tmp_path):
  with pytest.raises(ValueError, match="num_steps must be an int >= 1 .*untrained"):
    _cfg(num_steps=0)
  for lr in (0.0, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="learning_rate must be a finite number > 0"):
      _cfg(learning_rate=lr)
  for seed in (-1, 2 ** 32 - 7, "x"):  # PRNGKey(seed + 7) would alias another seed's key
    with pytest.raises(ValueError, match=r"TrainConfig.seed must be an int in \[0, 2\*\*32 - 7\)"):
      _cfg(seed=seed)
  _cfg(seed=2 ** 32 - 8)
  a_file = tmp_path / "file"
  a_file.write_text("x")
  for field in ("export_path", "workdir"):
    with pytest.raises(ValueError, match=f"TrainConfig.{field} .*file is a file, not a dir"):
      _cfg(**{field: str(a_file)})


@pytest.mark.parametrize("field,value,match", [
    # strings where numbers are meant (gin passes a quoted value through): named, not a raw
    # TypeError from comparing them
    ("learning_rate", "abc", "learning_rate must be a finite number > 0, got 'abc'"),
    ("learning_rate", True, "learning_rate must be a finite number > 0, got True"),
    ("warmup_steps", "x", "warmup_steps must be an int >= 0, got 'x'"),
    ("warmup_steps", 1.5, "warmup_steps must be an int >= 0, got 1.5"),
    ("batch_size", "2", "batch_size must be an int >= 1, got '2'"),
    ("weight_decay", -1.0, "weight_decay must be a finite number >= 0, got -1.0"),
    ("weight_decay", float("nan"), "weight_decay must be a finite number >= 0, got nan"),
    ("weight_decay", "x", "weight_decay must be a finite number >= 0, got 'x'"),
    ("teacher_temperature", "hot", "teacher_temperature must be a finite number >= 0"),
    ("z_loss", float("inf"), "z_loss must be a finite number >= 0, got inf"),
    ("distill_temperature", -1, "distill_temperature must be a finite number >= 0"),
    ("grow_init", "yes", "grow_init must be True or False, got 'yes'"),
    # the size of the data: named, not 'need ... at least one example, got 0 inputs'
    ("max_train_examples", 0, r"max_train_examples must be an int >= 1 or None .*got 0"),
    ("max_train_examples", "all", "max_train_examples must be an int >= 1 or None"),
    ("eval_examples", 0, "eval_examples must be an int >= 1 .*got 0"),
    ("eval_examples", None, "eval_examples must be an int >= 1 .*got None"),
    # what the export is: refused up front, not after training (or, for int8, by the loader)
    ("export_dtype", "int8", r"export_dtype must be one of \('float32', 'bfloat16', "
                             r"'float16'\).*got 'int8'"),
    ("export_dtype", "float7", "export_dtype must be one of .*got 'float7'"),
    ("export_format", "onnx", r"export_format must be one of \('t5x', 'orbax', 'hf'\), "
                              "got 'onnx'"),
    # keys of the model dict that are no T5Config field: named with the valid ones
    ("model", {"preset": "t5_1_1_tiny", "bogus": 1},
     r"TrainConfig.model has unknown keys \['bogus'\]; valid keys: \['preset', 'vocab_size'"),
    ("model", {"preset": "t5_1_1_nope"}, "TrainConfig.model .*Unknown T5 preset"),
])
def test_config_errors_name_the_setting_when_the_config_is_built(field, value, match):
  with pytest.raises(ValueError, match=f"TrainConfig.{match}" if field != "model" else match):
    _cfg(**{field: value})


def test_valid_numbers_and_export_settings_are_accepted():
  cfg = _cfg(learning_rate=1, weight_decay=0, warmup_steps=np.int64(0), max_train_examples=None,
             eval_examples=1, export_dtype="float16", export_format="hf", z_loss=0.0,
             model={"preset": "t5_1_1_tiny", "vocab_size": V})
  assert cfg.model_config().vocab_size == V
  for dtype in ("float32", "bfloat16"):
    _cfg(export_dtype=dtype)


def test_head_configs_check_their_numbers_and_head_keys():
  from spec_decode.train import eagle, exit_adapter, medusa, mtp
  cases = [
      (eagle.EagleTrainConfig, dict(unroll_decay="high"), "unroll_decay must be a number in"),
      (eagle.EagleTrainConfig, dict(unroll_decay=0.0), "unroll_decay must be a number in"),
      (eagle.EagleTrainConfig, dict(ce_weight=float("nan")), "ce_weight must be a finite number"),
      (eagle.EagleTrainConfig, dict(feature_weight=-1.0), "feature_weight must be a finite"),
      (eagle.EagleTrainConfig, dict(feature_weight=0, ce_weight=0), "both 0, so the loss is 0"),
      (eagle.EagleTrainConfig, dict(unroll="3"), "unroll must be an int >= 1, got '3'"),
      (eagle.EagleTrainConfig, dict(head={"bogus": 1}),
       r"EagleTrainConfig.head has unknown keys \['bogus'\]; valid keys .*EagleConfig.*"
       "fuse_layers"),
      (eagle.EagleTrainConfig, dict(head=[("d_model", 8)]), "head must be a dict"),
      (mtp.MtpTrainConfig, dict(depth_decay="x"), "depth_decay must be a number in"),
      (mtp.MtpTrainConfig, dict(head={"num_modules": 2}), r"not head\['num_modules'\]"),
      (mtp.MtpTrainConfig, dict(head={"bogus": 2}), "MtpTrainConfig.head has unknown keys"),
      (mtp.MtpTrainConfig, dict(export_dtype="float7"), "MtpTrainConfig.export_dtype must be"),
      (medusa.MedusaTrainConfig, dict(head={"emb_dim": 8}), r"unknown keys \['emb_dim'\].*none"),
      (medusa.MedusaTrainConfig, dict(num_heads=2.0), "num_heads must be an int >= 1"),
      (exit_adapter.ExitAdapterTrainConfig, dict(head={"layers": 2}),
       r"set ExitAdapterTrainConfig.layers, not head\['layers'\]"),
      (exit_adapter.ExitAdapterTrainConfig, dict(head={"bogus": 2}), "unknown keys"),
      (exit_adapter.ExitAdapterTrainConfig, dict(learning_rate="1e-3"),
       "ExitAdapterTrainConfig.learning_rate must be a finite number > 0"),
  ]
  for cls, kw, match in cases:
    with pytest.raises(ValueError, match=match):
      cls(**kw)
  eagle.EagleTrainConfig(head={"fuse_layers": (1, 4), "mlp_dim": 64})
  mtp.MtpTrainConfig(head={"num_heads": 2}, export_dtype="bfloat16")
  exit_adapter.ExitAdapterTrainConfig(head={"mlp_dim": 64})


def test_a_non_finite_loss_stops_training_and_removes_the_checkpoint_that_gave_it(tmp_path):
  """A learning rate that makes the run diverge: step 3's update makes the parameters huge
  (finite), they are saved, and step 4's loss (computed with them) is NaN. Training stops,
  the checkpoint of step 3 is removed (a rerun would resume from it or export it), the last
  good one stays, and nothing is exported."""
  import os
  split, val = _copy_split(100, 0), _copy_split(16, 1)
  workdir, export = str(tmp_path / "run"), str(tmp_path / "export")
  kw = dict(train_split=split, eval_split=val, report=lambda s: None)
  train.train(_cfg(num_steps=2, workdir=workdir, save_every=2, warmup_steps=0), **kw)
  with pytest.raises(train.trainer.NonFiniteLossError,
                     match=r"the training loss is (nan|inf) at step 4 .*computed with the "
                           r"parameters after step 3: training stopped and nothing is "
                           r"exported; the checkpoint of step 3 in .*run \(those parameters\) "
                           r"is removed: the last good checkpoint left is step 2"):
    train.train(_cfg(num_steps=40, workdir=workdir, save_every=1, warmup_steps=0,
                     learning_rate=1e30, export_path=export), **kw)
  assert not os.path.exists(export)
  assert list(train.trainer._manager(workdir).all_steps()) == [2]
  msgs = []  # what is saved resumes, and is finite
  r = train.train(_cfg(num_steps=3, workdir=workdir, save_every=1000, warmup_steps=0), **dict(
      kw, report=msgs.append))
  assert any("resumed from step 2" in m for m in msgs), msgs
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(r.params))
  # Another run's train state (another optimizer's slots) is named, not an Orbax dump.
  with pytest.raises(ValueError, match=r"cannot resume from the train state saved at step \d "
                                       r"in .*run.*another run's") as info:
    train.train(_cfg(num_steps=4, workdir=workdir, optimizer="adafactor"), **kw)
  assert len(str(info.value)) < 800


def test_a_non_finite_evaluation_stops_the_run_and_nothing_bad_is_exported(tmp_path):
  """The evaluation runs before a step's save: a non-finite eval loss stops the run with
  nothing saved of that step. A bad checkpoint left at num_steps (by an older version) is
  evaluated before the export, refused and removed, so that a rerun cannot export it."""
  import os
  split, val = _copy_split(100, 0), _copy_split(16, 1)
  kw = dict(train_split=split, eval_split=val, report=lambda s: None)
  workdir, export = str(tmp_path / "run"), str(tmp_path / "export")
  with pytest.raises(train.trainer.NonFiniteLossError,
                     match=r"the evaluation loss is (nan|inf) after step 1: training stopped "
                           r"and nothing is exported; .*run holds no checkpoint"):
    train.train(_cfg(num_steps=1, workdir=workdir, save_every=1, eval_every=1, warmup_steps=0,
                     learning_rate=1e30, export_path=export), **kw)
  assert not os.path.exists(export) and train.trainer._manager(workdir).all_steps() == []
  # a diverged train state saved at the last step, as the trainer left one before it checked
  # the evaluations: step 2 with learning rate 1e30 (huge, finite parameters); the rerun
  # resumes there and trains nothing
  good = train.train(_cfg(num_steps=1, workdir=workdir, save_every=1, warmup_steps=0), **kw)
  cfg = _cfg(learning_rate=1e30, warmup_steps=0)
  model = t5.T5(cfg.model_config())
  optimizer = train.trainer.make_optimizer(cfg)
  train_step, _ = train.trainer.make_steps(
      lambda p, *, target_params, batch: train.models._loss(model, p, batch, cfg=cfg), optimizer)
  state, _ = train_step(train.trainer.TrainState(
      step=jax.numpy.int32(1), params=good.params, opt_state=optimizer.init(good.params)),
      train_data.batch_at(split, 1, batch_size=16, seed=0, input_length=8, target_length=8),
      None)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state.params))
  train.trainer._save_state(train.trainer._manager(workdir), state)
  with pytest.raises(train.trainer.NonFiniteLossError,
                     match=r"the evaluation loss is (nan|inf) after step 2: .*the checkpoint of "
                           r"step 2 in .*removed: the last good checkpoint left is step 1"):
    train.train(_cfg(num_steps=2, workdir=workdir, warmup_steps=0, export_path=export), **kw)
  assert not os.path.exists(export)
  assert list(train.trainer._manager(workdir).all_steps()) == [1]


@pytest.mark.slow
def test_resume_gives_the_same_next_step(tmp_path):
  split, val = _copy_split(100, 0), _copy_split(16, 1)
  kw = dict(train_split=split, eval_split=val, report=lambda s: None)
  straight = train.train(_cfg(num_steps=4), **kw)
  workdir = str(tmp_path / "run")
  first = train.train(_cfg(num_steps=2, workdir=workdir, save_every=2), **kw)
  msgs = []
  resumed = train.train(_cfg(num_steps=4, workdir=workdir, save_every=2), train_split=split,
                        eval_split=val, report=msgs.append)
  assert any("resumed from step 2" in m for m in msgs)
  assert [h["step"] for h in first.history] == [2]
  for a, b in zip(jax.tree_util.tree_leaves(straight.params),
                  jax.tree_util.tree_leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_distillation_moves_the_draft_toward_the_teacher(tmp_path):
  teacher_cfg = t5.T5Config.preset("t5_1_1_tiny")
  teacher_params = t5.T5(teacher_cfg).init(jax.random.PRNGKey(42))
  path = str(tmp_path / "teacher")
  checkpoints.save(path, teacher_cfg, teacher_params, format="orbax")
  split, val = _copy_split(200, 0), _copy_split(32, 1)
  draft = {"preset": "t5_1_1_tiny", "num_encoder_layers": 1, "num_decoder_layers": 1}
  kw = dict(model=draft, mode="distill", teacher_checkpoint=path, prefixes="target",
            teacher_examples=200, divergence="fkl")
  r = train.train(_cfg(num_steps=40, log_every=1, **kw), train_split=split, eval_split=val,
                  report=lambda s: None)
  first, last = r.history[0], r.history[-5:]
  assert np.mean([h["divergence"] for h in last]) < 0.8 * first["divergence"], (first, r.eval)
  assert np.mean([h["teacher_agreement"] for h in last]) > first["teacher_agreement"]
  assert r.eval["teacher_agreement"] > first["teacher_agreement"]
  with pytest.raises(ValueError, match="teacher_checkpoint"):
    train.TrainConfig(mode="distill")


def test_demo_training_configs_parse_and_scale_like_the_paper():
  import glob
  import os

  from gin_files import ROOT, configured
  sizes = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "configs", "demo", "*.gin"))):
    name = os.path.basename(path)[:-4]
    with open(path, encoding="utf-8") as f:
      binds_train_config = any(line.startswith("TrainConfig.") for line in f)
    if name in ("common", "train_models") or not binds_train_config:
      continue  # shared settings, experiments, draft heads (test_medusa, test_eagle, test_mtp)
    cfg = configured(path, "TrainConfig")
    assert cfg.export_path == f"demo_models/{name}", name
    sizes[name] = t5.T5(cfg.model_config()).num_params()
  for task in ("ende", "cnndm"):
    size = lambda m: sizes[f"{task}_{m}"]
    assert size("target") > size("large") > size("base") > size("small")
    assert size("target") >= 8 * size("small")
    assert size("small_distilled") == size("small")
