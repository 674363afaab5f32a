r"""The experiment command: one experiment from gin configs, the baseline against named decoders.

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
`spec_decode/main.py` is this command's entry point; `run` is the same, callable from
Python (its flags are defined only when the command runs: `define_flags`).

Output directory (--output_dir; default <tmp>/spec_decode-<user>/<last gin file's name>-<hash
of this checkout's path>, so checkouts and users never share one):
  predictions.jsonl  one line per example: index, inputs, target, batch, and
                     per decoder ("autoregressive", "speculative" or the
                     names in ExperimentConfig.decoders) its output, tokens,
                     length, its batch's seconds and its named counters
                     (speculative: target_calls, draft_tokens, accepted,
                     decisions, min_pq_sum, accepted_at/decided_at per draft
                     position, first_call_tokens; trees also draft_mass_at);
                     appended after every batch
  config.json        the experiment's settings (a rerun must match them)
  progress.json      completed / total examples
  results.json       metrics of every decoder (BLEU or ROUGE); per decoder
                     under 'decoders' and for the primary one at the top: identical
                     fraction, alpha (observed and estimated), tokens per
                     target call (and each example's first call apart from
                     the later ones), per-position acceptance, step times and c,
                     measured speedup and Thm 3.8's prediction, compile times
  table_row.md       the paper's Table 4 header and this run's row
  config.gin         gin's operative config of the run
  runs.json          each run that decoded rows: host, devices, its c
Rerunning with the same output_dir resumes and says so ("resuming K/N", or
"already complete": nothing is decoded or re-measured); the summary is
recomputed from all rows, each run's own timings listed (`experiment.status`).
The directory is locked while a run writes to it; a second run is refused.

Errors in what you typed (a gin binding, a path, a missing extra) end in one
line naming the problem and exit code 2; --verbose shows the traceback.
gin files are Python-like code that can call any registered configurable:
run only gin files you trust.
"""

from __future__ import annotations

import getpass
import hashlib
import math
import os
import stat
import tempfile
from typing import Sequence

from absl import app, flags

import jax

from spec_decode import compile_cache, distributed, paths
from spec_decode.cli import errors
from spec_decode.cli import gin as gin_layer
from spec_decode.kernels import cpu_matmul

DEFAULT_GIN_FILE = "configs/default.gin"
PROGRAM = "spec_decode.main"


def define_flags() -> None:
  """This command's flags (once per process; defined when the command runs, not on import)."""
  if "output_dir" in flags.FLAGS:
    return
  gin_layer.define_flags("gin bindings, e.g. 'ExperimentConfig.batch_size = 4'")
  flags.DEFINE_string("output_dir", None, "directory for predictions and results")
  flags.DEFINE_bool("progress", True, "show progress lines and a progress bar")
  errors.define_flags()  # --verbose
  distributed.define_flags()  # --coordinator_address, --num_processes, --process_id


def default_output_dir(gin_files: Sequence[str]) -> str:
  """<tmp>/spec_decode-<user>/<last gin file's name>-<hash of this checkout's path>."""
  name = os.path.splitext(os.path.basename(gin_files[-1]))[0] if gin_files else "default"
  try:
    user = getpass.getuser()
  except Exception:  # no user name in some containers
    user = str(os.getuid())
  checkout = hashlib.sha256(paths.REPO_ROOT.encode()).hexdigest()[:8]
  return os.path.join(tempfile.gettempdir(), f"spec_decode-{user}", f"{name}-{checkout}")


def check_default_output_dir(output_dir: str) -> None:
  """The default output directory has a predictable name in a shared temporary directory,
  so another user could have made it first (with links inside leading to your files):
  refuse it, and its parent, unless they are real directories of this user that not every
  user may write. Creates the parent, private, where it is missing."""
  from spec_decode.experiment import results
  parent = os.path.dirname(output_dir)
  os.makedirs(parent, mode=0o700, exist_ok=True)
  for d in (parent, output_dir):
    try:
      st = os.lstat(d)
    except FileNotFoundError:
      continue
    why = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else
           f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.getuid() else
           f"may be written by any user (mode {stat.S_IMODE(st.st_mode):o})"
           if st.st_mode & 0o002 else None)
    if why:
      raise results.OutputDirError(f"the default output directory {d} {why}; pass "
                                   "--output_dir=DIR (a directory of your own)")


def run(gin_files: Sequence[str], gin_bindings: Sequence[str], output_dir: str | None, *,
        show_progress: bool = True) -> dict:
  """What the command does, callable from Python: parse the gin files into an
  `ExperimentConfig` and run it (`gin_layer.run_experiment`) into output_dir (default:
  `default_output_dir`, refused where another user could have planted it)."""
  gin_files = list(gin_files) or [DEFAULT_GIN_FILE]
  if not output_dir:
    output_dir = default_output_dir(gin_files)
    check_default_output_dir(output_dir)
  return gin_layer.run_experiment(gin_files, gin_bindings, output_dir,
                                  show_progress=show_progress)


