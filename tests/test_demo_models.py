"""The shipped demo models (demo_models/): they load, fit the size budget, and are good.

Thresholds (measured values in demo_models/README.md): greedy BLEU of the EnDe
target on 64 held-out synthetic_ende test examples > 20 (measured 27.9; a
perfect greedy translator scores about 87 against the sampled references), and
alpha(target, small draft) at temperature 0, gamma 4, on 32 of them > 0.55
(measured 0.645).
"""

import os

import jax
import numpy as np
import pytest

from spec_decode import checkpoints, decoding, metrics, train_data
from spec_decode.data import synthetic_tasks
from spec_decode.models import t5

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo_models")
ENDE_MODELS = ("ende_target", "ende_small", "ende_small_distilled", "ende_base", "ende_large")
MB = 1 << 20
BLEU_THRESHOLD = 20.0
ALPHA_THRESHOLD = 0.55


def _shipped():
  return sorted(d for d in os.listdir(DEMO) if os.path.isdir(os.path.join(DEMO, d)))


def _files(path):
  for root, _, names in os.walk(path):
    for n in names:
      yield os.path.join(root, n)


def test_size_budget():
  total = 0
  for f in _files(DEMO):
    size = os.path.getsize(f)
    assert size <= 25 * MB, (f, size)
    total += size
  assert total <= 60 * MB, total


@pytest.mark.parametrize("name", ENDE_MODELS)
def test_demo_checkpoints_load(name):
  path = os.path.join(DEMO, name)
  if name not in _shipped():
    pytest.skip(f"{name} is not shipped")
  cfg, params = checkpoints.load(path, dtype="float32")
  assert cfg.vocab_size == synthetic_tasks.offline_source("synthetic_ende").vocabulary.vocab_size
  shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
  assert shapes == jax.tree_util.tree_map(lambda x: x.shape, t5.T5(cfg).param_shapes())


@pytest.fixture(scope="module")
def ende():
  source = synthetic_tasks.offline_source("synthetic_ende")
  examples = source.examples("test", 64)
  split = source.tokenized("test", 64)
  enc = train_data._pad(split.inputs, 32, 16)
  tcfg, tparams = checkpoints.load(os.path.join(DEMO, "ende_target"), dtype="float32")
  target = t5.T5(tcfg)
  greedy = decoding.autoregressive(target, tparams, enc, max_decode_len=48)
  return source, examples, enc, target, tparams, greedy


@pytest.mark.slow
def test_target_bleu_on_held_out_data(ende):
  source, examples, _, _, _, greedy = ende
  outs = [source.vocabulary.decode(row) for row in np.asarray(greedy.tokens)]
  score = metrics.bleu([ex["targets"] for ex in examples], outs)["bleu"]
  print(f"target BLEU {score:.2f}")
  assert score > BLEU_THRESHOLD, score


@pytest.mark.slow
def test_small_draft_alpha_at_temperature_zero(ende):
  _, _, enc, target, tparams, greedy = ende
  dcfg, dparams = checkpoints.load(os.path.join(DEMO, "ende_small"), dtype="float32")
  r = decoding.speculative(target, tparams, t5.T5(dcfg), dparams, enc[:32], gamma=4,
                           max_decode_len=48)
  alpha = np.sum(r.stats.accepted) / np.sum(r.stats.decisions)
  print(f"alpha {alpha:.3f}")
  assert alpha > ALPHA_THRESHOLD, alpha
  # Greedy speculative output is the target's greedy output (rows are batch-independent).
  np.testing.assert_array_equal(r.tokens, np.asarray(greedy.tokens)[:32])


@pytest.mark.slow
def test_default_main_job_shortened(tmp_path, monkeypatch):
  """`python -m spec_decode.main` with no --gin_file, on 4 examples: writes its row."""
  from spec_decode import main
  monkeypatch.chdir(ROOT)  # the demo gin files name checkpoints relative to the repository
  out = str(tmp_path / "default")
  summary = main.run([], ["NUM_EXAMPLES = 4", "ExperimentConfig.step_timing_repeats = 2"], out,
                     show_progress=False)
  assert summary["experiment"]["task"] == "synthetic_ende"
  assert summary["experiment"]["target"]["checkpoint"] == "demo_models/ende_target"
  assert summary["identical_fraction"] == 1.0
  assert summary["metrics"]["autoregressive"] == summary["metrics"]["speculative"]
  with open(os.path.join(out, "table_row.md")) as f:
    assert summary["table_row"] in f.read()
  assert summary["table_row"].startswith("| EnDe (synthetic) | demo small")
