"""The experiment runner: one experiment = a baseline and named decoders on a task split.

  config       ExperimentConfig (the decoders, named), GammaChoice
  model_specs  ModelSpec: what a target or draft is and how it loads
  run          run_experiment: decode every batch, append rows, resume, summarize
  setup        load a run's task, examples and models; its decoders as functions
  measure      step costs (T_p, each decoder's proposal and c, verify ratios)
  gamma        a chain decoder's gamma chosen from warm-up measurements
  report, results, status   the summary and table row; the output directory's files; runs
  batching     fixed-shape batches
  memory       per-device memory plans of a sharded decode
"""

from spec_decode.decoding.footprint import memory_map_use, release_executables_if_crowded
from spec_decode.experiment.config import BASELINE, ExperimentConfig, GammaChoice
from spec_decode.experiment.gamma import GAMMA_FILE, choose_gamma
from spec_decode.experiment.measure import measure_step_times, step_costs
from spec_decode.experiment.model_specs import LoadContext, ModelSpec
from spec_decode.experiment.run import progress, run_experiment
from spec_decode.experiment.setup import Setup, load

__all__ = ["BASELINE", "ExperimentConfig", "GAMMA_FILE", "GammaChoice", "LoadContext",
           "ModelSpec", "Setup", "choose_gamma", "load", "measure_step_times", "memory_map_use",
           "progress", "release_executables_if_crowded", "run_experiment", "step_costs"]
