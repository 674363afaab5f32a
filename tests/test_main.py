"""spec_decode.main end to end on tiny random models: outputs, resume after a kill, errors."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from spec_decode import checkpoints, decoding, experiment, paths, theory
from spec_decode.cli import gin as gin_layer
from spec_decode.cli import main
from spec_decode.experiment import gamma as gamma_choice
from spec_decode.experiment import model_specs
from spec_decode.experiment import results

import xla_flags

ROOT = paths.REPO_ROOT
# Every run here shares these shapes (batch 2, default.gin's lengths), so jit caches are reused.
SMALL = ["BATCH_SIZE = 2", "ExperimentConfig.step_timing_repeats = 2"]
TOY = "configs/toy_random.gin"  # tiny random models on the offline toy_reverse task


def _rows(out):
  with open(os.path.join(out, results.PREDICTIONS)) as f:
    return [json.loads(line) for line in f]


def _tokens_by_index(out):
  return {r["index"]: r["decoders"]["speculative"]["tokens"] for r in _rows(out)}


@pytest.mark.slow
def test_import_main_does_not_import_tensorflow():
  code = ("import sys, spec_decode.main, spec_decode.experiment, spec_decode.data; "
          "assert 'tensorflow' not in sys.modules and 'seqio' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_rewrite_gin_args():
  assert gin_layer.rewrite_gin_args(["prog", "--gin.GAMMA=3", "--gin.X='a=b'",
                                    "--output_dir=o"]) == [
      "prog", "--gin_bindings=GAMMA = 3", "--gin_bindings=X = 'a=b'", "--output_dir=o"]


@pytest.fixture(scope="module")
def greedy_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("greedy"))
  summary = main.run([TOY], SMALL + ["NUM_EXAMPLES = 6"], out, show_progress=True)
  return out, summary


@pytest.mark.slow
def test_end_to_end_outputs(greedy_run):
  out, summary = greedy_run
  for name in ("predictions.jsonl", "config.json", "progress.json", "results.json",
               "table_row.md", "config.gin"):
    assert os.path.exists(os.path.join(out, name)), name
  rows = _rows(out)
  assert sorted(r["index"] for r in rows) == list(range(6))
  with open(os.path.join(out, "results.json")) as f:
    stored = json.load(f)
  assert stored["table_row"] == summary["table_row"] and stored["completed"] == 6
  from spec_decode import data
  exs = data.load_examples(data.get_task("toy_reverse"), split="validation", num_examples=6,
                           feature_lengths={"inputs": 64, "targets": 32})
  long_targets = sum(ex.target_source_length > 32 for ex in exs)
  assert stored["truncated"] == {"examples": 6, "inputs": 0, "targets": long_targets,
                                 "inputs_length": 64, "targets_length": 32}
  assert any(f"{long_targets} of 6 references are longer than 32" in n
             for n in stored["notices"]) == (long_targets > 0)
  [run] = stored["runs"].values()
  assert run["rows"] == 6 and run["c"] == stored["timing"]["c"]
  text = main.format_summary(dict(summary, output_dir=out))
  assert f"files: {out}/" in text and "X: autoregressive / speculative decode time" in text
  from spec_decode.kernels import cpu_matmul
  assert stored["machine"]["cpu"]["model"] == cpu_matmul.cpu_info()["model"]
  assert f"machine: CPU {cpu_matmul.cpu_info()['model']} (" in text
  assert "c " in text and "draft / target time of one single-token decode step" in text
  assert "tokens per target call" in text and "each example's first call" in text
  gamma = summary["experiment"]["decoders"]["speculative"]["gamma"]
  assert gamma == 4 and summary["experiment"]["task"] == "toy_reverse"
  # Greedy: speculative output equals the autoregressive one, row by row.
  ar = [r["decoders"]["autoregressive"] for r in rows]
  spec = [r["decoders"]["speculative"] for r in rows]
  assert all(a["tokens"] == s["tokens"] for a, s in zip(ar, spec))
  assert summary["identical_fraction"] == 1.0
  assert summary["metrics"]["autoregressive"] == summary["metrics"]["speculative"]
  assert set(summary["metrics"]["speculative"]) == {"bleu"}
  for r, a, sp in zip(rows, ar, spec):
    st = sp["stats"]
    assert st["target_calls"] <= sp["length"] and a["stats"]["target_calls"] == a["length"]
    assert set(a["stats"]) == {"target_calls", "nonfinite_calls"}  # the baseline's counters
    assert st["decisions"] <= st["draft_tokens"] == gamma * st["target_calls"]
    assert sp["length"] == len(sp["tokens"]) <= 32
    # The engine's per-position counters add up to the row's totals.
    assert len(st["decided_at"]) == len(st["accepted_at"]) == gamma
    assert sum(st["decided_at"]) == st["decisions"] and sum(st["accepted_at"]) == st["accepted"]
    assert all(x <= d for x, d in zip(st["accepted_at"], st["decided_at"]))
    assert r["inputs"].startswith("reverse: ")
  col = lambda k: np.array([sp["stats"][k] if k in sp["stats"] else sp[k] for sp in spec],
                           np.float64)
  np.testing.assert_allclose(summary["alpha_observed"],
                             col("accepted").sum() / col("decisions").sum())
  np.testing.assert_allclose(summary["alpha_estimated"],
                             col("min_pq_sum").sum() / col("decisions").sum())
  np.testing.assert_allclose(summary["alpha_observed"], summary["alpha_estimated"])  # one-hots
  np.testing.assert_allclose(summary["tokens_per_target_call"],
                             col("length").sum() / col("target_calls").sum())
  # each row's first call apart: 1 .. gamma + 1 tokens, and the rest over the later calls
  first = col("first_call_tokens")
  assert np.all((first >= 1) & (first <= np.minimum(col("length"), gamma + 1)))
  np.testing.assert_allclose(summary["tokens_first_call"], first.mean())
  np.testing.assert_allclose(summary["tokens_per_later_call"],
                             (col("length").sum() - first.sum())
                             / (col("target_calls").sum() - len(spec)))
  batches = {r["batch"]: r for r in rows}
  assert len(batches) == 3
  t = summary["timing"]
  np.testing.assert_allclose(t["autoregressive_seconds"],
                             sum(b["decoders"]["autoregressive"]["batch_seconds"]
                                 for b in batches.values()))
  np.testing.assert_allclose(summary["speedup_measured"],
                             t["autoregressive_seconds"] / t["speculative_seconds"])
  np.testing.assert_allclose(t["c"], t["draft_step_seconds"] / t["target_step_seconds"])
  assert set(t["setup_seconds"]) == {"target", "draft"}  # each example's, timed
  assert all(isinstance(v, float) and np.isfinite(v) and v > 0
             for v in t["setup_seconds"].values())
  np.testing.assert_allclose(summary["speedup_predicted"],
                             theory.walltime_improvement(summary["alpha"], gamma, t["c"]))
  assert set(t["first_call_seconds"]) == set(t["compile_seconds"]) == {"autoregressive",
                                                                       "speculative"}
  reached = np.sum([sp["stats"]["decided_at"] for sp in spec], axis=0)
  accepted = np.sum([sp["stats"]["accepted_at"] for sp in spec], axis=0)
  assert summary["per_position_acceptance"] == [a / n if n else None
                                                for a, n in zip(accepted, reached)]
  with open(os.path.join(out, "table_row.md")) as f:
    table = f.read().splitlines()
  assert table[0] == "| task | draft | temp | gamma | alpha | c | predicted | measured |"
  assert table[2] == summary["table_row"]
  assert table[2] == (f"| toy_reverse | tiny (random) | 0 | 4 | {summary['alpha']:.2f} | "
                      f"{t['c']:.3f} | {summary['speedup_predicted']:.2f} | "
                      f"{summary['speedup_measured']:.2f} |")


@pytest.mark.slow
def test_rerun_of_finished_dir_recomputes_nothing(greedy_run):
  out, summary = greedy_run
  before = open(os.path.join(out, "predictions.jsonl")).read()
  again = main.run([TOY], SMALL + ["NUM_EXAMPLES = 6"], out, show_progress=False)
  assert open(os.path.join(out, "predictions.jsonl")).read() == before
  assert again["timing"]["first_call_seconds"] == {}  # nothing was decoded
  # "already complete": nothing re-measured, so c is the one measured with the rows.
  assert again["resume"] == {"total": 6, "already_done": 6, "decoded_now": 0,
                             "already_complete": True}
  assert again["timing"]["c"] == summary["timing"]["c"]
  assert again["runs"] == summary["runs"] and len(again["runs"]) == 1
  for k in ("alpha", "identical_fraction", "metrics", "speedup_measured", "completed"):
    assert again[k] == summary[k]
  assert not any("no step costs were recorded" in n for n in again["notices"])


@pytest.mark.slow
def test_rerun_of_finished_dir_without_its_runs_file_says_what_it_measured(greedy_run, tmp_path):
  """runs.json deleted: the complete rows are kept, the step costs measured again, and the
  summary says they are this run's, not those of the run that timed the rows."""
  out = str(tmp_path / "copy")
  shutil.copytree(greedy_run[0], out)
  os.remove(os.path.join(out, results.RUNS))
  again = main.run([TOY], SMALL + ["NUM_EXAMPLES = 6"], out, show_progress=False)
  assert again["resume"]["already_complete"] and again["completed"] == 6
  assert any(f"no step costs were recorded with these rows ({results.RUNS} missing" in n
             for n in again["notices"])
  with pytest.raises(ValueError, match="different experiment.*gamma: 4 -> 3"):
    main.run([TOY], SMALL + ["NUM_EXAMPLES = 6", "GAMMA = 3"], out, show_progress=False)


