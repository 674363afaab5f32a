"""Every .gin file in the repository parses and builds its config objects."""

import glob
import os

import gin
import pytest

from spec_decode import data, experiment, paths
from spec_decode.cli import gin as gin_layer
from spec_decode.experiment import model_specs

ROOT = paths.REPO_ROOT
# Every config of the repository (experiments/results/*/config.gin are run outputs: the
# operative config an earlier version recorded, not configs to run).
ALL_GIN = sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/**/*.gin", recursive=True)
                 if not os.path.relpath(p, ROOT).startswith("experiments/results/"))
# Values for the macros a user must fill in (checkpoint paths).
REQUIRED = ["CHECKPOINT_PATH = '/ckpt/target'", "DRAFT_CHECKPOINT_PATH = '/ckpt/draft'"]
# A complete experiment that a building block from gin/<kind>/ replaces one part of.
BASE = {"runs": "gin/runs/benchmark.gin", "tasks": "gin/tasks/toy_reverse.gin",
        "models": "gin/models/random_mini.gin", "drafts": "gin/drafts/random_tiny.gin"}


@pytest.fixture(autouse=True)
def clean_gin():
  gin_layer.register_gin()
  gin.clear_config()
  yield
  gin.clear_config()


def _build():
  """Builds each configured top-level object (ExperimentConfig, and every training config:
  TrainConfig and the head training configs); returns the first."""
  from spec_decode import configurable
  built = []
  if gin_layer.bound(experiment.ExperimentConfig):
    cfg = gin.get_configurable(experiment.ExperimentConfig)()
    assert isinstance(cfg.target, model_specs.ModelSpec)
    # a draft-free experiment (source lookup, layer skip) has none
    assert isinstance(cfg.draft, model_specs.ModelSpec) or (
        cfg.draft is None and not any(a.needs_draft for a in cfg.algorithms.values()))
    assert cfg.task in data.task_names()
    built.append(cfg)
  for cls in configurable.runnable().values():
    if gin_layer.bound(cls):
      built.append(gin.get_configurable(cls)())
  return built[0] if built else None


def test_found_the_gin_files():
  assert "configs/default.gin" in ALL_GIN
  assert len([p for p in ALL_GIN if p.startswith("configs/paper/")]) >= 12
  for kind in BASE:
    assert any(p.startswith(f"gin/{kind}/") for p in ALL_GIN)


@pytest.mark.parametrize("path", ALL_GIN)
def test_gin_file_parses_and_builds(path):
  parts = path.split("/")
  if parts[0] == "gin" and parts[1] in BASE:
    if path.endswith("train.gin"):
      files = [BASE["tasks"], path]
    else:
      files = [path if k == parts[1] else f for k, f in BASE.items()]
  else:
    files = [path]
  bindings = REQUIRED + ([] if path.startswith("configs/") else ["VOCAB_SIZE = 259"])
  gin.parse_config_files_and_bindings([os.path.join(ROOT, f) for f in files], bindings)
  cfg = _build()
  if cfg is None:  # shared settings only: some config must include the file
    including = [p for p in ALL_GIN if f"include '{path}'" in open(os.path.join(ROOT, p)).read()]
    assert including, f"{path} configures no ExperimentConfig or training config"
  if isinstance(cfg, experiment.ExperimentConfig) and parts[1] in ("models", "drafts"):
    spec = cfg.target if parts[1] == "models" else cfg.draft
    name = os.path.splitext(parts[2])[0]
    if name.startswith("t5_1_1_"):
      assert spec.preset == name and spec.checkpoint.startswith("/ckpt/")


# The paper's Table 2: (task, draft size, temperature) -> gamma.
TABLE2 = {("ende", "small", 0): 7, ("ende", "base", 0): 7, ("ende", "large", 0): 7,
          ("ende", "small", 1): 7, ("ende", "base", 1): 5, ("ende", "large", 1): 3,
          ("cnndm", "small", 0): 5, ("cnndm", "base", 0): 5, ("cnndm", "large", 0): 3,
          ("cnndm", "small", 1): 5, ("cnndm", "base", 1): 3, ("cnndm", "large", 1): 3}


@pytest.mark.parametrize("row", sorted(TABLE2))
def test_paper_table2_configs(row):
  task, size, temp = row
  gin.parse_config_files_and_bindings(
      [os.path.join(ROOT, f"configs/paper/{task}_{size}_t{temp}.gin")],
      ["CHECKPOINT_PATH = 'gs://b/xxl'", "DRAFT_CHECKPOINT_PATH = 'gs://b/draft'"])
  cfg = _build()
  assert cfg.task == {"ende": "wmt_t2t_ende_v003", "cnndm": "cnn_dailymail_v002"}[task]
  assert list(cfg.decoders) == ["speculative"] and cfg.gamma_choice is None
  assert cfg.decoders["speculative"].gamma == TABLE2[row]
  assert cfg.sampling.temperature == float(temp)
  assert cfg.batch_size == 1 and cfg.baseline is not None
  assert cfg.target.preset == "t5_1_1_xxl" and cfg.target.checkpoint == "gs://b/xxl"
  assert cfg.draft.preset == f"t5_1_1_{size}" and cfg.draft.checkpoint == "gs://b/draft"


def test_checkpoint_macros_are_required():
  with pytest.raises(ValueError, match="CHECKPOINT_PATH.*REQUIRED"):
    gin.parse_config_files_and_bindings(
        [os.path.join(ROOT, "configs/paper/ende_small_t0.gin")], [])


def test_toy_config_is_tiny_and_offline():
  cfg = gin_layer.parse_experiment(["configs/toy_random.gin"], [])
  assert cfg.task == "toy_reverse" and cfg.target.checkpoint is None
  assert cfg.target.preset == "t5_1_1_mini" and cfg.draft.preset == "t5_1_1_tiny"
