"""The command line's errors: one line naming the problem and the fix, exit code 2; the run
directory: locked, duplicated or incomplete rows refused, default directory per user/checkout."""

import json
import os
import subprocess
import sys

import pytest

from spec_decode import data, experiment, paths
from spec_decode.cli import errors as cli
from spec_decode.cli import gin as gin_layer
from spec_decode.cli import main
from spec_decode.experiment import results
from spec_decode.experiment import status as run_status

ROOT = paths.REPO_ROOT
TOY = "configs/toy_random.gin"


def _cli(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "spec_decode.main", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_misspelled_macro_is_one_line_exit_2_and_verbose_shows_traceback(tmp_path):
  proc = _cli(f"--gin_file={TOY}", "--gin.GAMA=9", f"--output_dir={tmp_path / 'o'}")
  assert proc.returncode == 2
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert lines == ["spec_decode.main: error: GinConfigError: gin binding 'GAMA = 9' sets the "
                   "macro GAMA, which no gin file uses, so it would change nothing; did you mean "
                   "GAMMA? (--verbose shows the traceback)"], proc.stderr
  assert not os.path.exists(tmp_path / "o")
  verbose = _cli(f"--gin_file={TOY}", "--gin.GAMA=9", "--verbose")
  assert verbose.returncode == 2 and "Traceback (most recent call last)" in verbose.stderr


@pytest.mark.parametrize("files,bindings,error,match", [
    ([TOY], ["GAMA = 9"], ValueError, "macro GAMA, which no gin file uses.*did you mean GAMMA"),
    ([TOY], ["ExperimentConfig.gama = 9"], ValueError, "doesn't have a parameter named 'gama'"),
    ([TOY], ["NoSuchThing.x = 1"], ValueError, "No configurable matching 'NoSuchThing'"),
    ([TOY], ["MIXTURE_OR_TASK_NAME = toy_reverse"], ValueError,
     "strings must be quoted, e.g. --gin.NAME=\"'toy_reverse'\""),
    (["configs"], [], IsADirectoryError, "is a directory; pass a .gin file in it"),
    (["configs/nope.gin"], [], FileNotFoundError, "gin file not found"),
    (["gin/runs/benchmark.gin"], [], ValueError, "MIXTURE_OR_TASK_NAME"),
    (["gin/tasks/toy_reverse.gin"], [], ValueError, "do not configure an experiment"),
    ([TOY], ["ExperimentConfig.seed = %NO_SUCH"], gin_layer.GinConfigError,
     r"^the macro NO_SUCH is referenced \(%NO_SUCH\) but never set: bind it .*--gin.NO_SUCH="
     "VALUE[^|]*$"),  # not gin's dump of the whole config
    ([TOY], ["GAMMA = 4", "GAMMA = ("], gin_layer.GinConfigError,
     r"^gin binding 'GAMMA = \(': gin syntax error: EOF in multi-line statement \(an "
     "unclosed"),
    ([TOY], ["TEMPERATURE = inf"], gin_layer.GinConfigError,
     "cannot parse the gin value 'inf': .*numbers here must be finite"),
    ([TOY], ["TEMPERATURE = -NaN"], gin_layer.GinConfigError, "must be finite"),
])
def test_gin_mistakes_are_clear(files, bindings, error, match):
  with pytest.raises(error, match=match):
    gin_layer.parse_experiment(files, bindings)


def test_macros_used_by_the_config_are_accepted():
  config = gin_layer.parse_experiment([TOY], ["GAMMA = 3", "TEMPERATURE = 0.5",
                                             "ExperimentConfig.timing_repeats = 2"])
  assert config.decoders["speculative"].gamma == 3 and config.sampling.temperature == 0.5
  assert config.timing_repeats == 2


def test_macros_that_nothing_built_reads_are_refused():
  """A macro bound on the command line must reach a built object: GAMMA with decoders that
  carry their own gammas (a tree experiment) would change nothing."""
  with pytest.raises(ValueError, match="sets the macro GAMMA, which none of the configured "
                                       "objects reads"):
    gin_layer.parse_experiment(["configs/demo/ende_tree_experiment.gin"], ["GAMMA = 5"])
  with pytest.raises(ValueError, match="configured gamma 7 would have no effect"):
    gin_layer.parse_experiment(["configs/demo/ende_experiment.gin"], ["GAMMA = 7"])
  fixed = gin_layer.parse_experiment(["configs/demo/ende_experiment.gin"],
                                     ["GAMMA = 7", "ExperimentConfig.gamma_choice = None"])
  assert fixed.decoders["speculative"].gamma == 7 and fixed.gamma_choice is None


def test_near_zero_temperature_is_refused():
  with pytest.raises(ValueError, match="use 0 for greedy"):
    gin_layer.parse_experiment([TOY], ["TEMPERATURE = 1e-38"])


def test_output_dir_is_checked_before_models_load(tmp_path, monkeypatch):
  def no_setup(*args, **kwargs):
    raise AssertionError("models were loaded before the output_dir was checked")

  monkeypatch.setattr(experiment, "setup", no_setup)
  file = tmp_path / "afile"
  file.write_text("x")
  with pytest.raises(results.OutputDirError, match="is a file, not a directory"):
    main.run([TOY], [], str(file), show_progress=False)
  with pytest.raises(results.OutputDirError, match="cannot be created: .*afile is a file"):
    main.run([TOY], [], str(file / "sub"), show_progress=False)
  os.chmod(tmp_path, 0o500)
  try:
    if not os.access(tmp_path, os.W_OK):  # root can write anyway
      with pytest.raises(results.OutputDirError, match="not writable"):
        main.run([TOY], [], str(tmp_path / "new"), show_progress=False)
  finally:
    os.chmod(tmp_path, 0o700)


def test_second_run_into_a_locked_dir_is_refused(tmp_path, monkeypatch):
  out = str(tmp_path / "run")
  with results.locked(out):
    with pytest.raises(results.OutputDirError,
                       match=rf"in use by another run \(pid {os.getpid()} on .*\)"):
      with results.locked(out):
        pass
    monkeypatch.setattr(experiment, "setup", lambda *a, **k: pytest.fail("setup ran"))
    config = gin_layer.parse_experiment([TOY], [])
    with pytest.raises(results.OutputDirError, match="in use by another run"):
      experiment.run_experiment(config, output_dir=out, show_progress=False)
  with results.locked(out):  # released: usable again
    pass
  assert not os.path.exists(out)  # created by the lock, nothing written: removed again


def test_failed_run_leaves_an_existing_dir_and_its_lock_usable(tmp_path):
  out = tmp_path / "existing"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(ValueError):
    with results.locked(str(out)):
      raise ValueError("boom")
  assert (out / "keep.txt").exists()
  with results.locked(str(out)):
    pass


def _write_rows(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def test_duplicated_or_incomplete_rows_are_errors(tmp_path):
  path = str(tmp_path / results.PREDICTIONS)
  row = {"index": 0, "target": "a", "spec_output": "a", "batch": "r1:0"}
  _write_rows(path, [row, dict(row, index=1), dict(row, spec_output="b")])
  with pytest.raises(ValueError, match=r"predictions.jsonl:3 repeats example index 0 of line 1"):
    results.read_rows(path)
  incomplete = {k: v for k, v in row.items() if k != "spec_output"}
  _write_rows(path, [row, dict(incomplete, index=1)])
  with pytest.raises(ValueError, match=r":2 \(index 1\) does not have the fields of the other "
                                       r"rows \(missing \['spec_output'\]"):
    results.read_rows(path)
  _write_rows(path, [row, dict(row, index=1)])
  assert sorted(results.read_rows(path)) == [0, 1]


def test_default_output_dir_is_per_user_and_checkout(monkeypatch):
  import getpass
  here = main.default_output_dir(["configs/demo/ende_experiment.gin"])
  assert getpass.getuser() in here and os.path.basename(here).startswith("ende_experiment-")
  monkeypatch.setattr(paths, "REPO_ROOT", "/some/other/checkout")
  other = main.default_output_dir(["configs/demo/ende_experiment.gin"])
  assert other != here and os.path.dirname(other) == os.path.dirname(here)


def test_default_output_dir_of_another_user_or_open_to_others_is_refused(tmp_path):
  mine = tmp_path / "spec_decode-me" / "default-1234"
  main.check_default_output_dir(str(mine))  # creates the parent, private
  assert oct(os.stat(mine.parent).st_mode & 0o777) == oct(0o700)
  mine.mkdir()
  main.check_default_output_dir(str(mine))
  os.chmod(mine, 0o777)  # e.g. made by another user with a permissive umask
  with pytest.raises(results.OutputDirError, match=r"default-1234 may be written by any "
                                                   r"user \(mode 777\); pass --output_dir"):
    main.check_default_output_dir(str(mine))
  os.rmdir(mine)
  os.symlink(tmp_path, mine)
  with pytest.raises(results.OutputDirError, match="default-1234 is a symbolic link"):
    main.check_default_output_dir(str(mine))
  if os.getuid() == 0:  # root can hand the directory to another user
    os.unlink(mine)
    mine.mkdir()
    os.chown(mine, 12345, -1)
    with pytest.raises(results.OutputDirError, match=r"belongs to another user \(uid 12345\)"):
      main.check_default_output_dir(str(mine))


@pytest.mark.parametrize("planted", [results.LOCK, results.PREDICTIONS])
def test_links_planted_in_the_output_dir_are_not_written_through(tmp_path, planted):
  """A symbolic link in place of the lock or the predictions file is refused by name; the
  atomic writes create their temporary file under a fresh name and replace a link at the
  destination itself, so the file it pointed to is never written."""
  out, victim = tmp_path / "out", tmp_path / "victim.txt"
  out.mkdir()
  victim.write_text("precious\n")
  os.symlink(victim, out / planted)
  with pytest.raises(results.OutputDirError, match=f"{planted} is a symbolic link"):
    if planted == results.LOCK:
      with results.locked(str(out)):
        pass
    else:
      results.append_rows(str(out / planted), [{"index": 0}])
  for name in ("results.json", "results.json.tmp"):  # the old temporary name, planted
    os.symlink(victim, out / name)
  results.write_json(str(out / "results.json"), {"a": 1})
  assert victim.read_text() == "precious\n"
  assert not os.path.islink(out / "results.json")
  assert json.loads((out / "results.json").read_text()) == {"a": 1}
  assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == ["results.json.tmp"]


@pytest.mark.parametrize("content", ['{"task": "x"', "\xff\xfe", "[1, 2]", "[" * 100000])
def test_corrupt_state_files_are_named(tmp_path, content):
  """config.json and runs.json that are not JSON objects (cut short, binary, another
  program's, absurdly nested) are errors naming the file, never a JSONDecodeError."""
  for name, read in ((results.CONFIG, lambda: results.check_config(str(tmp_path), {"a": 1})),
                     (results.RUNS, lambda: results.read_runs(str(tmp_path)))):
    (tmp_path / name).write_bytes(content.encode("latin-1"))
    with pytest.raises(results.OutputDirError, match=f"{name} .* is corrupt"):
      read()


@pytest.mark.parametrize("line,why", [
    ('{"index": 1e999}', "index inf is not an int"), ('{"index": -3}', "index -3 is not"),
    ('{"index": "0"}', "index '0' is not"), ('{"index": true}', "index True is not"),
    ('{"batch": "' + "x" * 300 + '", "index": 1.0}', "index 1.0 is not"),
    ('{"tokens": []}', "no index"), ('{"index": ' + "[" * 100000 + "}", "nested too deeply")])
def test_absurd_prediction_rows_are_named(tmp_path, line, why):
  """A row the run cannot use is named by file and line, with what is wrong with it (the
  printed start of the line need not reach the bad field)."""
  path = tmp_path / results.PREDICTIONS
  path.write_text('{"index": 0}\n' + line + "\n")
  with pytest.raises(ValueError, match=f"{results.PREDICTIONS}:2 is not a prediction row "
                                       rf"\(.*{why}"):
    results.read_rows(str(path))


def test_rows_without_their_settings_are_not_resumed(tmp_path):
  """config.json records the settings the rows were decoded with; with it deleted (or
  corrupt), a rerun must not decode the rest with its own settings into the same file."""
  (tmp_path / results.PREDICTIONS).write_text('{"index": 0}\n')
  with pytest.raises(results.OutputDirError, match=f"has {results.PREDICTIONS} but no "
                                                   f"{results.CONFIG}.*empty this one"):
    results.check_config(str(tmp_path), {"a": 1})
  assert not (tmp_path / results.CONFIG).exists()
  (tmp_path / results.CONFIG).write_text('{"a": ')
  with pytest.raises(results.OutputDirError, match="is corrupt.*cannot be resumed under "
                                                   "unknown settings"):
    results.check_config(str(tmp_path), {"a": 1})
  (tmp_path / results.CONFIG).unlink()
  (tmp_path / results.PREDICTIONS).write_text("")  # no rows yet
  (tmp_path / results.GAMMA).write_text('{"gamma": 3}')  # but a gamma chosen for them
  with pytest.raises(results.OutputDirError, match=f"has {results.GAMMA} but no"):
    results.check_config(str(tmp_path), {"a": 1})
  (tmp_path / results.GAMMA).unlink()  # nothing made yet: a fresh start
  results.check_config(str(tmp_path), {"a": 1})
  assert json.loads((tmp_path / results.CONFIG).read_text()) == {"a": 1}


def test_table_row_escapes_labels():
  """A model label with '|' and a line break stays one cell of one table row."""
  import types
  from spec_decode import decoding
  from spec_decode.experiment import report
  config = types.SimpleNamespace(
      algorithms={"speculative": decoding.Speculative(gamma=3)}, primary="speculative",
      draft=types.SimpleNamespace(label="small | v2\nfinal"), task="my|task",
      sampling=decoding.Sampling())
  row = report.table_row(config, {"alpha": 0.5, "timing": {"c": 0.1}, "speedup_predicted": 1.5,
                                  "speedup_measured": 1.2})
  assert row == "| my\\|task | small \\| v2 final | 0 | 3 | 0.50 | 0.100 | 1.50 | 1.20 |"


def test_missing_extra_names_the_extra():
  err = ModuleNotFoundError("No module named 'seqio'", name="seqio")
  assert cli.is_known(err)
  assert "pip install -e '.[data]'" in cli.describe(err)
  assert not cli.is_known(ModuleNotFoundError("No module named 'spec_decode.x'",
                                              name="spec_decode.x"))  # a bug: traceback


@pytest.mark.parametrize("message,want", [
    ("ExperimentConfig.gamma must be an int >= 1, got 0\n  In call to configurable "
     "'ExperimentConfig' (<class 'spec_decode.experiment.config.ExperimentConfig'>)",
     "ValueError: ExperimentConfig.gamma must be an int >= 1, got 0"),
    ("unsupported operand\n  In call to configurable 'Sampling' (<class 'x.Sampling'>)",
     "ValueError: unsupported operand | in gin configurable Sampling"),
])
def test_gins_call_line_is_dropped_where_the_message_names_the_configurable(message, want):
  assert cli.describe(ValueError(message)) == want


def test_handler_exit_code_and_one_line(capsys):
  with pytest.raises(SystemExit) as exit_info:
    with cli.handle_errors("prog", verbose=False):
      raise FileNotFoundError("checkpoint not found: /x; copy it here")
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "prog: error: FileNotFoundError: checkpoint not found" in err
  with pytest.raises(KeyError):  # not a known error: a bug keeps its traceback
    with cli.handle_errors("prog", verbose=False):
      raise KeyError("x")


@pytest.mark.parametrize("name,value,match", [
    ("SPEC_DECODE_CPU_KERNEL_VARIANT", "32", "must be one of 8, 8p, 8r, 8rp, 8f, 8fp, 8fr"),
    ("SPEC_DECODE_CPU_MATMUL_THREADS", "0", "must be a positive int"),
    ("SPEC_DECODE_CPU_MATMUL_THREADS", "two", "must be a positive int")])
def test_kernel_environment_is_checked_at_start(monkeypatch, name, value, match):
  """Checked without building the kernel, so a run whose models never reach it (the toy
  models) refuses the value too, instead of taking it silently and reporting it."""
  from spec_decode.kernels import cpu_matmul
  monkeypatch.delenv("SPEC_DECODE_CPU_KERNEL_VARIANT", raising=False)
  monkeypatch.delenv("SPEC_DECODE_CPU_MATMUL_THREADS", raising=False)
  cpu_matmul.check_environment()
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=f"{name} {match}"):
    cpu_matmul.check_environment()


@pytest.mark.slow
def test_bad_kernel_environment_ends_the_toy_job_before_anything_is_written(tmp_path):
  out = tmp_path / "o"
  proc = subprocess.run([sys.executable, "-m", "spec_decode.main", f"--gin_file={TOY}",
                         f"--output_dir={out}"], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, SPEC_DECODE_CPU_KERNEL_VARIANT="32"))
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert "SPEC_DECODE_CPU_KERNEL_VARIANT must be" in lines[0] and not out.exists()