def interruptible() -> None:
  """A child's preexec_fn: SIGINT back to its default disposition. A test run started in
  the background of a non-interactive shell inherits SIGINT ignored, and Python then
  installs no KeyboardInterrupt handler: the child would ignore a Ctrl-C."""
  signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_after_first_rows(out: str, sig: int) -> tuple[int, str, str]:
  """spec_decode.main on 10 toy examples into `out`, sent `sig` once its first rows are
  written (slow batches, 40 timed runs each, so the signal lands mid-way): (exit code,
  stderr, predictions path)."""
  cmd = [sys.executable, "-m", "spec_decode.main", f"--output_dir={out}", "--noprogress",
         f"--gin_file={TOY}", "--gin.NUM_EXAMPLES=10", "--gin.BATCH_SIZE=2",
         "--gin.ExperimentConfig.step_timing_repeats=2", "--gin.ExperimentConfig.timing_repeats=40"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, preexec_fn=interruptible)
  path = os.path.join(out, results.PREDICTIONS)
  deadline = time.time() + 400
  try:
    while time.time() < deadline and proc.poll() is None:
      if os.path.exists(path) and os.path.getsize(path) > 0:
        break
      time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
    proc.wait()
  return proc.returncode, err, path


@pytest.mark.slow
def test_resume_after_kill(tmp_path, greedy_run):
  out = str(tmp_path / "killed")
  _interrupt_after_first_rows(out, signal.SIGKILL)
  before = _rows(out)
  assert 2 <= len(before) < 10 and not os.path.exists(os.path.join(out, results.RESULTS))
  summary = main.run([TOY], SMALL + ["NUM_EXAMPLES = 10"], out, show_progress=False)
  after = _rows(out)
  assert sorted(r["index"] for r in after) == list(range(10))  # none lost, none duplicated
  assert after[:len(before)] == before  # finished rows are kept as they were
  assert summary["completed"] == 10 and len({r["batch"] for r in after}) == 5
  # Rows from two runs: said, and each run's own timings kept apart.
  assert summary["resume"]["already_done"] == len(before)
  assert summary["resume"]["decoded_now"] == 10 - len(before)
  assert sorted(r["rows"] for r in summary["runs"].values()) == sorted([len(before),
                                                                        10 - len(before)])
  assert any("decoded by 2 runs" in n for n in summary["notices"])
  # The resumed run decodes exactly what an uninterrupted run does (here: the greedy
  # run's first 6 examples).
  reference = _tokens_by_index(greedy_run[0])
  assert all(_tokens_by_index(out)[i] == reference[i] for i in reference)


