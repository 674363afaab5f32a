"""The shipped demo models (demo_models/): they load, fit the size budget, and are good.

Thresholds on held-out test examples of the generated tasks, greedy decoding
(each assertion's message shows the value measured; the models' measured
quality on 200 examples is in experiments/results/demo_quality.md, made by
`python -m experiments.demo_quality`):
- synthetic_ende: BLEU of the target on 64 examples > ENDE_QUALITY (a perfect
  greedy translator scores about 87 against the sampled references);
- synthetic_cnndm: ROUGE-2 of the target on 32 examples > CNNDM_QUALITY;
- alpha(target, small draft) at temperature 0, gamma 4, on 32 examples of each
  task > ALPHA_THRESHOLD[task], and greedy speculative output == the target's;
- the big targets (ende_target_big, the default job's target, and cnndm_target_big; 45.6M
  parameters each): the same quality thresholds and alpha with the small drafts.
"""

import os

import jax
import numpy as np
import pytest

from spec_decode import checkpoints, decoding, metrics
from spec_decode.checkpoints import heads as head_checkpoints
from spec_decode.data import synthetic_tasks
from spec_decode.data import tokenized
from spec_decode.models import t5

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo_models")
DRAFTS = ("small", "small_distilled", "base", "large")
MODELS = tuple(f"{task}_{m}" for task in ("ende", "cnndm") for m in ("target",) + DRAFTS) + (
    "ende_target_big", "cnndm_target_big", "ende_small_distilled_big",
    "cnndm_small_distilled_big")
MB = 1 << 20
# Each big target is about 72 MB (45.6M bfloat16 parameters), each big target's MTP
# modules (14.7M) 23 MB; the rest about 76 MB.
TOTAL_BUDGET_MB = 265
ENDE_QUALITY = 45.0
CNNDM_QUALITY = 50.0
# task: (generated task, input length, output length, examples for quality, metric, threshold)
TASKS = {"ende": ("synthetic_ende", 32, 48, 64, "bleu", ENDE_QUALITY),
         "cnndm": ("synthetic_cnndm", 320, 48, 32, "rouge2", CNNDM_QUALITY)}
ALPHA_THRESHOLD = {"ende": 0.7, "cnndm": 0.7}


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
  assert total <= TOTAL_BUDGET_MB * MB, total


def test_shipped_heads_name_the_target_they_were_trained_on(tmp_path):
  """Every shipped head records its target (`checkpoints.heads.TRAINED_FOR`), whose
  fingerprint is the shipped target's; a run pairing a head with another target says so
  (`model_specs.head_target_notice`: the EnDe EAGLE head loads on the CNN/DM target, whose
  shapes fit, and decoded exactly at alpha 0.015 without a word)."""
  import json
  from spec_decode.checkpoints import storage
  from spec_decode.experiment import model_specs
  heads = [d for d in _shipped() if any(n.endswith("_config.json") or n == "medusa.json"
                                        for n in os.listdir(os.path.join(DEMO, d)))]
  assert len(heads) >= 12, heads
  for name in heads:
    trained = head_checkpoints.trained_for(os.path.join(DEMO, name))
    assert trained is not None, name
    assert trained["target_fingerprint"] == storage.fingerprint(
        os.path.join(ROOT, trained["target_checkpoint"])), name
  spec = lambda kind, name: model_specs.ModelSpec(kind=kind, checkpoint=os.path.join(DEMO, name))
  head, fingerprint = spec("eagle", "ende_eagle"), model_specs.checkpoint_fingerprint
  assert model_specs.head_target_notice(head, fingerprint(spec("t5", "ende_target"))) is None
  notice = model_specs.head_target_notice(head, fingerprint(spec("t5", "cnndm_target")))
  assert "was trained on the target 'demo_models/ende_target'" in notice, notice
  assert "expect a low acceptance rate (the outputs stay exact)" in notice
  assert model_specs.head_target_notice(spec("t5", "ende_small"), fingerprint(
      spec("t5", "cnndm_target"))) is None  # a draft model, not a head
  # save() writes what it is given; a head saved without it records nothing
  loaded, params = head_checkpoints.load(os.path.join(DEMO, "ende_eagle"))
  head_checkpoints.save(tmp_path / "with", loaded, params, trained_for={"target_fingerprint": "x"})
  head_checkpoints.save(tmp_path / "without", loaded, params)
  assert head_checkpoints.trained_for(tmp_path / "with") == {"target_fingerprint": "x"}
  assert head_checkpoints.trained_for(tmp_path / "without") is None
  (tmp_path / "without" / head_checkpoints.TRAINED_FOR).write_text("{cut")
  with pytest.raises(ValueError, match="corrupt trained_for.json in"):
    head_checkpoints.trained_for(tmp_path / "without")
  assert json.loads((tmp_path / "with" / head_checkpoints.TRAINED_FOR).read_text())


def test_every_demo_model_is_shipped():
  assert set(MODELS) <= set(_shipped()), sorted(set(MODELS) - set(_shipped()))


