"""The gin configuration of one experiment at each scale: tiny, demo or paper.

An experiment is (task, draft) plus row settings (gamma, temperature, ...).
`experiment_setup` turns it into gin files and bindings of the experiment command
(`python -m spec_decode.main`), so every row of every table is a run of the one
experiment runner (`spec_decode.experiment.run_experiment`, through the gin layer:
`run`), reproducible with the command `Setup.command` prints:

  tiny   random T5 models on the offline 'toy_reverse' task (both 'ende' and
         'cnndm' map to it): seconds per run, for CI and smoke tests; the
         numbers mean nothing.
  demo   the trained demo models (demo_models/, see configs/demo/) on the
         synthetic_ende / synthetic_cnndm tasks (configs/demo/<task>_run.gin); CPU-sized.
         The target is <task>_target (3.7M) unless demo_target names another demo model
         (DEMO_TARGETS: the big 45.6M <task>_target_big); the draft 'target' is the 3.7M
         <task>_target drafting for a big target.
  paper  configs/paper/<task>_<draft>_t<T>.gin: T5.1.1 checkpoints on WMT EnDe
         and CNN/DM; the checkpoints come from `checkpoints`, keyed
         '<task>_target' and '<task>_<draft>' (e.g. ende_target, ende_small).

The demo models live in $SPEC_DECODE_DEMO_MODELS or <repo>/demo_models; a
row whose checkpoints are absent is reported as missing, not run.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from experiments.harness import DEMO_DIR, REPO_ROOT, quote

SCALES = ("tiny", "demo", "paper")
TASKS = ("ende", "cnndm")
NGRAM_DRAFTS = ("unigram", "bigram")
# small_distilled: the small draft distilled from the 3.7M demo target; small_distilled_big:
# distilled from the big demo target (DistillSpec against the target it drafts for).
T5_DRAFTS = ("small", "base", "large", "small_distilled", "small_distilled_big")
# The 3.7M demo target drafting for the big demo targets (1/12 of their size: the ratio of
# the paper's T5-large to T5-XXL, 1/14). The demo scale only.
DEMO_ONLY_DRAFTS = ("target",)
DRAFTS = NGRAM_DRAFTS + T5_DRAFTS + DEMO_ONLY_DRAFTS
TASK_LABELS = {"ende": "EnDe", "cnndm": "CNNDM"}

# Demo task lengths (as configs/demo/common.gin: ENDE_* and CNNDM_* macros).
DEMO_TASKS = {"ende": ("synthetic_ende", 32, 48), "cnndm": ("synthetic_cnndm", 320, 48)}
# The tiny scale's draft: one decoder layer, 4x narrower than t5_1_1_tiny (the target).
TINY_DRAFT_CONFIG = ("{'vocab_size': %VOCAB_SIZE, 'emb_dim': 16, 'num_heads': 2, "
                     "'head_dim': 8, 'mlp_dim': 32, 'num_encoder_layers': 1, "
                     "'num_decoder_layers': 1}")
TINY_SEEDS = {"small": 1, "base": 2, "large": 3, "small_distilled": 4, "target": 5,
              "small_distilled_big": 6}
# The demo targets: 'big' (T5.1.1-small-shaped, 45.6M: a decode step reads its weights, as a
# T5-XXL step on an accelerator does; the default) or 'small' (3.7M: a CPU decode step is
# bound by launching kernels, where a verify call costs 1.4-6 steps).
DEMO_TARGETS = {"big": "{task}_target_big", "small": "{task}_target"}
DEMO_NAMES = {"ende_target": "demo target (3.7M)", "cnndm_target": "demo CNNDM target (3.7M)",
              "ende_target_big": "demo big target (T5.1.1-small-shaped, 45.6M)",
              "cnndm_target_big": "demo big CNNDM target (T5.1.1-small-shaped, 45.6M)"}
DEMO_DRAFT_NAMES = {"small": "demo small (0.44M)", "base": "demo base (0.81M)",
                    "large": "demo large (1.87M)",
                    "small_distilled": "demo small distilled (0.44M)",
                    "small_distilled_big": "demo small distilled from the big target (0.44M)",
                    "target": "demo 3.7M target"}


@dataclasses.dataclass(frozen=True)
class Setup:
  """gin files and bindings of one experiment; `missing` says why it cannot run."""
  gin_files: tuple[str, ...]
  bindings: tuple[str, ...]
  missing: tuple[str, ...] = ()

  def with_bindings(self, *bindings: str) -> "Setup":
    return dataclasses.replace(self, bindings=self.bindings + tuple(bindings))

  def command(self, output_dir: str | None = None) -> str:
    """The `spec_decode.main` command line that runs this experiment."""
    args = [f"--gin_file={f}" for f in self.gin_files]
    for b in self.bindings:
      name, value = (s.strip() for s in b.split("=", 1))
      args.append(f"--gin.{name}={value}")
    if output_dir:
      args.append(f"--output_dir={output_dir}")
    return "python -m spec_decode.main " + " ".join(quote(a) for a in args)


def _q(s: str) -> str:
  return repr(str(s))


def add_demo_targets_flag(parser, what: str = "the targets") -> None:
  """The drivers' --demo_targets flag: which DEMO_TARGETS the demo scale runs."""
  parser.add_argument("--demo_targets", default="big", choices=tuple(DEMO_TARGETS),
                      help=f"demo scale: {what} are the big demo targets (45.6M, default) or "
                      "the 3.7M ones (a kernel-launch-bound scale on a CPU)")


