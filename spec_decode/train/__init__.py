"""Training: one trainer (`trainer`) and its recipes.

  models   TrainConfig: T5 models, supervised fine-tuning and draft distillation
  heads    HeadTrainConfig, train_head: a draft head on a frozen target, for every kind
  eagle, mtp, medusa, exit_adapter
                       the heads' recipes: their losses and configs (EagleTrainConfig,
                       MtpTrainConfig, MedusaTrainConfig, ExitAdapterTrainConfig)
  data, losses         batches by step; cross-entropy, z-loss and distillation divergences

Every config has `run()`; `python -m spec_decode.cli.train --gin_file=...` runs the one
its gin file binds. Every module of this package is imported with it, so a new recipe file
registers its config with gin without another edit. Nothing below the experiment layer
imports training.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):  # registration: every recipe's config
  importlib.import_module(f"{__name__}.{_module.name}")

# noqa: E402 below: the names are imported after the registration loop.
from spec_decode.train import (  # noqa: E402
    data, eagle, exit_adapter, heads, losses, medusa, models, mtp)
from spec_decode.train import trainer  # noqa: E402
# _initial_params: the T5 trainer's start from (or growth of) an init checkpoint, which tests
# read.
from spec_decode.train.models import (  # noqa: E402,F401
    TrainConfig, TrainResult, _initial_params, train)

__all__ = ["TrainConfig", "TrainResult", "data", "eagle", "exit_adapter", "heads", "losses",
           "medusa", "models", "mtp", "train", "trainer"]
