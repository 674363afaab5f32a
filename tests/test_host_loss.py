"""A lost host: every surviving process ends quickly with one line and EXIT_HOST_LOST, and
the rerun resumes to the predictions of an uninterrupted run.

The slow tests run local processes over 127.0.0.1 (gloo collectives), every wait bounded:
spec_decode.main over two processes with process 1 or process 0 killed (-9) after the first
rows (the survivor learns it from its failed collective, or from JAX's abort when process 0,
the coordinator, is gone), and two bare processes with one stopped (SIGSTOP: a silent host,
no connection reset; the watchdog ends the survivor) or process 0 killed. The rest checks
the pieces: which errors mean a lost peer and whom they name, the line, the abort handler
in a child process (and its negative control), the watchdog's judgement, and the timeout
flags.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest
from absl import flags

from spec_decode import distributed, native, paths
from spec_decode.cli import main
from spec_decode.experiment import results
import xla_flags
from test_main import TOY, _launch, _rows, _wait

ROOT = paths.REPO_ROOT
_SURVIVOR_BOUND_S = 30  # the survivor's exit, from the kill
# 6 examples in batches of 2, each batch timed 10 times: process 1 is killed while the
# second batch runs. One CPU device per process, the batch split over both (data=2).
_FLAGS = [f"--gin_file={TOY}", "--noprogress", "--gin.NUM_EXAMPLES=6", "--gin.BATCH_SIZE=2",
          "--gin.ExperimentConfig.step_timing_repeats=1",
          "--gin.ExperimentConfig.timing_repeats=10",
          "--gin.ExperimentConfig.mesh='data=-1,model=1'", "--shutdown_timeout_s=60"]
_FORBIDDEN = ("Traceback", "Fatal Python error", "Check failure", "Terminating process")


def _env(devices: int) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags.flags(devices))


def _end(procs) -> list[str]:
  """Kills what still runs; the output of each."""
  for p in procs:
    if p.poll() is None:
      p.kill()
  return [p.communicate()[0] or "" for p in procs]


# ------------------------------------------------------------------ end to end
def _saved(path: str) -> int:
  """Complete, non-blank lines of a predictions file (a kill may cut the last one)."""
  with open(path, "rb") as f:
    data = f.read()
  return sum(1 for line in data[:data.rfind(b"\n") + 1].splitlines() if line.strip())


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_process_ends_the_survivor_in_one_line_and_the_rerun_resumes(tmp_path, killed):
  """Process 1 killed: the survivor's collective fails (or its watchdog finds the silence).
  Process 0 killed (it hosts JAX's coordination service and writes the predictions): the
  survivor's JAX client aborts from C++ at once, or its collective fails first; either way
  the run's line comes last, with EXIT_HOST_LOST."""
  out, ref = str(tmp_path / "two"), str(tmp_path / "one")
  path = os.path.join(out, results.PREDICTIONS)
  procs = _launch(_FLAGS + [f"--output_dir={out}"], _env(1), processes=2)
  survivor = procs[1 - killed]
  try:
    deadline = time.monotonic() + 300
    while not (os.path.exists(path) and os.path.getsize(path) > 0):
      if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
        pytest.fail("no rows before the kill:\n" + "\n".join(t[-2000:] for t in _end(procs)))
      time.sleep(0.05)
    procs[killed].kill()
    start = time.monotonic()
    log = survivor.communicate(timeout=_SURVIVOR_BOUND_S)[0]
    took = time.monotonic() - start
  finally:
    _end(procs)
  assert survivor.returncode == distributed.EXIT_HOST_LOST, log[-3000:]
  assert took < _SURVIVOR_BOUND_S
  # When JAX's client aborts, its own message (a C++ check failure) precedes the line.
  for bad in _FORBIDDEN if killed else ("Traceback", "Fatal Python error"):
    assert bad not in log, log[-3000:]
  saved = _saved(path)
  assert 2 <= saved < 6
  last = [line for line in log.splitlines() if line.strip()][-1]
  assert last == (f"spec_decode.main: process {killed} was lost: {saved} examples are saved in "
                  f"{path}; rerun the same command on every host to resume from them"), log[-3000:]
  # The same command on both hosts resumes; an uninterrupted one-process run (two devices,
  # the same mesh) decodes the reference alongside.
  procs = _launch(_FLAGS + [f"--output_dir={out}"], _env(1), processes=2)
  procs += _launch(_FLAGS + [f"--output_dir={ref}"], _env(2), processes=1)
  logs = _wait(procs, "rerun and reference")
  assert f"resumed: {saved} of 6 examples were already decoded" in logs[0], logs[0][-3000:]
  got, want = _rows(out), _rows(ref)
  assert sorted(r["index"] for r in got) == [r["index"] for r in want] == list(range(6))
  got = {r["index"]: r for r in got}
  for w in want:
    g = got[w["index"]]
    assert g["decoders"].keys() == w["decoders"].keys() == {"autoregressive", "speculative"}
    for name in w["decoders"]:
      for k in ("tokens", "stats"):
        assert g["decoders"][name][k] == w["decoders"][name][k], (w["index"], name, k)


# Two bare processes: join the run, say so, wait; argv: port, process id, heartbeat
# timeout, seconds to wait.
_IDLE = ("import sys, time\n"
         "from spec_decode import distributed\n"
         "distributed.initialize('127.0.0.1:' + sys.argv[1], 2, int(sys.argv[2]),\n"
         "                       heartbeat_timeout_s=int(sys.argv[3]), shutdown_timeout_s=30)\n"
         "print('joined', flush=True)\n"
         "time.sleep(float(sys.argv[4]))\n")


def _idle_pair(heartbeat_s: int, waits: tuple[float, float]) -> list[subprocess.Popen]:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, "-c", _IDLE, str(port), str(i), str(heartbeat_s),
                             str(waits[i])], cwd=ROOT, env=_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  for p in procs:  # both joined (initialize waits for every process)
    if p.stdout.readline().strip() != "joined":
      _end(procs)
      pytest.fail(f"a process did not join: exit {p.returncode}")
  return procs