# Examples per decode call with the big demo targets (their main jobs' refill_chunk).
BIG_REFILL_CHUNK = 10


def add_refill_chunk_flag(parser) -> None:
  """The drivers' --refill_chunk flag (resolved by `refill_chunk_of`)."""
  parser.add_argument("--refill_chunk", type=int, default=None,
                      help="examples per decode call in the refill loop, both decoders "
                      "(ExperimentConfig.refill_chunk; 0: one call per batch). Default: "
                      f"{BIG_REFILL_CHUNK} with the big demo targets, as their main jobs decode "
                      "(the host's work of a call, ~1-2 ms on 2 CPU cores, paid once per "
                      f"{BIG_REFILL_CHUNK} examples), else 0")


def refill_chunk_of(parser, args) -> int:
  """--refill_chunk as given, or its default for the targets of --scale/--demo_targets;
  a negative value is a usage error."""
  if args.refill_chunk is None:
    big = args.scale == "demo" and args.demo_targets == "big"
    return BIG_REFILL_CHUNK if big else 0
  if args.refill_chunk < 0:
    parser.error(f"--refill_chunk must be >= 0, got {args.refill_chunk}")
  return args.refill_chunk


def demo_target(scale: str, task: str, targets: str) -> str | None:
  """The demo target model's name of `task` for --demo_targets `targets` (None off the demo
  scale)."""
  return DEMO_TARGETS[targets].format(task=task) if scale == "demo" else None


def _check(scale: str, task: str, draft: str) -> None:
  if scale not in SCALES:
    raise ValueError(f"unknown scale {scale!r}; known: {SCALES}")
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; known: {TASKS}")
  if draft not in DRAFTS:
    raise ValueError(f"unknown draft {draft!r}; known: {DRAFTS}")