def test_an_interrupt_python_swallows_in_a_callback_is_raised_again():
  """A KeyboardInterrupt raised inside a callback Python runs for C code (here a finalizer,
  as in JAX's garbage-collection callback) reaches only sys.unraisablehook; the command
  must still end, so it is raised again in the main thread. A suite started in the
  background of a non-interactive shell inherits SIGINT ignored, where Python installs no
  KeyboardInterrupt handler and `_thread.interrupt_main` does nothing: the test installs
  Python's handler for its duration."""
  import signal
  import time

  class Finalized:
    def __del__(self):
      raise KeyboardInterrupt  # as a Ctrl-C landing in the callback

  reported = []
  previous = sys.unraisablehook
  previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
  sys.unraisablehook = reported.append
  try:
    with cli.interrupts_not_swallowed(delay_s=0.01):
      with pytest.raises(KeyboardInterrupt):
        Finalized()
        for _ in range(500):  # 5 s at most; the interrupt comes after 0.01 s
          time.sleep(0.01)
      class Other:
        def __del__(self):
          raise RuntimeError("not an interrupt")
      Other()
    assert [type(u.exc_value) for u in reported] == [RuntimeError]  # others: as before
  finally:
    sys.unraisablehook = previous
    signal.signal(signal.SIGINT, previous_sigint)