def _x(value) -> str:
  return "n/a" if value is None else f"{value:.2f}X"


def _fmt3(x) -> str:
  return "n/a" if x is None else f"{x:.3f}"


def format_summary(summary: dict) -> str:
  """The one block a person reads: where the files are, the numbers and what each means."""
  from spec_decode.experiment import report
  exp, timing = summary.get("experiment", {}), summary.get("timing", {})
  temperature = exp.get("sampling", {}).get("temperature", 0.0)
  primary = exp.get("decoders", {}).get(summary.get("primary")) or {}
  choice = summary.get("gamma_selection") or {}
  gamma = "0 (autoregressive)" if choice.get("gamma") == 0 else primary.get("gamma")
  out_dir = summary.get("output_dir")
  lines = [f"== {exp.get('task')} ({exp.get('split')}): {summary.get('completed')} of "
           f"{summary.get('num_examples')} examples, temperature {temperature:g}, "
           f"gamma {gamma} =="]
  if out_dir:
    lines.append(f"files: {out_dir}/ (predictions.jsonl: one row per example; results.json: "
                 "every number; table_row.md; config.gin)")
  lines.append(report.TABLE_HEADER + summary["table_row"])
  decoders = summary.get("decoders", {})
  if len(decoders) > 1:  # named decoders: one line each, against the baseline
    for name, d in decoders.items():
      lines.append(f"decoder {name} ({d.get('algorithm')}): measured speedup "
                   f"{_x(d.get('speedup_measured'))}, tokens per target call "
                   f"{_fmt3(d.get('tokens_per_target_call'))}, identical "
                   f"{_fmt3(d.get('identical_fraction'))}")
  c = timing.get("c")
  lines.append(f"measured speedup {_x(summary.get('speedup_measured'))}: autoregressive / "
               "speculative decode time, summed over batches, compilation excluded")
  if summary.get("speedup_predicted") is not None:
    charged = ("c in the loop", timing["c_in_loop"]) if timing.get("c_in_loop") is not None \
        else ("c", c)
    lines.append(f"predicted speedup {_x(summary['speedup_predicted'])}: Thm 3.8 from alpha "
                 f"{summary['alpha']:.3f} and {charged[0]} {charged[1]:.3f} (below)")
  if summary.get("cost_model_speedup") is not None and timing.get("verify_ratio"):
    lines.append(f"cost model {_x(summary['cost_model_speedup'])}: E[tokens] / (gamma c + "
                 f"T_verify(gamma+1) / T_p), charging the measured verify cost "
                 f"T_verify / T_p = {timing['verify_ratio']:.2f} (Thm 3.8 charges 1)")
  if summary.get("alpha") is not None:
    observed = summary.get("alpha_observed")
    lines.append(f"alpha {summary['alpha']:.3f}: expected acceptance rate, mean over drafted "
                 "positions of sum_x min(p, q)"
                 + (f" (fraction actually accepted: {observed:.3f})" if observed is not None
                    else ""))
  if summary.get("tokens_first_call") is not None:
    later = summary.get("tokens_per_later_call")
    later = "n/a" if later is None or math.isnan(later) else f"{later:.2f}"
    lines.append(f"tokens per target call {summary['tokens_per_target_call']:.2f}: each "
                 f"example's first call {summary['tokens_first_call']:.2f}, the later ones "
                 f"{later}")
  if c is not None:
    lines.append(f"c {c:.3f}: draft / target time of one single-token decode step "
                 f"({timing.get('draft_step_seconds', 0) * 1e3:.2f} ms / "
                 f"{timing.get('target_step_seconds', 0) * 1e3:.2f} ms)")
  if timing.get("c_in_loop") is not None:
    lines.append(f"c in the loop {timing['c_in_loop']:.3f}: a proposal timed after a verify "
                 "call (minus the verify call), per drafted token / T_p, where the draft's "
                 "weights are read again after the target's went through the caches; the "
                 "cost model charges it")
  if choice.get("fallback"):
    lines.append(f"gamma 0: {choice['fallback']}")
  elif choice:
    rule = choice.get("rule", "thm_3_8")
    how = {"cost_model": "theory.optimal_gamma (the cost model E[tokens] / (gamma c + "
                         "T_verify(gamma+1) / T_p) with the verify costs measured)",
           "drafter": "the drafter's own cost model at its mean proposed length "
                      f"{choice.get('drafted_per_call', 0.0):.2f} (proposals shorter than "
                      "gamma: the warm-up gamma kept, speculation checked to pay)"}.get(
               rule, "theory.optimal_gamma (Thm 3.8)")
    lines.append(f"gamma {choice['gamma']} was chosen by {how} from "
                 f"alpha {choice['alpha']:.3f} and c {choice['c']:.3f}"
                 f"{' (in the loop)' if choice.get('c_in_loop') else ''} measured on "
                 f"{choice['warmup_examples']} warm-up examples; alpha and c above are from the "
                 "full run"
                 + (f"; Thm 3.8 would pick gamma {choice['thm_3_8']['gamma']}"
                    if "thm_3_8" in choice and choice['thm_3_8']['gamma'] != choice['gamma']
                    else "")
                 + (f"; at gamma {choice['gamma']} the warm-up measured "
                    f"{choice['warmup_timing']['speedup']:.2f}X (autoregressive / speculative, "
                    f"fastest of {choice['warmup_timing']['rounds']} rounds)"
                    if "warmup_timing" in choice else ""))
  for name, values in summary.get("metrics", {}).items():
    lines.append(f"quality, {name}: " + ", ".join(f"{k} {v:.2f}"
                                                 for k, v in sorted(values.items())))
  if summary.get("identical_fraction") is not None:
    why = ("at temperature 0 both decoders are greedy, so outputs should match" if
           temperature == 0 else "both decoders sample: speculative sampling keeps the target's "
           "distribution, not the baseline's draws, so a low value is expected")
    lines.append(f"identical outputs: {summary['identical_fraction']:.1%} ({why})")
  if summary.get("machine"):
    lines.append(f"machine: {report.machine_line(summary['machine'])}")
    cache = summary["machine"].get("compile_cache") or {}
    if cache.get("dir") and cache.get("requests"):
      lines.append(f"compiled programs: {cache['hits']} of {cache['requests']} loaded from the "
                   f"cache in {cache['dir']} (SPEC_DECODE_COMPILE_CACHE=off: none)")
  resume = summary.get("resume") or {}
  if resume.get("already_done"):
    lines.append(f"resumed: {resume['already_done']} of {resume['total']} examples were "
                 f"already decoded, {resume['decoded_now']} decoded by this run"
                 + (" (already complete: nothing decoded or re-measured)"
                    if resume.get("already_complete") else ""))
  for notice in summary.get("notices", ()):
    lines.append(f"note: {notice}")
  return "\n".join(lines)