@pytest.mark.parametrize("name", MODELS)
def test_demo_checkpoints_load(name):
  path = os.path.join(DEMO, name)
  cfg, params = checkpoints.load(path, dtype="float32")
  task = TASKS[name.split("_")[0]][0]  # ende_target_big: synthetic_ende
  assert cfg.vocab_size == synthetic_tasks.offline_source(task).vocabulary.vocab_size
  shapes = jax.tree_util.tree_map(lambda x: x.shape, params)
  assert shapes == jax.tree_util.tree_map(lambda x: x.shape, t5.T5(cfg).param_shapes())


# (EAGLE head, the target it was trained on, its fused layers, whether it has a learned
# start): the 3.7M targets' heads, the big EnDe target's final-state and EAGLE-3 fused
# heads, and the big CNN/DM target's.
EAGLE_HEADS = [("cnndm_eagle", "cnndm_target", (), False),
               ("ende_eagle", "ende_target", (), False),
               ("ende_big_eagle", "ende_target_big", (), True),
               ("ende_big_eagle3", "ende_target_big", (1, 4), True),
               ("cnndm_big_eagle", "cnndm_target_big", (), True)]


@pytest.mark.parametrize("name,target,fused,start", EAGLE_HEADS,
                         ids=[h[0] for h in EAGLE_HEADS])
def test_demo_eagle_heads_fit_their_targets(name, target, fused, start):
  head, params = head_checkpoints.load(os.path.join(DEMO, name), kind="eagle", dtype="float32")
  tcfg, _ = checkpoints.load(os.path.join(DEMO, target), dtype="float32")
  head.check_target(t5.T5(tcfg))
  head.check_params(params)
  assert head.config.fuse_layers == fused and head.has_start == start


# (kind, heads, the target they were trained on, how many tokens they propose): Medusa heads
# and MTP modules on the 3.7M and the big targets.
HEAD_STACKS = [("medusa", "ende_medusa", "ende_target", 4),
               ("medusa", "cnndm_medusa", "cnndm_target", 4),
               ("medusa", "ende_big_medusa", "ende_target_big", 4),
               ("medusa", "cnndm_big_medusa", "cnndm_target_big", 4),
               ("mtp", "ende_mtp", "ende_target", 4), ("mtp", "cnndm_mtp", "cnndm_target", 4),
               ("mtp", "ende_big_mtp", "ende_target_big", 4),
               ("mtp", "cnndm_big_mtp", "cnndm_target_big", 4)]


@pytest.mark.parametrize("kind,name,target,num", HEAD_STACKS, ids=[h[1] for h in HEAD_STACKS])
def test_demo_medusa_heads_and_mtp_modules_fit_their_targets(kind, name, target, num):
  heads, params = head_checkpoints.load(os.path.join(DEMO, name), kind=kind)
  tcfg, _ = checkpoints.load(os.path.join(DEMO, target), dtype="float32")
  heads.check_target(t5.T5(tcfg))
  heads.check_params(params)
  assert (heads.num_heads if kind == "medusa" else heads.num_modules) == num


# (task, target): each task's demo target and its big (T5.1.1-small-shaped) target.
TARGETS = [("cnndm", "cnndm_target"), ("cnndm", "cnndm_target_big"), ("ende", "ende_target"),
           ("ende", "ende_target_big")]


@pytest.fixture(scope="module", params=TARGETS, ids=[t for _, t in TARGETS])
def demo(request):
  task, target_name = request.param
  name, input_length, output_length, n, _, _ = TASKS[task]
  source = synthetic_tasks.offline_source(name)
  examples = source.examples("test", n)
  split = source.tokenized("test", n)
  enc = tokenized.pad_rows(split.inputs, input_length, 16)
  tcfg, tparams = checkpoints.load(os.path.join(DEMO, target_name), dtype="float32")
  target = t5.T5(tcfg)
  if target_name.endswith("_big"):
    assert target.num_params() > 40e6
  greedy = decoding.autoregressive(target, tparams, enc, max_decode_len=output_length)
  return task, source, examples, enc, target, tparams, greedy


@pytest.mark.slow
def test_target_quality_on_held_out_data(demo):
  task, source, examples, _, _, _, greedy = demo
  _, _, _, _, metric, threshold = TASKS[task]
  outs = [source.vocabulary.decode(row) for row in np.asarray(greedy.tokens)]
  targets = [ex["targets"] for ex in examples]
  score = (metrics.bleu(targets, outs)["bleu"] if metric == "bleu"
           else metrics.rouge(targets, outs)["rouge2"])
  print(f"{task} target {metric} {score:.2f}")
  assert score > threshold, score


@pytest.mark.slow
def test_small_draft_alpha_at_temperature_zero(demo):
  task, _, _, enc, target, tparams, greedy = demo
  output_length = TASKS[task][2]
  dcfg, dparams = checkpoints.load(os.path.join(DEMO, f"{task}_small"), dtype="float32")
  r = decoding.speculative(target, tparams, t5.T5(dcfg), dparams, enc[:32], gamma=4,
                           max_decode_len=output_length)
  alpha = np.sum(r.stats.accepted) / np.sum(r.stats.decisions)
  print(f"{task} alpha {alpha:.3f}")
  assert alpha > ALPHA_THRESHOLD[task], alpha
  # Greedy speculative output is the target's greedy output (rows are batch-independent).
  np.testing.assert_array_equal(r.tokens, np.asarray(greedy.tokens)[:32])