def test_a_finished_command_ignores_a_late_interrupt():
  """After a command's work is done (`ignore_late_interrupts`), a Ctrl-C on its way during
  the exit raises nothing: no traceback from an exit hook."""
  import os
  import signal
  import time
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    cli.ignore_late_interrupts()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # a KeyboardInterrupt would be raised here
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
  finally:
    signal.signal(signal.SIGINT, previous)


def test_resume_messages():
  assert run_status.resume_state(4, 4, "o/p.jsonl")["message"].startswith("decoding 4 examples")
  state = run_status.resume_state(10, 4, "o/p.jsonl")
  assert state["message"].startswith("resuming 6/10") and not state["already_complete"]
  done = run_status.resume_state(10, 0, "o/p.jsonl")
  assert done["message"].startswith("already complete") and done["already_complete"]


def test_runs_are_listed_separately_and_truncation_noticed(tmp_path):
  out = str(tmp_path)
  rows = {i: {"index": i, "batch": f"{'a' if i < 2 else 'b'}:{i}", "decoders": {
      "autoregressive": {"batch_seconds": 2.0 if i < 2 else 3.0},
      "speculative": {"batch_seconds": 1.0}}} for i in range(4)}
  results.record_run(out, "a", {"c": 0.1, "devices": "cpu x1", "step_times": {"c": 0.1}})
  results.record_run(out, "b", {"c": 0.2, "devices": "TPU v4 x8", "step_times": {"c": 0.2}})
  exs = [data.Example(i, "x", "y", (5, 1), (5, 1), input_source_length=n, target_source_length=2)
         for i, n in enumerate([2, 9, 3, 70])]

  class Config:
    feature_lengths = {"inputs": 8, "targets": 8}
    num_examples, split, task = 1000, "validation", "toy_reverse"  # the split had only 4

  extras = run_status.summary_extras(out, rows, exs, Config, run_status.resume_state(4, 2, "p"))
  assert extras["runs"]["a"]["speedup_measured"] == 2.0 and extras["runs"]["b"]["c"] == 0.2
  assert extras["runs"]["b"]["speedup_measured"] == 3.0 and extras["runs"]["a"]["rows"] == 2
  assert extras["runs"]["b"]["speedups"] == {"speculative": 3.0}
  assert extras["runs"]["a"]["seconds"] == {"autoregressive": 4.0, "speculative": 2.0}
  assert extras["truncated"]["inputs"] == 2 and extras["truncated"]["targets"] == 0
  text = " ".join(extras["notices"])
  assert "decoded by 2 runs" in text and "different devices" in text
  assert "2 of 4 inputs were longer than 8 tokens" in text
  assert ("1000 examples were asked for (NUM_EXAMPLES) but the 'validation' split of "
          "toy_reverse has 4: all 4 were decoded") in text
  Config.num_examples = 4
  assert "asked for" not in " ".join(run_status.summary_extras(
      out, rows, exs, Config, run_status.resume_state(4, 2, "p"))["notices"])
  assert run_status.recorded_step_times(out) == {"c": 0.2}


