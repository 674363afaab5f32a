r"""Runs one experiment from gin configs: autoregressive vs speculative decoding.

  python -m spec_decode.main \
    --gin_file=configs/paper/ende_small_t0.gin \
    --gin.CHECKPOINT_PATH="'gs://bucket/t5_1_1_xxl_ende/checkpoint_1010000'" \
    --gin.DRAFT_CHECKPOINT_PATH="'gs://bucket/t5_1_1_small_ende/checkpoint_1010000'" \
    --output_dir=/tmp/ende_small_t0

--gin_file (repeatable) and --gin.NAME=VALUE (or --gin_bindings='NAME = VALUE')
work as in T5X; files are found relative to the working directory or the
repository root. Without --gin_file, configs/default.gin runs: the demo EnDe
experiment on the shipped demo models (configs/demo/ende_experiment.gin).
The gin files bind `ExperimentConfig` (see
`spec_decode.experiment`), whose `target` and `draft` are `ModelSpec`s.

Output directory (--output_dir; default /tmp/spec_decode/<last gin file's name>):
  predictions.jsonl  one line per example: index, inputs, target, ar_output,
                     spec_output, identical (token-level), their tokens and
                     lengths, the per-row counters (target_calls, draft_tokens,
                     accepted, decisions, min_pq_sum, ar_target_calls,
                     accepted_at/decided_at per draft position)
                     and its batch's timings (batch, ar/spec_batch_seconds);
                     appended after every batch
  config.json        the experiment's settings (a rerun must match them)
  progress.json      completed / total examples
  results.json       metrics of both decoders (BLEU or ROUGE), identical
                     fraction, alpha (observed and estimated), tokens per
                     target call, per-position acceptance, step times and c,
                     measured speedup and Thm 3.8's prediction, compile times
  table_row.md       the paper's Table 4 header and this run's row
  config.gin         gin's operative config of the run
Rerunning with the same output_dir resumes: finished examples are skipped and
the summary is recomputed from all rows.
"""

from __future__ import annotations

import os
from typing import Sequence

from absl import app, flags, logging

import jax

from spec_decode import distributed

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GIN_FILE = "configs/default.gin"

flags.DEFINE_multi_string("gin_file", [], "gin config files, parsed in order")
flags.DEFINE_multi_string("gin_bindings", [], "gin bindings, e.g. 'ExperimentConfig.gamma = 5'; "
                          "--gin.NAME=VALUE is rewritten to one of these")
flags.DEFINE_string("output_dir", None, "directory for predictions and results")
flags.DEFINE_bool("progress", True, "show a progress bar")
distributed.define_flags()  # --coordinator_address, --num_processes, --process_id
FLAGS = flags.FLAGS

_registered = False


def register_gin() -> None:
  """Makes the library's config classes gin-configurable (idempotent)."""
  global _registered
  if _registered:
    return
  import gin

  from spec_decode import decoding, experiment, model_specs
  gin.external_configurable(experiment.ExperimentConfig, "ExperimentConfig")
  for cls in decoding.registry.all_classes():  # algorithms, drafters, verifiers
    gin.external_configurable(cls, cls.__name__)
  gin.external_configurable(model_specs.ModelSpec, "ModelSpec")
  from spec_decode import train
  gin.external_configurable(train.TrainConfig, "TrainConfig")
  gin.add_config_file_search_path(REPO_ROOT)
  _registered = True


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
  """T5X-style '--gin.NAME=VALUE' -> '--gin_bindings=NAME = VALUE'."""
  out = []
  for arg in argv:
    if arg.startswith("--gin.") and "=" in arg:
      name, value = arg[len("--gin."):].split("=", 1)
      out.append(f"--gin_bindings={name} = {value}")
    else:
      out.append(arg)
  return out


def resolve_gin_file(path: str) -> str:
  """`path` as given if it exists, else relative to the repository root (if there)."""
  if os.path.isabs(path) or os.path.exists(path):
    return path
  in_repo = os.path.join(REPO_ROOT, path)
  if os.path.exists(in_repo):
    return in_repo
  raise FileNotFoundError(f"gin file not found: {path} (looked in {os.getcwd()} and {REPO_ROOT})")


def parse_config(gin_files: Sequence[str], gin_bindings: Sequence[str]):
  """Parses gin files and bindings and builds the ExperimentConfig they describe."""
  import gin

  from spec_decode import experiment
  register_gin()
  gin.clear_config()  # one parse per run; also unlocks a config an earlier parse locked
  gin.parse_config_files_and_bindings([resolve_gin_file(f) for f in gin_files],
                                      list(gin_bindings))
  return gin.get_configurable(experiment.ExperimentConfig)()


def default_output_dir(gin_files: Sequence[str]) -> str:
  name = os.path.splitext(os.path.basename(gin_files[-1]))[0] if gin_files else "default"
  return os.path.join("/tmp/spec_decode", name)


def run(gin_files: Sequence[str], gin_bindings: Sequence[str], output_dir: str | None, *,
        show_progress: bool = True) -> dict:
  """What `main` does, callable from Python: parse, run the experiment, write config.gin."""
  import gin

  from spec_decode import experiment, results
  gin_files = list(gin_files) or [DEFAULT_GIN_FILE]
  config = parse_config(gin_files, gin_bindings)
  output_dir = output_dir or default_output_dir(gin_files)
  logging.info("experiment %s -> %s", config, output_dir)
  summary = experiment.run_experiment(config, output_dir=output_dir,
                                      show_progress=show_progress)
  if summary:  # process 0 writes
    results.write_text(os.path.join(output_dir, "config.gin"), gin.operative_config_str())
  return summary


def format_summary(summary: dict) -> str:
  """The Table-4-style row, then quality of both decoders, identity rate and gamma choice."""
  from spec_decode import report
  lines = [report.TABLE_HEADER + summary["table_row"]]
  for name, values in summary["metrics"].items():
    lines.append(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(values.items())))
  if summary.get("identical_fraction") is not None:
    lines.append(f"identical outputs: {summary['identical_fraction']:.1%}")
  choice = summary.get("gamma_selection")
  if choice:
    lines.append(f"gamma {choice['gamma']} chosen by theory.optimal_gamma from alpha "
                 f"{choice['alpha']:.3f} and c {choice['c']:.3f} measured on "
                 f"{choice['warmup_examples']} warm-up examples")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  distributed.initialize_from_flags()  # no-op for one process
  summary = run(FLAGS.gin_file, FLAGS.gin_bindings, FLAGS.output_dir,
                show_progress=FLAGS.progress and jax.process_index() == 0)
  if summary:  # process 0
    print(format_summary(summary))


def _parse_flags(argv: Sequence[str]):
  return FLAGS(rewrite_gin_args(argv))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
