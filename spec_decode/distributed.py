"""Several hosts (processes) as one JAX program: flags, start-up, per-host inputs, gathering.

JAX is the distributed engine: `jax.distributed.initialize` joins the
processes (on CPU with gloo collectives), after which `jax.devices()` lists
every process's devices, a mesh from `partitioning.make_mesh` spans them all,
and one jitted decode runs on it SPMD. Each process feeds only the input rows
that its own devices hold (`process_rows`, `global_batch`), and results come
back to every process, process 0 writing them (`gather`).

Typical use in an entry point:

  distributed.define_flags()          # before app.run; idempotent
  ...
  distributed.initialize_from_flags() # first thing in main(), before any JAX computation

A lost host (a process killed, preempted or cut off) ends every surviving
process within about --heartbeat_timeout_s (default 10 s) with one line on
stderr naming the lost process and exit code EXIT_HOST_LOST (75), never waiting
in a shutdown barrier for the dead peer. The survivors learn of it either from a
failed collective (gloo: "Connection reset by peer"; the CLI catches it:
`peer_lost`, `exit_host_lost`) or, when nothing fails (a host that went silent,
a process stopped), from a watchdog that every process runs over the coordination
service's key-value store (`Watchdog`). The CLI's line also says how many
examples are saved and that the same command, rerun on every host, resumes.
Without this, JAX waits for its own heartbeat timeout (100 s by default) and
then aborts every survivor with a C++ check failure. When process 0 (which hosts
JAX's coordination service) is the one lost, the others' JAX clients abort at
once from C++; a SIGABRT handler (`_arm_coordinator_abort`) then prints the same
line after JAX's message and exits EXIT_HOST_LOST. Whichever path ends the process
first silences stderr for every other thread before it writes the line, so the line
is the last thing there (JAX's threads keep logging while the process ends).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from absl import flags
from jax.experimental import multihost_utils

from spec_decode import native, partitioning


# The exit code of a process that ends because another process of its run was lost
# (sysexits.h's EX_TEMPFAIL: a temporary failure, the same command may be retried).
EXIT_HOST_LOST = 75
# A process silent for this long counts as lost and every other process ends (with JAX's
# own heartbeats alone: 100 s, and then the survivors abort).
DEFAULT_HEARTBEAT_TIMEOUT_S = 10
# How long a finished process waits at exit for the others to finish too (process 0
# writes the summaries after the last batch while the others wait): JAX's default.
DEFAULT_SHUTDOWN_TIMEOUT_S = 300


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """Defines --coordinator_address, --num_processes, --process_id, --heartbeat_timeout_s,
  --shutdown_timeout_s (once)."""
  if "coordinator_address" in flag_values:
    return
  flags.DEFINE_string("coordinator_address", None,
                      "host:port of process 0's coordinator for multi-host runs; "
                      "unset for a single process.", flag_values=flag_values)
  flags.DEFINE_integer("num_processes", 1, "Number of processes (hosts) in the run.",
                       flag_values=flag_values)
  flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).",
                       flag_values=flag_values)
  flags.DEFINE_integer("heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S,
                       "Multi-process runs: seconds without a heartbeat after which a process "
                       "counts as lost and every other process ends (exit code "
                       f"{EXIT_HOST_LOST}); the same on every process.",
                       flag_values=flag_values)
  flags.DEFINE_integer("shutdown_timeout_s", DEFAULT_SHUTDOWN_TIMEOUT_S,
                       "Multi-process runs: seconds a finished process waits at exit for the "
                       "others to finish.", flag_values=flag_values)


def check_timeout(name: str, value: Any) -> int:
  """`value` as a positive whole number of seconds; ValueError naming `name` otherwise.

  The distributed runtime counts its timeouts in whole seconds.
  """
  ok = (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))) or (
      isinstance(value, (float, np.floating)) and np.isfinite(value) and float(value).is_integer())
  if not ok or value < 1:
    raise ValueError(f"{name} must be a positive whole number of seconds, got {value!r}")
  return int(value)


def initialize(coordinator_address: str | None = None, num_processes: int = 1,
               process_id: int = 0, *, cpu_collectives: str | None = "gloo",
               initialization_timeout: int = 300,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
  """Joins the processes of a multi-host run; returns whether there are several.

  Must run before any other JAX call in the process. A single process
  (num_processes 1, no coordinator) needs nothing and returns False.
  cpu_collectives: implementation of cross-process collectives on the CPU
  backend ('gloo'); it does not affect TPU or GPU collectives.
  heartbeat_timeout_s: a process silent this long counts as lost and every other
  process ends with one line and EXIT_HOST_LOST (`on_host_lost` sets the line;
  `Watchdog` watches, JAX's own heartbeat timeout is set later as a backstop:
  `jax_heartbeat_timeout`). shutdown_timeout_s: how long a finished process waits
  at exit for the others. Both positive whole seconds (ValueError otherwise).
  """
  heartbeat_timeout_s = check_timeout("heartbeat_timeout_s", heartbeat_timeout_s)
  shutdown_timeout_s = check_timeout("shutdown_timeout_s", shutdown_timeout_s)
  if num_processes == 1 and coordinator_address is None:
    return False
  if not coordinator_address:
    raise ValueError("a multi-process run needs --coordinator_address host:port")
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  _run.update(process_id=process_id, num_processes=num_processes)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=initialization_timeout,
                             heartbeat_timeout_seconds=jax_heartbeat_timeout(heartbeat_timeout_s),
                             shutdown_timeout_seconds=shutdown_timeout_s)
  _start_watchdog(heartbeat_timeout_s)
  if process_id != 0:
    _arm_coordinator_abort(coordinator_address)
  return True


def initialize_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> bool:
  """`initialize` with the values of the flags from `define_flags`."""
  return initialize(flag_values.coordinator_address, flag_values.num_processes,
                    flag_values.process_id,
                    heartbeat_timeout_s=flag_values.heartbeat_timeout_s,
                    shutdown_timeout_s=flag_values.shutdown_timeout_s)


# ------------------------------------------------------------------ a lost host
# This process's place in the run (set by `initialize`) and the line a lost host ends with.
_run: dict[str, int] = {"process_id": 0, "num_processes": 1}
_host_lost_line: list[Callable[[list[int] | None], str]] = []
_exiting = threading.Lock()

# What a runtime error says when a peer process is gone: gloo's socket errors in a
# collective, the coordination service's verdict on a silent process, a failed barrier.
_PEER_LOST = re.compile(
    r"connection reset by peer|connection closed by peer|broken pipe|connection refused"
    r"|socket closed|heartbeat timeout|stopped sending heartbeats|tasks are unhealthy"
    r"|task is set to error|barrier has failed|has failed, got preempted|remote task has failed"
    r"|gloo .*failed.*(?:timed? ?out|connection|read error|write error|pair)",
    re.IGNORECASE)
# Where such a text names processes: "Task 1 heartbeat timeout", "/job:jax_worker/task:1",
# and the service's list after "stopped sending heartbeats):".
_TASK = re.compile(r"\btask[: ]\s*(\d+)\b", re.IGNORECASE)
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*((?:\d+[\s,]*)+)", re.IGNORECASE)
# The coordination service (on process 0) itself is unreachable.
_COORDINATOR_GONE = re.compile(
    r"(?:coordination service|coordinator).*(?:unavailable|socket closed|failed to connect"
    r"|connection refused|connection reset)|(?:unavailable|socket closed|failed to connect"
    r"|connection refused).*(?:coordination service|coordinator|PollForError|Heartbeat)",
    re.IGNORECASE | re.DOTALL)


def peer_lost_text(error: BaseException) -> str | None:
  """The text of the JAX runtime error in `error`'s chain (itself, its cause or context)
  that says another process of the run is gone, or None.

  Only JAX's runtime errors count (`JaxRuntimeError`, formerly `XlaRuntimeError`): the
  same words in, say, an OSError from a network file system are not a lost peer.
  """
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
      text = str(error)
      if _PEER_LOST.search(text):
        return text
    error = error.__cause__ or error.__context__
  return None


def lost_processes(text: str, process_id: int | None = None,
                   num_processes: int | None = None) -> list[int]:
  """The processes that `text` (a runtime error or coordination-service status) says
  are lost, other than `process_id` (default: this process's, from `initialize`).

  Named processes come first ("Task 1 heartbeat timeout", "task:1", the service's
  list of unhealthy tasks); an unreachable coordination service means process 0;
  failing those, with two processes it can only be the other one. [] if unknown.
  """
  me = _run["process_id"] if process_id is None else process_id
  n = _run["num_processes"] if num_processes is None else num_processes
  named = [int(m) for m in _TASK.findall(text)]
  for listed in _UNHEALTHY.findall(text):
    named += [int(x) for x in re.findall(r"\d+", listed)]
  lost = sorted({t for t in named if t != me and 0 <= t < n})
  if not lost and me != 0 and _COORDINATOR_GONE.search(text):
    lost = [0]
  if not lost and n == 2:
    lost = [1 - me]
  return lost


def peer_lost(error: BaseException) -> list[int] | None:
  """None unless `error` says another process of this run is gone (`peer_lost_text`);
  then the lost processes it names (`lost_processes`; [] when it cannot be known)."""
  if _run["num_processes"] < 2:
    return None
  text = peer_lost_text(error)
  return None if text is None else lost_processes(text)


def describe_lost(lost: list[int] | None) -> str:
  """'process 1 was lost', 'processes 1, 2 were lost' or 'another process was lost'."""
  if not lost:
    return "another process was lost"
  return (f"process {lost[0]} was lost" if len(lost) == 1 else
          "processes " + ", ".join(str(p) for p in lost) + " were lost")


def on_host_lost(line: Callable[[list[int] | None], str] | None,
                 coordinator_lost: tuple[str, str, str] | None = None) -> None:
  """Sets the line this process ends with when its watchdog finds a process lost
  (`line(lost)`, lost as in `peer_lost`; then `exit_host_lost`); None restores the
  plain default. The CLI names the saved examples and the resume command here.

  coordinator_lost: the line for process 0's loss as JAX's abort finds it (see
  `_arm_coordinator_abort`), as (head, path, tail): head, the number of lines of the
  file at path counted at that moment, tail; path '' for no count. Default: `line([0])`
  as it reads now.
  """
  _host_lost_line[:] = [line] if line is not None else []
  _set_abort_line(coordinator_lost)


def exit_host_lost(line: str, error: BaseException | None = None) -> None:
  """Ends this process now: `line` on stderr, the last thing there, exit code
  EXIT_HOST_LOST.

  os._exit, so neither JAX's exit handler (a shutdown barrier that would wait for the
  dead peer, then abort) nor anything else runs; stdout and stderr are flushed first
  (the predictions are written and fsync'ed batch by batch as they go). `error`'s
  traceback is printed first when given (the CLI's --verbose). Before the line,
  file descriptor 2 is pointed at /dev/null: JAX's threads keep logging while the
  process ends (its client's abort message when process 0 is gone), and what they
  write after the line would bury it. Safe to call from any thread; the first
  caller's line is the one printed.
  """
  _exiting.acquire()  # a second caller (the other path to the same loss) waits for the exit
  try:
    # JAX's client may abort from C++ while this process exits (process 0 gone): the
    # abort handler then ends it with this same line.
    _quietly(lambda: _abort_decided(line))
    _quietly(sys.stdout.flush)
    if error is not None:
      _quietly(lambda: traceback.print_exception(error, file=sys.stderr))
    _quietly(sys.stderr.flush)
    if _abort.get("armed"):  # the handler and this exit must not both write
      _quietly(lambda: _abort["lib"].spec_decode_abort_end(
          line.rstrip("\n").encode("utf-8", "replace")))
    _quietly(lambda: _write_last(line.rstrip("\n") + "\n"))
  finally:
    os._exit(EXIT_HOST_LOST)


# After descriptor 2 points at /dev/null, a write another thread began before still goes to
# the real stderr; the line waits this long for such writes (host_abort.cc's Drain).
_DRAIN_SECONDS = 0.05


def _write_last(text: str) -> None:
  """Writes text to stderr's file descriptor after pointing descriptor 2 at /dev/null
  and letting writes already under way there finish."""
  real = os.dup(2)
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, 2)
  time.sleep(_DRAIN_SECONDS)
  data = text.encode("utf-8", "replace")
  while data:
    data = data[os.write(real, data):]


def _quietly(write: Callable[[], Any]) -> None:
  """write(), ignoring a closed stream: the exit matters more than the words."""
  try:
    write()
  except Exception:
    pass


def _default_line(lost: list[int] | None) -> str:
  return f"{describe_lost(lost)}; rerun the same command on every host to resume"


def _line_for(lost: list[int] | None) -> str:
  """The line `on_host_lost` set, for `lost` (the plain default if it fails)."""
  try:
    return (_host_lost_line[0] if _host_lost_line else _default_line)(lost)
  except Exception:  # the line is a courtesy: end anyway
    return _default_line(lost)


def _end_lost(lost: list[int]) -> None:
  """Ends this process on a loss the watchdog found, with the line `on_host_lost` set."""
  exit_host_lost(_line_for(lost))


def jax_heartbeat_timeout(heartbeat_timeout_s: int) -> int:
  """The heartbeat timeout handed to JAX's coordination service: a backstop well after
  ours (2 x + 10 s), since when JAX finds a process silent it aborts every other one."""
  return 2 * heartbeat_timeout_s + 10


class Watchdog:
  """Every process's liveness, as each process sees it, through the coordination
  service's key-value store.

  A beating thread writes this process's counter under KEY_PREFIX every
  timeout / 10 seconds and reads everyone's. A judging thread (which never waits
  on the network) ends the process (`_end_lost`) when a peer's counter has not
  moved for `timeout_s`, or when, on a process other than 0, no read has
  succeeded for `timeout_s` (the service lives in process 0: process 0 is gone
  or cut off).

  Why not JAX's own heartbeats: JAX declares a silent process dead only to abort
  every other process (a C++ check failure), and the client's error callback that
  would replace the abort cannot be set from Python in this jaxlib (passing one
  fails to convert its status argument and terminates the process). So JAX's
  heartbeat timeout is set later (`jax_heartbeat_timeout`) and this watchdog
  decides first. When process 0 (which hosts the service) dies, the other
  processes' JAX clients abort at once as its connection closes, unless a failed
  collective ends them first (the usual case mid-decode); `_arm_coordinator_abort`
  turns that abort into the run's line.
  """

  KEY_PREFIX = "spec_decode/alive/"

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
               now: float | None = None):
    self._client, self._me, self._timeout = client, process_id, float(timeout_s)
    self._interval = max(0.05, self._timeout / 10)
    self._stopped = threading.Event()
    self._lock = threading.Lock()
    self.threads: list[threading.Thread] = []
    now = time.monotonic() if now is None else now
    self._last_read = now  # the last successful round trip to the service
    self._peers = [p for p in range(num_processes) if p != process_id]
    self._counter: dict[int, str] = {}
    self._moved = {p: now for p in self._peers}  # when each peer's counter last moved

  def start(self) -> "Watchdog":
    for target, name in ((self._beat, "beat"), (self._judge, "judge")):
      self.threads.append(threading.Thread(target=target, name=f"spec_decode-watchdog-{name}",
                                           daemon=True))
      self.threads[-1].start()
    return self

  def stop(self) -> None:
    """No more judging; the beating thread ends after its round trip in flight."""
    self._stopped.set()

  def round_trip(self, count: int, now: float | None = None) -> bool:
    """Writes this process's counter `count`, reads everyone's; whether the service answered."""
    try:
      self._client.key_value_set(f"{self.KEY_PREFIX}{self._me}", str(count),
                                 allow_overwrite=True)
      entries = self._client.key_value_dir_get(self.KEY_PREFIX)
    except Exception:  # the service did not answer: the judge counts the silence
      return False
    now = time.monotonic() if now is None else now
    with self._lock:
      self._last_read = now
      for key, value in entries:
        tail = key.rsplit("/", 1)[-1]
        peer = int(tail) if tail.isdigit() else None
        if peer in self._moved and self._counter.get(peer) != value:
          self._counter[peer], self._moved[peer] = value, now
    return True

  def _beat(self) -> None:
    count = 0
    while not self._stopped.is_set():
      count += 1
      self.round_trip(count)
      self._stopped.wait(self._interval)

  def lost(self, now: float | None = None) -> list[int]:
    """The processes this one counts as lost now ([] while all are alive)."""
    now = time.monotonic() if now is None else now
    with self._lock:
      if self._me != 0 and now - self._last_read > self._timeout:
        return [0]  # the coordination service (process 0) is silent
      return [p for p in self._peers if now - self._moved[p] > self._timeout]

  def _judge(self) -> None:
    while not self._stopped.wait(self._interval):
      lost = self.lost()
      if lost and not self._stopped.is_set():
        _end_lost(lost)


_watchdog: list[Watchdog] = []


def _start_watchdog(timeout_s: int) -> None:
  """After `jax.distributed.initialize`: the watchdog, and an exit handler that runs
  JAX's shutdown barrier while it still watches (a peer lost while this process
  waits at exit ends it too), then stops it."""
  from jax._src import distributed as jax_distributed  # the client JAX's own helpers use
  client = jax_distributed.global_state.client
  if client is None:
    return
  _watchdog[:] = [Watchdog(client, _run["process_id"], _run["num_processes"],
                            timeout_s).start()]

  def shutdown_watched():
    try:
      jax.distributed.shutdown()
    finally:
      disarm_coordinator_abort()
      for w in _watchdog:
        w.stop()
        for t in w.threads:  # no round trip left in flight on the closed client
          t.join(timeout=5)

  atexit.register(shutdown_watched)  # runs before JAX's own exit handler (registered earlier)


# --------------------------------------------------- process 0 (the coordinator) lost
# Process 0 hosts JAX's coordination service. When it dies, the other processes' JAX
# clients abort at once from a C++ thread (LOG(FATAL), abort()), before the watchdog or a
# failed collective can say anything, and jaxlib takes no Python callback in place of the
# abort. A small SIGABRT handler (host_abort.cc, built at first use) looks at the abort:
# when the coordinator no longer accepts connections, it writes the run's line (the one
# `on_host_lost` sets, with the saved examples counted then) after JAX's message and exits
# EXIT_HOST_LOST; any other abort goes on unchanged. Without a C++ compiler the abort
# stays JAX's.
_ABORT_SOURCE = Path(__file__).with_name("host_abort.cc")
_ABORT_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")
# How long the handler waits for the coordinator to accept a connection before it counts
# it as gone (a host cut off, rather than a process killed, does not refuse).
COORDINATOR_PROBE_TIMEOUT_MS = 2000
_abort: dict[str, Any] = {}  # 'lib' once loaded; 'armed' while the handler is installed


def _abort_library():
  if "lib" not in _abort:
    lib = ctypes.CDLL(str(native.build(_ABORT_SOURCE, _ABORT_FLAGS)))
    lib.spec_decode_abort_arm.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_int]
    lib.spec_decode_abort_arm.restype = ctypes.c_int
    lib.spec_decode_abort_line.argtypes = [ctypes.c_char_p] * 3
    lib.spec_decode_abort_line.restype = None
    lib.spec_decode_abort_end.argtypes = [ctypes.c_char_p]
    lib.spec_decode_abort_end.restype = None
    for name in ("spec_decode_abort_disarm", "spec_decode_abort_decided"):
      getattr(lib, name).argtypes, getattr(lib, name).restype = [], None
    _abort["lib"] = lib
  return _abort["lib"]


def coordinator_ip_port(address: str) -> tuple[str, int]:
  """'host:port' or '[v6]:port' -> (an IP address of host, port); ValueError otherwise."""
  host, sep, port = address.rpartition(":")
  host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator address must be host:port, got {address!r}")
  try:
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
  except OSError as e:
    raise ValueError(f"coordinator host {host!r} does not resolve: {e}") from None
  return infos[0][4][0], int(port)


def _arm_coordinator_abort(coordinator_address: str,
                           timeout_ms: int = COORDINATOR_PROBE_TIMEOUT_MS) -> str | None:
  """Installs the SIGABRT handler for process 0's loss; None when armed, else why not
  (logged: the abort then stays JAX's)."""
  try:
    ip, port = coordinator_ip_port(coordinator_address)
    if _abort_library().spec_decode_abort_arm(ip.encode(), port, int(timeout_ms),
                                              EXIT_HOST_LOST) != 0:
      raise RuntimeError(f"cannot install a SIGABRT handler for {ip}:{port}")
  except Exception as e:  # no compiler, an odd address: JAX's abort, as before
    logging.info("spec_decode: losing process 0 will end in JAX's abort (%s)", e)
    return str(e)
  _abort["armed"] = True
  _set_abort_line(_abort.get("parts"))
  return None


def _set_abort_line(parts: tuple[str, str, str] | None) -> None:
  """Keeps `on_host_lost`'s coordinator_lost, and hands the handler its line when armed."""
  _abort["parts"] = parts
  if not _abort.get("armed"):
    return
  if parts is None:
    parts = (_line_for([0]), "", "")
  _abort["lib"].spec_decode_abort_line(*(p.encode("utf-8", "replace") for p in parts))


def _abort_decided(line: str) -> None:
  """An abort from now on ends the process with `line` (a loss is already known)."""
  if _abort.get("armed"):
    _abort["lib"].spec_decode_abort_line(line.rstrip("\n").encode("utf-8", "replace"), b"", b"")
    _abort["lib"].spec_decode_abort_decided()


def disarm_coordinator_abort() -> None:
  """Puts the previous SIGABRT action back (at exit: no coordinator to watch any more)."""
  if _abort.pop("armed", False):
    _abort["lib"].spec_decode_abort_disarm()


def process_rows(mesh, global_batch_size: int,
                 rules: partitioning.Rules | None = None) -> slice:
  """The contiguous rows of a global batch that this process's devices hold.

  With the batch replicated (it does not divide the `data` axis, or the mesh
  has none) that is every row. Raises if this process's rows are not one
  contiguous block (a mesh whose `data` axis interleaves hosts).
  """
  sharding = partitioning.batch_sharding(mesh, (global_batch_size,), rules)
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  rows = sorted({r for idx in index_map.values()
                 for r in range(*idx[0].indices(global_batch_size))})
  if not rows or rows != list(range(rows[0], rows[-1] + 1)):
    raise ValueError(f"process {jax.process_index()} holds non-contiguous rows {rows}")
  return slice(rows[0], rows[-1] + 1)


def global_batch(local_rows, mesh, global_batch_size: int,
                 rules: partitioning.Rules | None = None) -> jax.Array:
  """A global [B, ...] array from this process's rows (`process_rows`) of it.

  The result has the decoders' batch sharding, so they take it without moving data.
  """
  local_rows = np.asarray(local_rows)
  sharding = partitioning.batch_sharding(mesh, (global_batch_size,), rules)
  expected = process_rows(mesh, global_batch_size, rules)
  if local_rows.shape[0] != expected.stop - expected.start:
    raise ValueError(f"process {jax.process_index()} must feed rows {expected.start}:"
                     f"{expected.stop} ({expected.stop - expected.start} rows), "
                     f"got {local_rows.shape[0]}")
  return jax.make_array_from_process_local_data(
      sharding, local_rows, (global_batch_size,) + local_rows.shape[1:])


def gather(tree: Any) -> Any:
  """Every leaf of `tree` (global jax.Arrays) as a full numpy array on every process.

  A collective: all processes must call it. Process 0 then writes the results.
  """
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