@pytest.mark.slow
def test_default_job_output_is_one_clean_block_and_imports_no_tensorflow(tmp_path):
  """The no-argument job (2 examples): progress lines from the start, no platform-probing
  noise or config dump, one summary block saying where the files are; no TensorFlow.

  The fallback to the autoregressive loop is switched off: the suite's two workers share
  the machine's cores, so the warm-up's two timing repeats can be slowed by the other
  worker and predict less than `GammaChoice.fallback_below` (seen on CI). This test is
  about the summary of a speculative run; test_main covers the fallback's summary. Gamma is
  chosen from 1..4: the default's 1..10 also times verify calls of 6 to 11 tokens, a quarter
  of this run's time (55 s against 41 s alone on 2 AMD EPYC cores)."""
  out = str(tmp_path / "default")
  code = ("import runpy, sys\n"
          f"sys.argv = ['spec_decode.main', '--output_dir={out}', '--gin.NUM_EXAMPLES=2',\n"
          "            '--gin.GammaChoice.warmup_examples=1', '--gin.GammaChoice.max_gamma=4',\n"
          "            '--gin.GammaChoice.fallback_below=None',\n"
          "            '--gin.ExperimentConfig.step_timing_repeats=2']\n"
          "try:\n"
          "  runpy.run_module('spec_decode.main', run_name='__main__', alter_sys=True)\n"
          "except SystemExit as e:\n"
          "  assert not e.code, e.code\n"
          "bad = [m for m in ('tensorflow', 'seqio') if m in sys.modules]\n"
          "assert not bad, bad\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  err = [line for line in proc.stderr.replace("\r", "\n").splitlines()
         if line.strip() and "ex/s" not in line and "%|" not in line]
  progress = [line for line in err if line.startswith("[spec_decode] ")]
  assert err == progress, err  # nothing but progress lines: no probing noise, no config dump
  text = " ".join(progress)
  for step in ("loading task synthetic_ende", "loading the target model",
               "loading the draft model", "decoding 2 examples", "choosing gamma",
               "compiling both decoders", "measuring the step costs"):
    assert step in text, step
  assert text.index("loading task") < text.index("compiling")
  stdout = proc.stdout
  assert f"files: {out}/" in stdout and "| EnDe (synthetic) |" in stdout
  assert "measured speedup" in stdout and "X: autoregressive / speculative" in stdout
  assert "was chosen by theory.optimal_gamma" in stdout and "identical outputs" in stdout
  assert max(len(line) for line in stdout.splitlines()) < 300
  # what it wrote: the demo EnDe pair on its task, greedy outputs equal to the baseline's
  with open(os.path.join(out, "results.json")) as f:
    summary = json.load(f)
  assert summary["experiment"]["task"] == "synthetic_ende"
  assert summary["experiment"]["target"]["checkpoint"] == "demo_models/ende_target_big"
  assert summary["identical_fraction"] == 1.0 and summary["completed"] == 2
  # the CPU and the decode kernel: the demo checkpoints are stored in bfloat16, so the
  # kernel packs their weights as bfloat16 (the float32 bits at half the bytes)
  from spec_decode.kernels import cpu_matmul
  assert f"machine: CPU {cpu_matmul.cpu_info()['model']}" in stdout
  if cpu_matmul.available():
    assert summary["machine"]["cpu"]["packed_weights"].get("bfloat16", 0) >= 1
  assert summary["metrics"]["autoregressive"] == summary["metrics"]["speculative"]
  with open(os.path.join(out, "table_row.md")) as f:
    assert summary["table_row"] in f.read()
  assert summary["table_row"].startswith("| EnDe (synthetic) | demo small")


