"""Faults injected into whole runs of spec_decode.main (slow tier): a file-size limit that
stops a run mid-way, a kill -9 after every row is written but before the results are,
SIGINT in the same place, and SIGINT while the decode loops compile. Each ends in one line (or a killed process), and a rerun of the
same command ends with predictions identical to an uninterrupted run's, none lost, none
duplicated. Elsewhere: kill -9 / Ctrl-C after the first batch (test_main), a lost host
(test_host_loss), NaN checkpoints (test_checkpoint_faults), an impossible batch and many
compiled loops (test_footprint)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from spec_decode import paths
from spec_decode.cli import main
from spec_decode.experiment import results
from test_main import interruptible

pytestmark = pytest.mark.slow

ROOT = paths.REPO_ROOT
TOY = "configs/toy_random.gin"
BINDINGS = ["NUM_EXAMPLES = 8", "BATCH_SIZE = 2", "ExperimentConfig.step_timing_repeats = 2"]
CLI = [sys.executable, "-m", "spec_decode.main", "--noprogress", f"--gin_file={TOY}",
       "--gin.NUM_EXAMPLES=8", "--gin.BATCH_SIZE=2",
       "--gin.ExperimentConfig.step_timing_repeats=2"]


def _rows(out):
  with open(os.path.join(out, results.PREDICTIONS)) as f:
    return [json.loads(line) for line in f]


def _decoded(out):
  """{index: {decoder: tokens}}: what the rows decoded (timings differ between runs)."""
  return {r["index"]: {name: d["tokens"] for name, d in r["decoders"].items()}
          for r in _rows(out)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("reference"))
  main.run([TOY], BINDINGS, out, show_progress=False)
  return out


def _resume_and_check(out, reference):
  summary = main.run([TOY], BINDINGS, out, show_progress=False)
  assert summary["completed"] == 8
  indices = [r["index"] for r in _rows(out)]
  assert sorted(indices) == list(range(8))  # none lost, none duplicated
  assert _decoded(out) == _decoded(reference)
  for name in (results.RESULTS, results.TABLE_ROW):
    assert os.path.exists(os.path.join(out, name))


def test_a_file_size_limit_mid_run_is_one_line_and_the_rerun_completes(tmp_path, reference):
  """RLIMIT_FSIZE below the predictions of the second batch: the write fails (Python
  ignores SIGXFSZ, so the kernel returns EFBIG), the run ends with one line naming the
  file, and a rerun without the limit resumes from the saved rows."""
  first_batch = sum(len(json.dumps(r)) + 1 for r in _rows(reference)[:2])
  state = max(os.path.getsize(os.path.join(reference, f)) for f in os.listdir(reference)
              if f not in (results.PREDICTIONS, results.RESULTS, results.TABLE_ROW))
  limit = max(first_batch + first_batch // 2, state + 1)
  assert limit < 4 * first_batch, "state files larger than two batches of rows"
  out = str(tmp_path / "fsize")

  capped = [sys.executable, "-c",  # the limit set in the child itself (no fork of this one)
            f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, "
            f"{limit})); sys.argv[0] = 'spec_decode.main'; "
            "runpy.run_module('spec_decode.main', run_name='__main__')"]
  proc = subprocess.run(capped + CLI[3:] + [f"--output_dir={out}"], cwd=ROOT,
                        capture_output=True, text=True, timeout=400)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1 and "File too large" in lines[0], proc.stderr[-3000:]
  assert results.PREDICTIONS in lines[0]
  with open(os.path.join(out, results.PREDICTIONS), "rb") as f:
    saved = sum(1 for line in f.read().split(b"\n")[:-1])  # whole lines only
  assert 1 <= saved < 8
  _resume_and_check(out, reference)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill_9", "ctrl_c"])
def test_a_signal_after_the_last_row_before_the_results(tmp_path, reference, sig):
  """The signal lands once every row is written and results.json is not yet (the step
  costs are being measured or the summary written): the rerun decodes nothing, keeps every
  row and writes the results."""
  out = str(tmp_path / "late")
  # many timed step-cost repeats: the window between the last row and the results is long
  proc = subprocess.Popen(CLI + [f"--output_dir={out}",
                                 "--gin.ExperimentConfig.step_timing_repeats=400"],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=interruptible)
  path = os.path.join(out, results.PREDICTIONS)
  deadline = time.time() + 400
  try:
    while time.time() < deadline and proc.poll() is None:
      if os.path.exists(path) and len(open(path).read().splitlines()) == 8:
        break
      time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    assert not os.path.exists(os.path.join(out, results.RESULTS))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
    proc.wait()
  if sig == signal.SIGINT:
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert lines[-1] == (f"spec_decode.main: interrupted: 8 examples are saved in {path}; "
                         "rerun the same command to resume from them")
  else:
    assert proc.returncode == -signal.SIGKILL
  assert not os.path.exists(os.path.join(out, results.RESULTS))
  _resume_and_check(out, reference)


def _ctrl_c(command, wait, delay_s: float, env=None) -> tuple[int, str]:
  """Runs `command` (stdout piped), waits for wait(proc) and delay_s more, sends SIGINT:
  (exit code, stderr). A child still running 120 s after the signal is sent SIGABRT, and
  the failure shows where each of its threads was (Python's fault handler, on in the child):
  the training command once went on past its Ctrl-C in a suite run and never again in 52
  tries alone."""
  env = dict(os.environ, PYTHONFAULTHANDLER="1", **(env or {}))
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, preexec_fn=interruptible, env=env)
  try:
    wait(proc)
    time.sleep(delay_s)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    proc.send_signal(signal.SIGINT)
    try:
      _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGABRT)
      _, err = proc.communicate(timeout=60)
      raise AssertionError(f"still running 120 s after SIGINT; its threads at SIGABRT:\n"
                           f"{err[-8000:]}") from None
  finally:
    proc.kill()
    proc.wait()
  return proc.returncode, err


_COMPILING = CLI + ["--gin.NUM_EXAMPLES=20", "--gin.BATCH_SIZE=1"]
_NO_CACHE = {"SPEC_DECODE_COMPILE_CACHE": "off"}  # every run compiles its loops


def _wait_for_config(out: str):
  """wait(proc) for `_ctrl_c`: until the run has written out/config.json (or ended)."""
  config = os.path.join(out, "config.json")

  def wait(proc):
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not os.path.exists(config):
      time.sleep(0.02)
  return wait


_RUN_SECONDS: list[float] = []


def _seconds_after_config(tmp_path) -> float:
  """Seconds from config.json to the end of an uninterrupted run of `_COMPILING` (its
  loops compiling, then decoding), measured once per session on this machine."""
  if not _RUN_SECONDS:
    out = str(tmp_path / "reference")
    proc = subprocess.Popen(_COMPILING + [f"--output_dir={out}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **_NO_CACHE))
    _wait_for_config(out)(proc)
    start = time.time()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    _RUN_SECONDS.append(time.time() - start)
  return _RUN_SECONDS[0]


@pytest.mark.parametrize("fraction", [0.15, 0.3])
def test_ctrl_c_while_the_loops_compile_is_one_line_not_a_crash(tmp_path, fraction):
  """SIGINT a fraction of the way from config.json to the end of the run (the loops are
  compiling): exit 130 with the one line, no crash. The interpreter's shutdown under XLA's
  running compiler threads used to end such a run with a segmentation fault (exit 139).
  Without the compile cache, so the loops do compile then, and the delay in proportion to
  this machine's run: fixed delays of 1.5 and 3 s once fell after the end of a run whose
  programs earlier tests had cached (under 3 s from config.json on an AMD EPYC of family
  26), and the Ctrl-C landed in the interpreter's exit."""
  delay_s = fraction * _seconds_after_config(tmp_path)
  out = str(tmp_path / "compiling")
  returncode, err = _ctrl_c(_COMPILING + [f"--output_dir={out}"], _wait_for_config(out),
                            delay_s, env=_NO_CACHE)
  lines = [line for line in err.splitlines() if line.strip()]
  assert returncode == 130, f"SIGINT after {delay_s:.2f} s: {err[-3000:]}"
  assert "Fatal Python error" not in err and "Traceback" not in err, err[-3000:]
  path = os.path.join(out, results.PREDICTIONS)
  assert lines[-1].startswith("spec_decode.main: interrupted: ") and path in lines[-1]


def test_ctrl_c_during_training_is_one_line_naming_the_saved_state(tmp_path):
  """SIGINT to `spec_decode.cli.train` once it reports its first steps: exit 130 and one line
  naming the workdir whose last saved step a rerun resumes from; no traceback, no crash."""
  workdir = tmp_path / "work"
  training = lambda proc: proc.stdout.readline()  # the first report: training has started
  returncode, err = _ctrl_c(
      [sys.executable, "-m", "spec_decode.cli.train", "--gin_file=configs/demo/ende_small.gin",
       f"--gin.TrainConfig.workdir='{workdir}'",
       f"--gin.TrainConfig.export_path='{tmp_path / 'export'}'",
       "--gin.TrainConfig.num_steps=100000", "--gin.TrainConfig.batch_size=4",
       "--gin.TrainConfig.log_every=1", "--gin.TrainConfig.save_every=2",
       "--gin.TrainConfig.eval_every=100000"], training, 1.0)
  lines = [line for line in err.splitlines() if line.strip()]
  assert returncode == 130, err[-3000:]
  assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
  assert lines[-1] == (f"spec_decode.cli.train: interrupted: the train state is saved in "
                       f"{workdir} (saved every 2 steps); rerun the same command to resume "
                       "from its last saved step")