def experiment_setup(scale: str, task: str, draft: str, *, temperature: float = 0.0,
                     demo_dir: str | None = None, checkpoints: Mapping[str, str] | None = None,
                     ngram_fit_examples: int | None = None,
                     demo_target: str | None = None) -> Setup:
  """The gin setup of `draft` drafting for the `task` target at `scale` (see module doc).

  temperature only picks the paper's gin file (t0 or t1); rows bind their own
  TEMPERATURE and GAMMA with `row_bindings` at every scale. demo_target: the demo
  model under demo_dir that is the target (default <task>_target; e.g. ende_target_big).
  """
  _check(scale, task, draft)
  if demo_target is not None and scale != "demo":
    raise ValueError(f"demo_target {demo_target!r} names a demo model; it needs scale 'demo', "
                     f"got {scale!r}")
  if scale == "tiny":
    return _tiny(draft, ngram_fit_examples or 200)
  if scale == "demo":
    return _demo(task, draft, os.path.abspath(demo_dir or DEMO_DIR), ngram_fit_examples or 10000,
                 demo_target or f"{task}_target")
  return _paper(task, draft, 1 if temperature == 1 else 0, dict(checkpoints or {}),
                ngram_fit_examples)


def _tiny(draft: str, fit_examples: int) -> Setup:
  files = ["gin/runs/benchmark.gin", "gin/tasks/toy_reverse.gin", "gin/models/random_mini.gin"]
  bindings = ["INPUT_LENGTH = 24", "TARGET_LENGTH = 10", "NUM_EXAMPLES = 2",
              "target/ModelSpec.preset = 't5_1_1_tiny'",
              "target/ModelSpec.name = 'tiny target (random)'",
              "ExperimentConfig.step_timing_repeats = 2"]
  if draft in NGRAM_DRAFTS:
    files.append(f"gin/drafts/{draft}.gin")
    bindings.append(f"NGRAM_FIT_EXAMPLES = {fit_examples}")
  else:
    files.append("gin/drafts/random_tiny.gin")
    seed = TINY_SEEDS[draft]
    bindings += [f"draft/ModelSpec.config = {TINY_DRAFT_CONFIG}", f"draft/ModelSpec.seed = {seed}",
                 f"draft/ModelSpec.name = 'nano draft (random, seed {seed})'"]
  return Setup(tuple(files), tuple(bindings))


def _demo(task: str, draft: str, demo_dir: str, fit_examples: int, target_name: str) -> Setup:
  files = [f"configs/demo/{task}_run.gin"]
  target = os.path.join(demo_dir, target_name)
  bindings = [f"target/ModelSpec.checkpoint = {_q(target)}"]
  if target_name != f"{task}_target":
    name = DEMO_NAMES.get(target_name, "demo " + target_name)
    bindings.append(f"target/ModelSpec.name = {_q(name)}")
  needed = [target]
  if draft in NGRAM_DRAFTS:
    files.append(f"gin/drafts/{draft}.gin")
    bindings += ["draft/ModelSpec.checkpoint = None", f"NGRAM_FIT_EXAMPLES = {fit_examples}"]
  else:
    path = os.path.join(demo_dir, f"{task}_{draft}")
    if os.path.abspath(path) == os.path.abspath(target):
      return Setup(tuple(files), tuple(bindings), (f"{target_name} cannot draft for itself",))
    needed.append(path)
    bindings += [f"draft/ModelSpec.checkpoint = {_q(path)}",
                 f"draft/ModelSpec.name = {_q(DEMO_DRAFT_NAMES[draft])}"]
  missing = tuple(f"no demo model {_shown(p)}" for p in needed if not os.path.isdir(p))
  return Setup(tuple(files), tuple(bindings), missing)


def _shown(path: str) -> str:
  """A path relative to the repository when it lies inside it."""
  rel = os.path.relpath(path, REPO_ROOT)
  return path if rel.startswith("..") else rel


def _paper(task: str, draft: str, t: int, checkpoints: dict[str, str],
           fit_examples: int | None) -> Setup:
  if draft not in NGRAM_DRAFTS + ("small", "base", "large"):
    return Setup((), (), (f"the paper has no {draft} draft",))
  bindings, missing = [], []
  for key, macro in ((f"{task}_target", "CHECKPOINT_PATH"),
                     (None if draft in NGRAM_DRAFTS else f"{task}_{draft}",
                      "DRAFT_CHECKPOINT_PATH")):
    if key is None:
      continue
    if key in checkpoints:
      bindings.append(f"{macro} = {_q(checkpoints[key])}")
    else:
      missing.append(f"needs --checkpoints {key}=PATH")
  if fit_examples:
    bindings.append(f"NGRAM_FIT_EXAMPLES = {fit_examples}")
  return Setup((f"configs/paper/{task}_{draft}_t{t}.gin",), tuple(bindings), tuple(missing))