@pytest.mark.parametrize("module,args,match", [
    ("spec_decode.cli.train", ["--gin_file=configs/demo/ende_small.gin", "--gin.NUM_STEP=3"],
     "spec_decode.cli.train: error: GinConfigError: gin binding 'NUM_STEP = 3' sets the macro"),
    ("spec_decode.cli.train", ["--gin_file=configs/demo"], "spec_decode.cli.train: error: "
     "IsADirectoryError: --gin_file configs/demo is a directory"),
    ("spec_decode.cli.train", ["--gin_file=configs/demo/common.gin"], "spec_decode.cli.train: "
     "error: GinConfigError: the gin files ['configs/demo/common.gin'] must configure one "
     "training run"),
    # settings refused when the config is built, before any step (export_path and workdir
    # unset: nothing would be written even if they were not)
    ("spec_decode.cli.train", ["--gin_file=configs/demo/ende_small.gin",
                               "--gin.TrainConfig.export_path=None",
                               "--gin.TrainConfig.workdir=None", "--gin.TrainConfig.num_steps=1",
                               "--gin.TrainConfig.export_dtype='int8'"],
     "spec_decode.cli.train: error: ValueError: TrainConfig.export_dtype must be one of "
     "('float32', 'bfloat16', 'float16')"),
    ("spec_decode.cli.train", ["--gin_file=configs/demo/ende_eagle.gin",
                               "--gin.EagleTrainConfig.export_path=None",
                               "--gin.EagleTrainConfig.workdir=None",
                               "--gin.EagleTrainConfig.num_steps=1",
                               "--gin.EagleTrainConfig.head={'bogus': 1}"],
     "spec_decode.cli.train: error: ValueError: EagleTrainConfig.head has unknown keys "
     "['bogus']; valid keys"),
    ("spec_decode.cli.memory", ["--from_json=/nonexistent/plans.json"], "spec_decode.cli.memory: "
     "error: FileNotFoundError: No such file or directory: /nonexistent/plans.json"),
    ("spec_decode.cli.memory", ["--dtype=int3"], "spec_decode.cli.memory: error: ValueError: "
     "--dtype must name a floating dtype"),
    ("spec_decode.cli.memory", ["--mesh=modle=2"], "spec_decode.cli.memory: error: ValueError: "
     "mesh spec 'modle=2': no logical axis rule shards over 'modle'"),
    ("experiments.benchmark", ["--gammas=0"], "python -m experiments.benchmark: error: "
     "ValueError: --gammas must list ints >= 1, got '0' (SPEC_DECODE_TRACEBACK=1 shows"),
    ("experiments.verify_scaling", ["--models=nope"], "python -m experiments.verify_scaling: "
     "error: FileNotFoundError: target checkpoint not found"),
    ("experiments.results_readme", ["--results_dir=/nonexistent"], "python -m "
     "experiments.results_readme: error: FileNotFoundError: No such file or directory"),
])
@pytest.mark.slow
def test_other_command_lines_end_known_errors_in_one_line(module, args, match):
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(match), proc.stderr[-2000:]