@pytest.mark.slow
def test_a_silent_process_ends_the_survivor_after_the_heartbeat_timeout():
  """SIGSTOP: no connection is reset and no collective fails; the watchdog ends the
  survivor once process 1 has been silent for --heartbeat_timeout_s (before JAX's own
  heartbeat timeout, which would abort it)."""
  procs = _idle_pair(2, (120, 120))
  try:
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    _, err = procs[0].communicate(timeout=_SURVIVOR_BOUND_S)
    took = time.monotonic() - stopped
  finally:
    _end(procs)
  assert procs[0].returncode == distributed.EXIT_HOST_LOST, err[-3000:]
  assert 2 <= took < 2 + 5, took
  assert err.strip() == ("process 1 was lost; rerun the same command on every host to "
                         "resume"), err[-3000:]


@pytest.mark.slow
def test_a_killed_coordinator_ends_the_idle_survivor_with_the_line():
  """Process 0 (JAX's coordination service) killed while nothing is in flight: process
  1's JAX client aborts from C++ at once; the SIGABRT handler finds the coordinator gone
  and ends it with the line and EXIT_HOST_LOST instead of the abort's -6."""
  procs = _idle_pair(30, (120, 120))
  try:
    procs[0].kill()
    start = time.monotonic()
    _, err = procs[1].communicate(timeout=_SURVIVOR_BOUND_S)
    took = time.monotonic() - start
  finally:
    _end(procs)
  assert procs[1].returncode == distributed.EXIT_HOST_LOST, err[-3000:]
  assert took < 10, took  # the abort, not the 30 s watchdog
  assert "Fatal Python error" not in err
  assert err.rstrip().splitlines()[-1] == ("process 0 was lost; rerun the same command on "
                                           "every host to resume"), err[-3000:]