@pytest.mark.slow
def test_ctrl_c_ends_in_one_line_and_the_rerun_resumes(tmp_path):
  """SIGINT after the first rows: exit 130 and one line (no traceback) saying how many
  examples are saved where and how to resume; the rerun's summary says it resumed."""
  out = str(tmp_path / "interrupted")
  code, err, path = _interrupt_after_first_rows(out, signal.SIGINT)
  assert code == 130, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  saved = len(_rows(out))
  last = [line for line in err.splitlines() if line.strip()][-1]
  assert last == (f"spec_decode.main: interrupted: {saved} examples are saved in {path}; "
                  "rerun the same command to resume from them"), err[-3000:]
  assert 2 <= saved < 10
  summary = main.run([TOY], SMALL + ["NUM_EXAMPLES = 10"], out, show_progress=False)
  assert summary["completed"] == 10
  assert (f"resumed: {saved} of 10 examples were already decoded, {10 - saved} decoded by this "
          "run") in main.format_summary(summary)


def _interrupt_after_call(config, out, call):
  """Runs `config` into `out`, interrupted (KeyboardInterrupt) once decode call `call` has
  written its rows."""
  def interrupt(b):
    if b == call:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    experiment.run_experiment(config, output_dir=out, show_progress=False, on_batch=interrupt)


@pytest.mark.slow
def test_sampled_resume_is_exact(tmp_path):
  """Temperature 1: row randomness is keyed by example index, so a resumed run matches."""
  bindings = SMALL + ["NUM_EXAMPLES = 6", "TEMPERATURE = 1.0"]
  full = str(tmp_path / "full")
  summary = main.run([TOY], bindings, full, show_progress=False)
  assert len(summary["per_position_acceptance"]) == \
      summary["experiment"]["decoders"]["speculative"]["gamma"]
  config = gin_layer.parse_experiment([TOY], bindings)
  part = str(tmp_path / "part")
  _interrupt_after_call(config, part, 1)
  assert len(_rows(part)) == 4
  with open(os.path.join(part, results.PREDICTIONS), "a") as f:
    f.write('{"index": 4, "spec_tok')  # a write cut short by a kill
  resumed = experiment.run_experiment(config, output_dir=part, show_progress=False)
  assert sorted(r["index"] for r in _rows(part)) == list(range(6))
  assert _tokens_by_index(part) == _tokens_by_index(full)
  for k in ("alpha_observed", "alpha_estimated", "tokens_per_target_call", "metrics"):
    assert resumed[k] == summary[k]


def test_errors_are_clear(tmp_path):
  out = str(tmp_path / "err")
  with pytest.raises(ValueError, match=r"gamma must be an int >= 1, got 0"):
    main.run([TOY], SMALL + ["GAMMA = 0"], out, show_progress=False)
  with pytest.raises(ValueError, match="unknown task 'no_such_task'; known tasks: .*toy_reverse"):
    main.run([TOY], SMALL + ["MIXTURE_OR_TASK_NAME = 'no_such_task'"], out, show_progress=False)
  with pytest.raises(FileNotFoundError, match="target checkpoint not found: /nonexistent/ckpt"):
    main.run([TOY], SMALL + ["target/ModelSpec.checkpoint = '/nonexistent/ckpt'"], out,
             show_progress=False)
  with pytest.raises(FileNotFoundError, match="draft checkpoint not found"):
    main.run([TOY], SMALL + ["draft/ModelSpec.checkpoint = 'missing_draft'"], out,
             show_progress=False)
  with pytest.raises(FileNotFoundError, match="gin file not found"):
    main.run(["configs/nope.gin"], [], out, show_progress=False)
  assert not os.path.exists(os.path.join(out, "config.json"))  # failed runs leave no state