def test_data_extra_installs_what_tfds_imports_lazily():
  """tensorflow-datasets 4.9.10 imports importlib_resources when it builds a dataset (Python
  3.11) without declaring it: the [data] extra must."""
  import ast
  tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
  extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                for kw in node.keywords if kw.arg == "extras_require")
  extras = ast.literal_eval(extras)
  assert "importlib_resources" in extras["data"]
  assert any(r.startswith("tensorflow-datasets") for r in extras["data"])


def test_gin_files_that_are_not_text_or_leave_a_bracket_open_are_named(tmp_path):
  unclosed = tmp_path / "unclosed.gin"
  unclosed.write_text(f'include "{TOY}"\nGAMMA = [1, 2\n')
  with pytest.raises(gin_layer.GinConfigError, match=r"unclosed.gin, line 3: EOF in "
                                                     r"multi-line statement \(an unclosed"):
    gin_layer.parse_experiment([str(unclosed)], [])
  latin = tmp_path / "latin.gin"
  latin.write_bytes(f'include "{TOY}"\n# caf\xe9\n'.encode("latin-1"))
  with pytest.raises(gin_layer.GinConfigError, match=r"latin.gin, line 2: not UTF-8 text"):
    gin_layer.parse_experiment([str(latin)], [])


def test_a_missing_include_is_named_with_its_file_and_line(tmp_path):
  """gin itself fails with a TypeError on a missing 'configs/...' include (configs/ is also
  an importable namespace package from the repository root); the check names it first, in
  the top-level file and in a file it includes. Includes found in the repository root (the
  configs' own form) and commented-out lines pass."""
  top = tmp_path / "top.gin"
  top.write_text(f'include "{TOY}"\n# include "configs/commented_out.gin"\n'
                 "include 'configs/no_such.gin'\n")
  with pytest.raises(gin_layer.GinConfigError, match=r"top.gin, line 3: included file "
                     r"'configs/no_such.gin' not found \(looked in "):
    gin_layer.parse_experiment([str(top)], [])
  nested = tmp_path / "nested.gin"
  nested.write_text(f"include '{top}'\n")
  with pytest.raises(gin_layer.GinConfigError, match=r"top.gin, line 3: included file"):
    gin_layer.parse_experiment([str(nested)], [])
  top.write_text(f'include "{TOY}"\n# include "configs/commented_out.gin"\n')
  assert gin_layer.parse_experiment([str(nested)], ["NUM_EXAMPLES = 3"]).num_examples == 3