# The handler alone, in a child process: armed for a coordinator at a port, the line set
# with a predictions file to count, then an abort. argv: port, path.
_ABORT = ("import os, sys\n"
          "from spec_decode import distributed\n"
          "assert distributed._arm_coordinator_abort('127.0.0.1:' + sys.argv[1], 500) is None\n"
          "distributed.on_host_lost(None, coordinator_lost=('head ', sys.argv[2], ' tail'))\n"
          "os.abort()\n")


def _abort_child(port: int, path: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", _ABORT, str(port), path], cwd=ROOT,
                        env=_env(1), capture_output=True, text=True, timeout=120)


def test_an_abort_with_the_coordinator_gone_ends_with_the_line_and_the_count(tmp_path):
  path = tmp_path / "predictions.jsonl"
  path.write_bytes(b'{"index": 0}\n \t\n{"index": 1}\r\n{"index": 2, "cut')  # 2 complete rows
  with socket.socket() as sock:  # a port nothing listens on: the connection is refused
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  proc = _abort_child(port, str(path))
  assert proc.returncode == distributed.EXIT_HOST_LOST, proc.stderr[-3000:]
  assert proc.stderr.endswith("\nhead 2 tail\n"), proc.stderr[-3000:]


def test_an_abort_with_the_coordinator_answering_stays_an_abort(tmp_path):
  """The negative control: any other abort is left as it was (SIGABRT, no line)."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    proc = _abort_child(sock.getsockname()[1], str(tmp_path / "none"))
  assert proc.returncode == -signal.SIGABRT, proc.stderr[-3000:]
  assert "head" not in proc.stderr


@pytest.mark.parametrize("address, want", [
    ("127.0.0.1:1234", ("127.0.0.1", 1234)), ("localhost:80", None), ("[::1]:8476", ("::1", 8476)),
])
def test_coordinator_addresses(address, want):
  ip, port = distributed.coordinator_ip_port(address)
  assert (ip, port) == want if want else port == 80 and ip in ("127.0.0.1", "::1")


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:x", ":80",
                                     "no.such.host.invalid:80"])
def test_bad_coordinator_addresses(address):
  with pytest.raises(ValueError, match="coordinator"):
    distributed.coordinator_ip_port(address)


@pytest.mark.slow
def test_a_process_waiting_at_exit_is_not_lost():
  """Process 1 ends at once and waits at exit (JAX's shutdown barrier) while process 0
  works on for three heartbeat timeouts: it still beats, so both end normally."""
  procs = _idle_pair(1, (0, 3))
  try:
    outs = [p.communicate(timeout=60) for p in procs]
  finally:
    _end(procs)
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
    assert "lost" not in err, err[-3000:]


@pytest.mark.slow
def test_the_exit_prints_what_is_pending_then_the_line():
  """exit_host_lost: stdout flushed, the traceback first when given (--verbose), the line
  last, EXIT_HOST_LOST, and no exit handler run (JAX's would wait in a shutdown barrier)."""
  code = ("import atexit, jax\n"
          "from spec_decode import distributed\n"
          "atexit.register(lambda: print('an exit handler ran'))\n"
          "print('pending output', end='')\n"
          "try:\n"
          "  raise jax.errors.JaxRuntimeError('UNKNOWN: Gloo failed: Connection reset by peer')\n"
          "except Exception as e:\n"
          "  distributed.exit_host_lost('the line', e)\n")
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(1), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == distributed.EXIT_HOST_LOST, proc.stderr[-3000:]
  assert proc.stdout == "pending output"
  assert proc.stderr.startswith("Traceback") and "JaxRuntimeError" in proc.stderr
  assert proc.stderr.endswith("\nthe line\n")


# A thread outside Python (as JAX's C++ threads, which log while the process ends: its
# client's abort message when process 0 is gone) writes to stderr without pause; then the
# exit. argv: the noise library, then 'armed' to arm the abort handler first (a
# coordinator port that refuses) or 'plain'.
_NOISE_SOURCE = ("#include <pthread.h>\n#include <unistd.h>\n"
                 "static void* Noise(void*) { for (;;) write(2, \"noise\\n\", 6); return 0; }\n"
                 "extern \"C\" int start_noise() { pthread_t t;\n"
                 "  return pthread_create(&t, 0, Noise, 0); }\n")
_NOISY_EXIT = ("import ctypes, socket, sys, time\n"
               "from spec_decode import distributed\n"
               "if sys.argv[2] == 'armed':\n"
               "  with socket.socket() as s:\n"
               "    s.bind(('127.0.0.1', 0))\n"
               "    port = s.getsockname()[1]\n"
               "  assert distributed._arm_coordinator_abort(f'127.0.0.1:{port}', 500) is None\n"
               "assert ctypes.CDLL(sys.argv[1]).start_noise() == 0\n"
               "time.sleep(0.02)\n"
               "distributed.exit_host_lost('the line')\n")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["armed", "plain"])
def test_the_line_stays_last_while_other_threads_write(tmp_path, mode):
  """Process 0 lost: JAX's abort message raced the exit and came after the line (seen in
  CI). Nothing another thread writes after the line reaches stderr, with the abort
  handler armed (the line written from C) or not."""
  source, library = tmp_path / "noise.cc", tmp_path / "noise.so"
  source.write_text(_NOISE_SOURCE)  # built here, not into the user's kernel cache
  subprocess.run([native.compiler(), "-O2", "-shared", "-fPIC", "-pthread", str(source), "-o",
                  str(library)], check=True, timeout=300)
  for _ in range(3):
    proc = subprocess.run([sys.executable, "-c", _NOISY_EXIT, str(library), mode], cwd=ROOT,
                          env=_env(1), capture_output=True, text=True, timeout=120)
    assert proc.returncode == distributed.EXIT_HOST_LOST, proc.stderr[-300:]
    assert "noise" in proc.stderr  # the noise ran
    assert proc.stderr.count("the line") == 1, proc.stderr[-300:]
    assert proc.stderr.endswith("\nthe line\n"), proc.stderr[-300:]


# ------------------------------------------------------------------ the pieces
_RESET = ("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read "
          "error [127.0.0.1]:51383: Connection reset by peer")


@pytest.mark.parametrize("text, me, n, lost", [
    (_RESET, 0, 2, [1]),
    ("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read "
     "error [127.0.0.1]:40000: Connection reset by peer", 1, 2, [0]),
    ("UNKNOWN: Gloo all-gather failed: [gloo/transport/tcp/pair.cc:446] Timed out waiting "
     "30000ms for recv operation to complete", 0, 4, []),  # unknown among three peers
    ("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n2\nThe "
     "tasks have crashed. Check the task logs for an earlier error.", 0, 4, [2]),
    ("INTERNAL: Shutdown barrier has failed.\nBarrier result: 'INTERNAL: Barrier failed "
     "because: task is set to ERROR: UNAVAILABLE: Task 3 heartbeat timeout. This indicates "
     "that the remote task has failed, got preempted, or crashed unexpectedly.", 1, 4, [3]),
    ("UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
     "preempted/died/restarted unexpectedly or this task is experiencing network issues. "
     "{grpc_message:\"Socket closed\", grpc_status:14}", 2, 4, [0]),
])
def test_errors_of_a_lost_peer_and_whom_they_name(text, me, n, lost):
  error = jax.errors.JaxRuntimeError(text)
  assert distributed.peer_lost_text(error) == text
  try:  # wrapped by the code it passed through: found in the chain
    raise RuntimeError("the decode failed") from error
  except RuntimeError as wrapped:
    assert distributed.peer_lost_text(wrapped) == text
  assert distributed.lost_processes(text, process_id=me, num_processes=n) == lost


@pytest.mark.parametrize("error", [
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 2101755406800 "
                               "bytes"),
    jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes do not match"),
    ConnectionResetError("Connection reset by peer"),  # not JAX's: e.g. a gs:// read
    ValueError("task 1 heartbeat timeout"),
])
def test_other_errors_are_not_a_lost_peer(error):
  assert distributed.peer_lost_text(error) is None