@pytest.mark.slow
def test_cli_reports_missing_checkpoint(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "spec_decode.main", f"--output_dir={tmp_path}", f"--gin_file={TOY}",
       "--gin.target/ModelSpec.checkpoint='/nonexistent/xxl'"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  [line] = [x for x in proc.stderr.splitlines() if "error" in x]
  assert "FileNotFoundError: target checkpoint not found: /nonexistent/xxl" in line
  assert "Traceback" not in proc.stderr


def test_model_specs_load_checkpoints_and_ngrams(tmp_path):
  spec = model_specs.ModelSpec(preset="t5_1_1_tiny", seed=3)
  model, params = model_specs.load(spec, model_specs.LoadContext("target"))
  path = str(tmp_path / "ckpt")
  checkpoints.save(path, model.config, params, format="t5x")
  loaded, lparams = model_specs.load(
      model_specs.ModelSpec(checkpoint=path, preset="t5_1_1_tiny", dtype="float32"),
      model_specs.LoadContext("target"))
  assert loaded.config == model.config
  jax.tree.map(np.testing.assert_array_equal, lparams, params)
  with pytest.raises(ValueError, match="does not match the preset"):
    model_specs.load(model_specs.ModelSpec(checkpoint=path, preset="t5_1_1_mini"),
                     model_specs.LoadContext("draft"))
  with pytest.raises(ValueError, match="vocab_size 64, expected 128"):
    model_specs.load(spec, model_specs.LoadContext("draft", vocab_size=128))
  ng, ng_params = model_specs.load(
      model_specs.ModelSpec(kind="ngram", options={"order": 1, "num_examples": 2}),
      model_specs.LoadContext("draft", vocab_size=64,
                              target_sequences=lambda split, n: [(5, 6, 1), (5, 1)][:n]))
  np.testing.assert_allclose(np.exp(ng_params["log_probs"])[[1, 5, 6]], [0.4, 0.4, 0.2],
                             rtol=1e-6)
  assert ng.vocab_size == 64 and ng.order == 1
  with pytest.raises(ValueError, match="unknown model kind 'tree'"):
    model_specs.load(model_specs.ModelSpec(kind="tree"), model_specs.LoadContext("draft"))
  with pytest.raises(ValueError, match="unknown T5 preset"):
    model_specs.ModelSpec(preset="t5_1_1_huge")
  with pytest.raises(ValueError, match="no decoders and no baseline"):
    experiment.ExperimentConfig(target=spec, draft=None, task="toy_reverse", decoders={},
                                baseline=None)
  with pytest.raises(ValueError, match="draft is set but no decoder drafts"):
    experiment.ExperimentConfig(target=spec, draft=spec, task="toy_reverse", decoders={})
  with pytest.raises(ValueError, match=r"decoders \['s'\] need a draft model"):
    experiment.ExperimentConfig(target=spec, draft=None, task="toy_reverse",
                                decoders={"s": decoding.Speculative()})


@pytest.mark.slow
def test_checkpoint_retrained_in_place_is_not_resumed(tmp_path):
  """Same config, same checkpoint path, different weights: refuse to mix predictions."""
  model, params = model_specs.load(model_specs.ModelSpec(preset="t5_1_1_mini", seed=0,
                                                        config={"vocab_size": 259}),
                                   model_specs.LoadContext("target"))
  path = str(tmp_path / "target")
  checkpoints.save(path, model.config, params, format="t5x")
  spec = model_specs.ModelSpec(checkpoint=path)
  first = model_specs.checkpoint_fingerprint(spec)
  assert first == model_specs.checkpoint_fingerprint(spec)  # stable
  assert model_specs.checkpoint_fingerprint(model_specs.ModelSpec(preset="t5_1_1_mini")) is None
  out = str(tmp_path / "run")
  ckpt = [f"target/ModelSpec.checkpoint = '{path}'", "NUM_EXAMPLES = 2"]
  main.run([TOY], SMALL + ckpt, out, show_progress=False)
  main.run([TOY], SMALL + ckpt, out, show_progress=False)  # unchanged: resumes
  retrained = jax.tree.map(lambda x: x * 1.01, params)
  import shutil
  shutil.rmtree(path)
  checkpoints.save(path, model.config, retrained, format="t5x")
  assert model_specs.checkpoint_fingerprint(spec) != first
  with pytest.raises(ValueError, match="different experiment.*checkpoint_fingerprints"):
    main.run([TOY], SMALL + ckpt, out, show_progress=False)


@pytest.mark.slow
def test_mesh_run_matches_unsharded(tmp_path, greedy_run):
  out = str(tmp_path / "mesh")
  main.run([TOY], SMALL + ["NUM_EXAMPLES = 2", "ExperimentConfig.mesh = 'data=2,model=2'"], out,
           show_progress=False)
  reference = _tokens_by_index(greedy_run[0])
  assert _tokens_by_index(out) == {i: reference[i] for i in range(2)}


def _free_port() -> int:
  import socket
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _launch(flags, env, *, processes: int):
  """spec_decode.main in `processes` local processes (gloo on 127.0.0.1), or one process."""
  base = [sys.executable, "-m", "spec_decode.main", *flags]
  if processes == 1:
    return [subprocess.Popen(base, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)]
  port = _free_port()
  return [subprocess.Popen(
      base + [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
              f"--process_id={i}"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(processes)]


def _wait(procs, what):
  try:
    logs = [p.communicate(timeout=400)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, (what, log[-3000:])
  return logs


@pytest.mark.slow
def test_two_processes_write_what_one_process_writes_and_resume_with_automatic_gamma(tmp_path):
  """main over 2 local processes (gloo on 127.0.0.1, 2 CPU devices each, data=2,model=2 mesh)
  with the gamma chosen from warm-up measurements: the warm-up decodes run collectively,
  each process feeds its half of every batch, process 0 gathers and writes, and the
  predictions equal a one-process run's
  at the chosen gamma. A multi-process rerun of the finished directory reuses process 0's
  recorded choice on every process (before that fix only process 0 read gamma.json while
  the others started the collective warm-up decodes, and the run hung)."""
  flags = [f"--gin_file={TOY}", "--noprogress", "--gin.NUM_EXAMPLES=4", "--gin.BATCH_SIZE=2",
           "--gin.ExperimentConfig.step_timing_repeats=1", "--gin.TEMPERATURE=1.0",
           "--gin.GammaChoice.warmup_examples=2",
           # Thm 3.8's rule: the cost model's extra verify timers are covered on one process
           "--gin.GammaChoice.rule='thm_3_8'",
           "--gin.GammaChoice.fallback_below=None",  # speculate at the chosen gamma
           "--gin.ExperimentConfig.mesh='data=2,model=2'"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags.flags(2))
  multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
  choose = "--gin.ExperimentConfig.gamma_choice=@GammaChoice()"
  logs = _wait(_launch(flags + [choose, f"--output_dir={multi}"], env, processes=2), "multi")
  assert "| toy_reverse |" in logs[0] and "| toy_reverse |" not in logs[1]  # process 0 prints
  with open(os.path.join(multi, experiment.GAMMA_FILE)) as f:
    gamma = json.load(f)["gamma"]
  env1 = dict(env, XLA_FLAGS=xla_flags.flags(4))
  procs = _launch(flags + [choose, f"--output_dir={multi}"], env, processes=2)
  procs += _launch(flags + [f"--gin.GAMMA={gamma}", f"--output_dir={single}"], env1,
                   processes=1)
  _wait(procs, "resume and single")
  with open(os.path.join(multi, experiment.GAMMA_FILE)) as f:
    assert json.load(f)["gamma"] == gamma
  got, want = _rows(multi), _rows(single)
  assert [r["index"] for r in got] == [r["index"] for r in want] == [0, 1, 2, 3]
  for g, w in zip(got, want):
    assert g["decoders"].keys() == w["decoders"].keys() == {"autoregressive", "speculative"}
    assert len(g["decoders"]["speculative"]["stats"]["decided_at"]) == gamma
    for name in g["decoders"]:
      for k in ("tokens", "stats"):
        assert g["decoders"][name][k] == w["decoders"][name][k], (name, k)


@pytest.mark.slow
def test_gamma_chosen_from_warmup_and_kept_on_resume(tmp_path):
  out = str(tmp_path / "auto")
  # Speculating whatever the prediction (the random toy pair may predict a slowdown, which
  # the fallback test below covers).
  choose = ["ExperimentConfig.gamma_choice = @GammaChoice()", "GammaChoice.warmup_examples = 2",
            "GammaChoice.fallback_below = None"]
  bindings = SMALL + ["NUM_EXAMPLES = 4"] + choose
  summary = main.run([TOY], bindings, out, show_progress=False)
  choice = summary["gamma_selection"]
  assert "fallback" not in choice
  with open(os.path.join(out, experiment.GAMMA_FILE)) as f:
    assert json.load(f) == choice
  # The default rule charges the measured verify costs (N = 2..6, 8, 10, 11 tokens).
  raw = {int(n): r for n, r in choice["verify_ratio_by_tokens"].items()}
  ratios = {int(n): r for n, r in choice["verify_ratio_fitted"].items()}
  assert choice["rule"] == "cost_model" and sorted(raw) == [2, 3, 4, 5, 6, 8, 10, 11]
  assert ratios == theory.nondecreasing_costs(raw)
  assert choice["gamma"] == choice["cost_model"]["gamma"] == theory.optimal_gamma(
      choice["alpha"], choice["c"], max_gamma=10, verify_ratio=ratios)
  assert choice["thm_3_8"]["gamma"] == theory.optimal_gamma(choice["alpha"], choice["c"],
                                                            max_gamma=10)
  assert 0.0 <= choice["alpha"] <= 1.0 and choice["c"] > 0 and choice["warmup_examples"] == 2
  assert summary["experiment"]["decoders"]["speculative"]["gamma"] == choice["gamma"]
  assert all(len(r["decoders"]["speculative"]["stats"]["decided_at"]) == choice["gamma"]
             for r in _rows(out))
  assert (f"gamma {choice['gamma']} was chosen by theory.optimal_gamma"
          in main.format_summary(summary))
  # A resumed run reuses the recorded choice instead of measuring again (the marker
  # alpha below could not come out of a measurement).
  with open(os.path.join(out, experiment.GAMMA_FILE), "w") as f:
    json.dump(dict(choice, alpha=0.123456), f)
  again = main.run([TOY], SMALL + ["NUM_EXAMPLES = 6"] + choose, out, show_progress=False)
  assert again["gamma_selection"] == dict(choice, alpha=0.123456)
  assert again["experiment"]["decoders"]["speculative"]["gamma"] == choice["gamma"]
  assert again["completed"] == 6
  # A gamma no warm-up could have chosen (edited, another run's) is named with the file.
  for bad, why in ((100000, "above the largest this run may choose"), (True, "not an int")):
    with open(os.path.join(out, experiment.GAMMA_FILE), "w") as f:
      json.dump(dict(choice, gamma=bad), f)
    with pytest.raises(results.OutputDirError, match=f"gamma.json .* is corrupt: .*{why}"):
      main.run([TOY], SMALL + ["NUM_EXAMPLES = 6"] + choose, out, show_progress=False)


def test_gamma_choice_stays_within_what_the_drafter_can_propose():
  """A warm-up choosing gamma for MTP modules or Medusa heads chooses among the gammas the
  drafter can propose (4 modules: at most 4), not up to GammaChoice.max_gamma, which the
  drafter refuses mid-run; a model drafter has no limit of its own."""
  import types
  def run_setup(drafter, draft, max_gamma=10, decode_len=48):
    config = types.SimpleNamespace(
        gamma_choice=experiment.GammaChoice(decoder="d", max_gamma=max_gamma),
        decode_len=decode_len, decoders={"d": decoding.Speculative(gamma=2, drafter=drafter)})
    return types.SimpleNamespace(config=config, draft=draft)
  modules, heads = types.SimpleNamespace(num_modules=4), types.SimpleNamespace(num_heads=3)
  assert decoding.MtpDrafter().max_gamma(modules) == 4
  assert decoding.MedusaDrafter().max_gamma(heads) == 3
  assert decoding.ModelDrafter().max_gamma(None) is None
  assert gamma_choice._max_gamma(run_setup(decoding.MtpDrafter(), modules)) == 4
  assert gamma_choice._max_gamma(run_setup(decoding.MedusaDrafter(), heads)) == 3
  assert gamma_choice._max_gamma(run_setup(decoding.MtpDrafter(), modules, max_gamma=2)) == 2
  assert gamma_choice._max_gamma(run_setup(decoding.ModelDrafter(), None)) == 10
  assert gamma_choice._max_gamma(run_setup(decoding.ModelDrafter(), None, decode_len=6)) == 6


@pytest.mark.slow
def test_gamma_choice_with_in_loop_costs(tmp_path):
  """GammaChoice.in_loop_costs: c is the proposal's cost after a verify call (recorded as
  such, beside the proposal's cost alone); the run reports both and its cost model charges
  the in-loop one."""
  out = str(tmp_path / "in_loop")
  choose = ["ExperimentConfig.gamma_choice = @GammaChoice()", "GammaChoice.warmup_examples = 2",
            "GammaChoice.fallback_below = None", "GammaChoice.in_loop_costs = True"]
  summary = main.run([TOY], SMALL + ["NUM_EXAMPLES = 2"] + choose, out, show_progress=False)
  choice = summary["gamma_selection"]
  # c's values are timings: their types and the in-loop floor are checked, not their size
  assert choice["c_in_loop"] is True and choice["c"] >= 0 and isinstance(choice["c_alone"],
                                                                         float)
  spec = summary["decoders"]["speculative"]
  assert spec["c_in_loop"] >= 0 and isinstance(spec["c"], float)
  assert summary["timing"]["c_in_loop"] == spec["c_in_loop"]
  text = main.format_summary(summary)
  assert "(in the loop) measured on 2 warm-up examples" in text
  assert f"and c in the loop {spec['c_in_loop']:.3f} (below)" in text
  with pytest.raises(ValueError, match="GammaChoice.in_loop_costs must be True or False"):
    experiment.GammaChoice(in_loop_costs=1)


@pytest.mark.slow
def test_gamma_choice_falls_back_to_the_autoregressive_loop(tmp_path):
  """Where the measured costs predict a slowdown at every gamma (here forced by a threshold
  no pair reaches), the chosen gamma is 0: the speculative decoder runs the autoregressive
  loop, with the same outputs as the baseline, says so, and a resumed run keeps it."""
  out = str(tmp_path / "fallback")
  choose = ["ExperimentConfig.gamma_choice = @GammaChoice()", "GammaChoice.warmup_examples = 2",
            "GammaChoice.max_gamma = 3", "GammaChoice.fallback_below = 1000.0"]
  summary = main.run([TOY], SMALL + ["NUM_EXAMPLES = 3"] + choose, out, show_progress=False)
  choice = summary["gamma_selection"]
  with open(os.path.join(out, experiment.GAMMA_FILE)) as f:
    assert json.load(f) == choice
  best = choice["cost_model"]
  assert choice["gamma"] == 0 and 1 <= best["gamma"] <= 3 and best["predicted_speedup"] < 1000
  assert (f"cost model predicts {best['predicted_speedup']:.2f}X at its best gamma "
          f"({best['gamma']};" in choice["fallback"])
  assert "below GammaChoice.fallback_below = 1000" in choice["fallback"]
  spec = summary["experiment"]["decoders"]["speculative"]
  assert spec["name"] == "autoregressive" and summary["experiment"]["draft"] is None
  for r in _rows(out):
    assert r["decoders"]["speculative"]["tokens"] == r["decoders"]["autoregressive"]["tokens"]
    assert "decided_at" not in r["decoders"]["speculative"]["stats"]
  assert summary["identical_fraction"] == 1.0 and summary["alpha"] is None
  text = main.format_summary(summary)
  assert "gamma 0 (autoregressive) ==" in text and "gamma 0: speculation cannot pay" in text
  again = main.run([TOY], SMALL + ["NUM_EXAMPLES = 4"] + choose, out, show_progress=False)
  assert again["gamma_selection"] == choice and again["completed"] == 4
  assert again["experiment"]["decoders"]["speculative"]["name"] == "autoregressive"


@pytest.mark.slow
@pytest.mark.parametrize("fallback_below", ["None", "1000.0"])
def test_gamma_choice_of_a_lookup_decoder(tmp_path, fallback_below):
  """A source lookup (no draft model) proposes fewer than gamma tokens, often none: the
  choice keeps the warm-up gamma and predicts from the drafter's mean proposed length
  (`Drafter.expected_tokens`), falling back to the autoregressive loop below the threshold."""
  out = str(tmp_path / "lookup")
  bindings = SMALL + [
      "NUM_EXAMPLES = 3", "ExperimentConfig.draft = None",
      "lookup/Speculative.drafter = @LookupDrafter()",
      "ExperimentConfig.decoders = {'lookup': @lookup/Speculative()}",
      "ExperimentConfig.gamma_choice = @GammaChoice()", "GammaChoice.decoder = 'lookup'",
      "GammaChoice.warmup_examples = 2", f"GammaChoice.fallback_below = {fallback_below}"]
  summary = main.run([TOY], bindings, out, show_progress=False)
  choice = summary["gamma_selection"]
  assert choice["rule"] == "drafter" and choice["drafter"]["gamma"] == 4
  expected = decoding.LookupDrafter().expected_tokens(
      alpha=choice["alpha"], gamma=4, counters={"draft_tokens": choice["drafted_per_call"],
                                                "target_calls": 1.0})
  ratio = choice["verify_ratio_by_tokens"]["5"]
  assert choice["drafter"]["verify_ratio"] == ratio
  assert choice["predicted_speedup"] == pytest.approx(expected / (4 * choice["c"] + ratio))
  assert 0.0 <= choice["drafted_per_call"] <= 4.0
  text = main.format_summary(summary)
  if fallback_below == "None":
    assert choice["gamma"] == 4 and "fallback" not in choice
    assert "the drafter's own cost model at its mean proposed length" in text
  else:
    assert choice["gamma"] == 0
    assert "the cost model at the drafter's mean proposed length" in choice["fallback"]
    assert f"T_verify(5) / T_p {ratio:.2f}" in choice["fallback"]
    assert summary["experiment"]["decoders"]["lookup"]["name"] == "autoregressive"
  assert summary["identical_fraction"] == 1.0


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_gamma_choice_fallback_threshold_is_checked(value):
  with pytest.raises(ValueError, match="GammaChoice.fallback_below must be a finite speedup"):
    experiment.GammaChoice(fallback_below=value)
  with pytest.raises(ValueError, match="measured_fallback_below must be a finite speedup"):
    experiment.GammaChoice(measured_fallback_below=value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_gamma_choice_timing_rounds_are_checked(value):
  with pytest.raises(ValueError, match="GammaChoice.timing_rounds must be an int >= 0"):
    experiment.GammaChoice(timing_rounds=value)


@pytest.mark.parametrize("examples,rows,calls", [
    (16, 32, [list(range(16)) * 2]),  # refill: 4 batches of 8 per call, 16 warm-up examples
    (16, 8, [list(range(8)), list(range(8, 16))]),
    (3, 2, [[0, 1], [2, 0]]),
    (1, 1, [[0]])])
def test_warmup_calls_fill_the_last_call_with_the_warmup_examples_again(examples, rows, calls):
  """The timed warm-up's calls hold the run's rows; a short last call is filled by cycling
  through the warm-up examples, not with copies of its last one (rows that would all accept
  alike and finish together)."""
  assert gamma_choice.warmup_calls(list(range(examples)), rows) == calls


@pytest.mark.parametrize("examples,rows", [(0, 8), (4, 0)])
def test_warmup_calls_need_examples_and_rows(examples, rows):
  with pytest.raises(ValueError, match="need warm-up examples and rows >= 1"):
    gamma_choice.warmup_calls(list(range(examples)), rows)


@pytest.mark.slow
@pytest.mark.parametrize("threshold", ["1e-6", "1e6"])
def test_gamma_choice_checks_its_prediction_on_the_timed_warmup(tmp_path, threshold):
  """A prediction that passes `fallback_below` is checked by timing both decoders on the
  warm-up examples at the chosen gamma: below `measured_fallback_below` (here forced either
  way) the decoder falls back to the autoregressive loop and says what it measured."""
  out = str(tmp_path / "measured")
  choose = ["ExperimentConfig.gamma_choice = @GammaChoice()", "GammaChoice.warmup_examples = 2",
            "GammaChoice.max_gamma = 3", "GammaChoice.fallback_below = 1e-6",
            f"GammaChoice.measured_fallback_below = {threshold}",
            "GammaChoice.timing_rounds = 2"]
  summary = main.run([TOY], SMALL + ["NUM_EXAMPLES = 3"] + choose, out, show_progress=False)
  choice = summary["gamma_selection"]
  best, timed = choice["cost_model"]["gamma"], choice["warmup_timing"]
  assert timed["gamma"] == best and timed["examples"] == 2 and timed["rounds"] == 2
  assert (len(timed["baseline_seconds"]) == len(timed["decoder_seconds"])
          == len(timed["first_call_seconds"]) == 2)
  assert all(isinstance(t, float) for t in timed["baseline_seconds"] + timed["decoder_seconds"])
  assert timed["speedup"] == pytest.approx(min(timed["baseline_seconds"])
                                           / min(timed["decoder_seconds"]))
  with open(os.path.join(out, experiment.GAMMA_FILE)) as f:
    assert json.load(f) == choice
  text = main.format_summary(summary)
  spec = summary["experiment"]["decoders"]["speculative"]
  if threshold == "1e-6":
    assert choice["gamma"] == best == spec["gamma"] and "fallback" not in choice
    assert f"at gamma {best} the warm-up measured {timed['speedup']:.2f}X" in text
  else:
    assert choice["gamma"] == 0 and spec["name"] == "autoregressive"
    assert f"measured {timed['speedup']:.2f}X against the autoregressive" in choice["fallback"]
    assert "below GammaChoice.measured_fallback_below = 1e+06" in choice["fallback"]
    assert "gamma 0: speculation did not pay on the warm-up" in text
  assert summary["identical_fraction"] == 1.0


@pytest.mark.slow
def test_named_decoders_from_gin(tmp_path):
  """Any number of named decoders from gin: each gets its tokens, stats, speedup, identity."""
  out = str(tmp_path / "named")
  bindings = SMALL + ["NUM_EXAMPLES = 3",
                      "g2/Speculative.gamma = 2", "g3/Speculative.gamma = 3",
                      "ExperimentConfig.decoders = {'g2': @g2/Speculative(), "
                      "'g3': @g3/Speculative()}"]
  summary = main.run([TOY], bindings, out, show_progress=False)
  assert list(summary["metrics"]) == ["autoregressive", "g2", "g3"]
  assert set(summary["decoders"]) == {"g2", "g3"} and summary["primary"] == "g2"
  assert summary["experiment"]["decoders"]["g3"]["gamma"] == 3
  assert summary["experiment"]["decoders"]["g3"]["verifier"]["name"] == "chain"
  for name, gamma in (("g2", 2), ("g3", 3)):
    d = summary["decoders"][name]
    assert d["identical_fraction"] == 1.0  # greedy
    assert d["speedup_measured"] > 0 and d["cost_model"]["expected_tokens"] >= 1
    for r in _rows(out):
      assert len(r["decoders"][name]["stats"]["decided_at"]) == gamma
  assert summary["table_row"].startswith("| toy_reverse | tiny (random) | 0 | 2 |")
  assert set(summary["timing"]["verify_ratio_by_tokens"]) == {"3", "4"}


@pytest.mark.slow
def test_baseline_only_experiment_has_no_cost_model(tmp_path):
  out = str(tmp_path / "ar_only")
  bindings = SMALL + ["NUM_EXAMPLES = 2", "ExperimentConfig.draft = None",
                      "ExperimentConfig.decoders = {'again': @Autoregressive()}"]
  summary = main.run([TOY], bindings, out, show_progress=False)
  again = summary["decoders"]["again"]
  assert again["identical_fraction"] == 1.0 and again["cost_model"] is None
  assert again["speedup_predicted"] is None and "c" not in summary["timing"]




def test_machine_line_names_the_cpu_the_weights_and_the_variants():
  from spec_decode.experiment import report
  m = {"backend": "cpu", "devices": "1 x cpu",
       "cpu": {"model": "Some CPU", "features": ["avx2", "avx512f"], "kernel": "on",
               "chosen_variants": {"1x512x1024:bfloat16": "16", "8x512x1024:bfloat16": "16p",
                                   "1x64x512:bfloat16": "16"},
               "packed_weights": {"bfloat16": 2}, "variant_override": None}}
  assert report.machine_line(m) == ("CPU Some CPU (avx2, avx512f); decode kernel weights "
                                    "bfloat16 x2; variants 16 (2 shapes), 16p (1 shapes)")
  m["cpu"]["variant_override"] = "8p"
  assert "variants 8p (fixed by environment)" in report.machine_line(m)
  m["cpu"] = {"model": "Some CPU", "features": [], "kernel": "off: no compiler"}
  assert report.machine_line(m) == ("CPU Some CPU (no listed features); decode kernel off: no "
                                    "compiler")
  assert report.machine_line({"backend": "gpu", "devices": "1 x H100"}) == "gpu: 1 x H100"


@pytest.mark.slow
def test_refill_run_matches_batches_and_resumes_exactly(tmp_path, greedy_run):
  """ExperimentConfig.refill_chunk = 2: decode calls of 2 batches' worth of examples in
  batch-size slots refilled inside the loop. Greedy outputs equal the batched run's; sampled,
  a run interrupted after its first call resumes to the uninterrupted run's outputs."""
  refill = ["ExperimentConfig.refill_chunk = 2"]
  out = str(tmp_path / "refill")
  summary = main.run([TOY], SMALL + refill + ["NUM_EXAMPLES = 6"], out, show_progress=False)
  assert summary["completed"] == 6
  assert _tokens_by_index(out) == _tokens_by_index(greedy_run[0])
  assert len({r["batch"] for r in _rows(out)}) == 2  # calls of 4 examples: 4 + 2

  bindings = SMALL + refill + ["NUM_EXAMPLES = 6", "TEMPERATURE = 1.0"]
  full = str(tmp_path / "full")
  main.run([TOY], bindings, full, show_progress=False)
  config = gin_layer.parse_experiment([TOY], bindings)
  part = str(tmp_path / "part")
  _interrupt_after_call(config, part, 0)
  assert len(_rows(part)) == 4
  experiment.run_experiment(config, output_dir=part, show_progress=False)
  assert sorted(r["index"] for r in _rows(part)) == list(range(6))
  assert _tokens_by_index(part) == _tokens_by_index(full)


def test_refill_calls_hold_chunks_and_costs_are_measured_at_the_slot_batch():
  """With refill_chunk 2 a decode call takes 2 batches' worth of examples, while step costs
  and the drivers' per-batch inputs keep the slot batch (the loop's batch)."""
  from experiments import harness
  from spec_decode.experiment import setup as run_setup
  config = gin_layer.parse_experiment([TOY], SMALL + ["NUM_EXAMPLES = 6",
                                                      "ExperimentConfig.refill_chunk = 2"])
  s = run_setup.load(config)
  assert run_setup.call_rows(s) == 4
  enc, ids = run_setup.inputs(s, s.examples[:3])
  assert enc.shape[0] == 4 and list(np.asarray(ids)) == [0, 1, 2, 2]
  batches, n = harness.setup_batches(s)
  assert n == 6 and [b[0].shape[0] for b in batches] == [2, 2, 2]


def test_an_unknown_draft_kind_is_refused_before_the_target_loads(monkeypatch):
  """A misspelled draft kind is named before minutes go into loading the target."""
  from spec_decode.experiment import setup
  target = model_specs.ModelSpec(preset="t5_1_1_tiny", config={"vocab_size": 64})
  config = experiment.ExperimentConfig(
      target=target, draft=model_specs.ModelSpec(kind="eagel"), task="toy_reverse",
      decoders={"speculative": decoding.Speculative(gamma=2)})

  def no_loading(spec, context):
    raise AssertionError(f"the {context.role} was loaded")
  monkeypatch.setitem(model_specs._LOADERS, "t5", no_loading)
  with pytest.raises(ValueError, match="unknown model kind 'eagel' for the draft; known: .*'eagle'"):
    setup.load(config)


def test_refill_settings_are_checked():
  spec = model_specs.ModelSpec(preset="t5_1_1_tiny", config={"vocab_size": 64})
  make = lambda **kw: experiment.ExperimentConfig(
      target=spec, draft=None, task="toy_reverse", decoders={}, **kw)
  with pytest.raises(ValueError, match="refill_chunk must be an int >= 0"):
    make(refill_chunk=-1)
  with pytest.raises(ValueError, match="refill_chunk applies to unsharded runs"):
    make(refill_chunk=2, mesh="data=1")
  with pytest.raises(ValueError, match="exclude each other"):
    make(refill_chunk=2, baseline=decoding.Autoregressive(compact_batch=True))


def test_a_mesh_axis_no_rule_names_is_refused():
  """'modle=8' (or any axis the logical axis rules never shard over) would replicate every
  array along it with nothing said; it is refused, naming the axis and the rules' axes. An
  axis a configured rule names is accepted."""
  spec = model_specs.ModelSpec(preset="t5_1_1_tiny", config={"vocab_size": 64})
  make = lambda **kw: experiment.ExperimentConfig(
      target=spec, draft=None, task="toy_reverse", decoders={}, **kw)
  with pytest.raises(ValueError, match=r"no logical axis rule shards over 'modle' "
                                       r"\(the rules use \['data', 'model'\]\)"):
    make(mesh="data=1,modle=1")
  make(mesh="data=-1,model=1")
  make(mesh="data=1,replica=1", logical_axis_rules=(("batch", ("replica", "data")),))
  with pytest.raises(ValueError, match="bad mesh spec entry"):
    make(mesh="data:2")


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 1.5, "x", True])
def test_seeds_outside_32_bits_are_refused(seed):
  """PRNGKey keeps 32 bits of a seed (2**32 gives seed 0's key), so a seed outside
  [0, 2**32) is refused where it is configured rather than silently aliased."""
  spec = model_specs.ModelSpec(preset="t5_1_1_tiny", config={"vocab_size": 64})
  with pytest.raises(ValueError, match=r"ExperimentConfig.seed must be an int in \[0, 2\*\*32\)"):
    experiment.ExperimentConfig(target=spec, draft=None, task="toy_reverse", decoders={},
                                seed=seed)
  with pytest.raises(ValueError, match=r"ModelSpec.seed must be an int in \[0, 2\*\*32\)"):
    model_specs.ModelSpec(preset="t5_1_1_tiny", seed=seed)
  experiment.ExperimentConfig(target=spec, draft=None, task="toy_reverse", decoders={},
                              seed=2 ** 32 - 1)