def test_a_gin_syntax_error_names_the_binding_or_the_file_and_line(tmp_path):
  with pytest.raises(gin_layer.GinConfigError, match=r"gin binding 'NUM_EXAMPLES = 10\*\*9': "
                     r"gin syntax error: Expected newline"):
    gin_layer.parse_experiment([TOY], ["NUM_EXAMPLES = 10**9"])
  bad = tmp_path / "bad.gin"
  bad.write_text(f'include "{TOY}"\nGAMMA = 3 +* 2\n')
  with pytest.raises(gin_layer.GinConfigError, match=r"bad.gin, line 2: gin syntax error"):
    gin_layer.parse_experiment([str(bad)], [])


def test_a_temperature_that_is_not_a_number_is_named():
  with pytest.raises(ValueError, match="temperature must be a number, got None"):
    gin_layer.parse_experiment([TOY], ["TEMPERATURE = None"])


def test_a_bad_environment_timeout_is_named(monkeypatch):
  from spec_decode.checkpoints import storage
  monkeypatch.setenv("SPEC_DECODE_GCS_TIMEOUT_S", "abc")
  with pytest.raises(ValueError, match="SPEC_DECODE_GCS_TIMEOUT_S must be a positive number "
                                       "of seconds, got 'abc'"):
    storage._timeout_from_env()