def row_bindings(*, gamma: int | None = None, choose_gamma: bool = False,
                 temperature: float | None = None, lenience: float | None = None,
                 run_baseline: bool | None = None, num_examples: int | None = None,
                 batch_size: int | None = None, step_timing_repeats: int | None = None,
                 timing_repeats: int | None = None, mesh: str | None = None,
                 compact_batch: bool | None = None,
                 refill_chunk: int | None = None) -> tuple[str, ...]:
  """gin bindings of a row's settings (None = keep the config's value): gamma and lenience
  of the 'speculative' decoder; choose_gamma: choose its gamma from warm-up measurements
  (`GammaChoice`; the warm-up decodes at gamma 4); run_baseline False: no baseline;
  compact_batch: the baseline and the speculative decoder shrink their batch; refill_chunk:
  examples per decode call in the refill loop (`ExperimentConfig.refill_chunk`, batches'
  worth; 0 decodes batch by batch)."""
  if choose_gamma and gamma is not None:
    raise ValueError("a row either fixes gamma or chooses it (choose_gamma), not both")
  out = []
  if choose_gamma:
    out += ["GAMMA = 4", "ExperimentConfig.gamma_choice = @GammaChoice()"]
  if run_baseline is False:
    out.append("ExperimentConfig.baseline = None")
  for name, value in (("GAMMA", gamma), ("TEMPERATURE", temperature),
                      ("speculative/Speculative.lenience", lenience),
                      ("NUM_EXAMPLES", num_examples), ("BATCH_SIZE", batch_size),
                      ("ExperimentConfig.step_timing_repeats", step_timing_repeats),
                      ("ExperimentConfig.timing_repeats", timing_repeats),
                      ("ExperimentConfig.mesh", mesh), ("COMPACT_BATCH", compact_batch),
                      ("ExperimentConfig.refill_chunk", refill_chunk)):
    if value is not None:
      out.append(f"{name} = {_q(value) if isinstance(value, str) else repr(value)}")
  return tuple(out)


def parse_checkpoints(text: str | None) -> dict[str, str]:
  """'ende_target=gs://a,ende_small=gs://b' -> {'ende_target': 'gs://a', ...}."""
  out: dict[str, str] = {}
  for part in (text or "").split(","):
    if not part.strip():
      continue
    key, sep, path = part.partition("=")
    if not sep or not key.strip() or not path.strip():
      raise ValueError(f"--checkpoints entries must be NAME=PATH, got {part!r}")
    out[key.strip()] = path.strip()
  return out


def parse_config(setup: Setup):
  """The ExperimentConfig of a setup (gin state cleared first)."""
  from spec_decode.cli import gin as gin_layer
  return gin_layer.parse_experiment(list(setup.gin_files), list(setup.bindings))


def run(setup: Setup, output_dir: str, *, show_progress: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the experiment into output_dir with the runner
  (`experiment.run_experiment`, through the gin layer); returns its summary."""
  if setup.missing:
    raise ValueError(f"cannot run: {'; '.join(setup.missing)}")
  from spec_decode.cli import gin as gin_layer
  return gin_layer.run_experiment(list(setup.gin_files), list(setup.bindings), output_dir,
                                  show_progress=show_progress)


def load(setup: Setup):
  """Loads the experiment's task, examples and models (`experiment.load`) without running."""
  if setup.missing:
    raise ValueError(f"cannot load: {'; '.join(setup.missing)}")
  from spec_decode import experiment
  return experiment.load(parse_config(setup))
