"""Training: one trainer (`trainer`) and its recipes.

  models   TrainConfig: T5 models, supervised fine-tuning and draft distillation
  heads    HeadTrainConfig, train_head: a draft head on a frozen target, for every kind
  eagle, mtp, medusa   the heads' recipes: their losses and configs (EagleTrainConfig,
                       MtpTrainConfig, MedusaTrainConfig)
  data, losses         batches by step; cross-entropy, z-loss and distillation divergences

Every config has `run()`; `python -m spec_decode.cli.train --gin_file=...` runs the one
its gin file binds. Nothing below the experiment layer imports training.
"""

from spec_decode.train import data, eagle, heads, losses, medusa, models, mtp, trainer
# _initial_params: the T5 trainer's start from (or growth of) an init checkpoint, which tests read.
from spec_decode.train.models import TrainConfig, TrainResult, _initial_params, train  # noqa: F401

__all__ = ["TrainConfig", "TrainResult", "data", "eagle", "heads", "losses", "medusa", "models",
           "mtp", "train", "trainer"]