@pytest.mark.slow
@pytest.mark.parametrize("args, env, expected", [
    (["--no_such_flag"], {}, "error: Unknown command line flag 'no_such_flag' (--helpfull"),
    (["--progress=maybe"], {},
     "error: flag --progress=maybe: Non-boolean argument to boolean flag 'maybe' (--helpfull"),
    ([f"--gin_file={TOY}"], {"JAX_PLATFORMS": "no_such_backend"},
     "error: Unable to initialize backend 'no_such_backend'"),
], ids=["unknown_flag", "non_boolean", "unknown_backend"])
def test_flag_and_environment_errors_are_one_line_exit_2(tmp_path, args, env, expected):
  proc = subprocess.run([sys.executable, "-m", "spec_decode.main", *args,
                         f"--output_dir={tmp_path / 'o'}"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, **env))
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("spec_decode.main: ") and expected in lines[0], lines[0]


def test_drivers_end_known_errors_in_one_line_from_the_command_line_only(monkeypatch, capsys):
  """A driver run as `python -m experiments.X` (argv None) ends a bad argument with one line
  and exit 2; SPEC_DECODE_TRACEBACK=1 prints the traceback instead (still exit 2); called
  with an argv, as tests and notebooks do, it raises the error itself."""
  from experiments import batch_scaling
  monkeypatch.setattr(sys, "argv", ["batch_scaling", "--batch_sizes", "0"])
  monkeypatch.delenv("SPEC_DECODE_TRACEBACK", raising=False)
  with pytest.raises(SystemExit) as e:
    batch_scaling.main()
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.strip() == ("python -m experiments.batch_scaling: error: ValueError: --batch_sizes "
                         "must list ints >= 1, got '0' (SPEC_DECODE_TRACEBACK=1 shows the "
                         "traceback)")
  monkeypatch.setenv("SPEC_DECODE_TRACEBACK", "1")
  with pytest.raises(SystemExit):
    batch_scaling.main()
  assert "Traceback (most recent call last)" in capsys.readouterr().err
  with pytest.raises(ValueError, match="--batch_sizes must list ints >= 1"):
    batch_scaling.main(["--batch_sizes", "0"])