def interrupted_line(output_dir: str) -> str:
  """What a Ctrl-C leaves: how many examples are saved where, and how to go on."""
  return saved_line(output_dir, "interrupted")


def host_lost_line(output_dir: str, lost: list[int] | None) -> str:
  """What a lost host leaves each survivor: who was lost, what is saved, how to go on."""
  return saved_line(output_dir, distributed.describe_lost(lost), rerun=_RERUN_ALL)


_RERUN_ALL = "rerun the same command on every host"


def saved_line(output_dir: str, what: str, rerun: str = "rerun the same command") -> str:
  """'PROGRAM: <what>: N examples are saved in PATH; <rerun> to resume from them'."""
  head, path, tail = saved_parts(output_dir, what, rerun)
  try:
    with open(path, "rb") as f:
      data = f.read()
    saved = sum(1 for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip())
  except OSError:
    saved = 0
  return f"{head}{saved}{tail}"


def saved_parts(output_dir: str, what: str, rerun: str) -> tuple[str, str, str]:
  """`saved_line` as (the text before N, the predictions file whose lines N counts, the
  text after N)."""
  from spec_decode.experiment import results
  path = os.path.join(output_dir, results.PREDICTIONS)
  return (f"{PROGRAM}: {what}: ", path,
          f" examples are saved in {path}; {rerun} to resume from them")


def main(argv: Sequence[str]) -> None:
  FLAGS = flags.FLAGS
  with errors.handle_errors(PROGRAM):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    errors.quiet_logging()
    compile_cache.enable()  # before anything compiles
    cpu_matmul.check_environment()
    distributed.initialize_from_flags()  # no-op for one process
    output_dir = FLAGS.output_dir or default_output_dir(FLAGS.gin_file or [DEFAULT_GIN_FILE])
    # A lost host: the line every survivor ends with (exit distributed.EXIT_HOST_LOST).
    distributed.on_host_lost(
        lambda lost: host_lost_line(output_dir, lost),
        coordinator_lost=saved_parts(output_dir, distributed.describe_lost([0]), _RERUN_ALL))
    try:
      with errors.one_line_on_interrupt(lambda: interrupted_line(output_dir)):
        summary = run(FLAGS.gin_file, FLAGS.gin_bindings, FLAGS.output_dir,
                      show_progress=FLAGS.progress and jax.process_index() == 0)
    except Exception as error:  # a failed collective: another process is gone
      lost = distributed.peer_lost(error)
      if lost is None:
        raise
      distributed.exit_host_lost(host_lost_line(output_dir, lost),
                                 error if FLAGS.verbose else None)
    if summary:  # process 0
      print(format_summary(summary))
    errors.ignore_late_interrupts()  # done: a Ctrl-C now would only disturb the exit


def run_command() -> None:
  """`python -m spec_decode.main [flags]`: defines the flags, parses them, runs `main`."""
  define_flags()
  app.run(main, flags_parser=errors.flags_parser(PROGRAM, gin_layer.rewrite_gin_args))


if __name__ == "__main__":
  run_command()