def test_a_single_process_never_has_a_lost_peer():
  assert distributed.peer_lost(jax.errors.JaxRuntimeError(_RESET)) is None


def test_the_line_names_the_lost_process_the_saved_examples_and_the_resume(tmp_path):
  out = str(tmp_path)
  with open(os.path.join(out, results.PREDICTIONS), "w") as f:
    f.write('{"index": 0}\n{"index": 1}\n{"index": 2}\n{"index": 3, "cut')  # a cut last write
  path = os.path.join(out, results.PREDICTIONS)
  assert main.host_lost_line(out, [1]) == (
      f"spec_decode.main: process 1 was lost: 3 examples are saved in {path}; rerun the same "
      "command on every host to resume from them")
  assert "another process was lost: 3 examples" in main.host_lost_line(out, [])
  assert "processes 1, 3 were lost: 3 examples" in main.host_lost_line(out, [1, 3])


class _Store:
  """The coordination service's key-value store, as the watchdog uses it."""

  def __init__(self):
    self.kv, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Socket closed")
    self.kv[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: Socket closed")
    return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def test_the_watchdog_counts_a_process_lost_after_timeout_seconds_of_silence():
  store = _Store()
  dogs = [distributed.Watchdog(store, i, 3, timeout_s=10, now=0.0) for i in range(3)]
  store.kv[distributed.Watchdog.KEY_PREFIX + "other"] = "x"  # a key not ours: ignored
  for t in range(0, 40, 1):  # every process beats until t = 20, then process 2 falls silent
    for i, dog in enumerate(dogs):
      if i < 2 or t < 20:
        assert dog.round_trip(t + 1, now=float(t))
  assert dogs[0].lost(now=29.0) == dogs[1].lost(now=29.0) == []  # silent for 10 s: not yet
  assert dogs[0].lost(now=30.5) == dogs[1].lost(now=30.5) == [2]
  # The service (in process 0) stops answering: process 1 counts process 0 lost.
  store = _Store()
  dogs = [distributed.Watchdog(store, i, 2, timeout_s=10, now=0.0) for i in range(2)]
  for dog in dogs:
    assert dog.round_trip(1, now=1.0)
  store.down = True
  assert not dogs[1].round_trip(2, now=2.0)
  assert dogs[1].lost(now=11.0) == []
  assert dogs[1].lost(now=11.5) == [0]


@pytest.mark.parametrize("value", [0, -1, 1.5, float("nan"), float("inf"), True, "10", None])
def test_timeouts_are_positive_whole_seconds(value):
  with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive whole number "
                                       "of seconds"):
    distributed.initialize(heartbeat_timeout_s=value)
  with pytest.raises(ValueError, match="shutdown_timeout_s"):
    distributed.initialize(shutdown_timeout_s=value)


def test_timeout_flags():
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  fv(["prog"])
  assert (fv.heartbeat_timeout_s, fv.shutdown_timeout_s) == (
      distributed.DEFAULT_HEARTBEAT_TIMEOUT_S, distributed.DEFAULT_SHUTDOWN_TIMEOUT_S) == (10, 300)
  assert distributed.check_timeout("x", 10.0) == 10
  # JAX's own heartbeat timeout (which aborts the survivors) comes well after ours.
  assert distributed.jax_heartbeat_timeout(10) == 30
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  fv(["prog", "--heartbeat_timeout_s=0"])
  with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive whole number"):
    distributed.initialize_from_flags(fv)
