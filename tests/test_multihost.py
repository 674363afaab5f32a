"""Two local processes (gloo CPU collectives over 127.0.0.1) decode like one process.

Each of two worker processes simulates 4 CPU devices; together they form a
data=2,model=4 mesh, feed their own halves of the batch and gather the tokens
on process 0. A third, single process with 8 devices decodes the same inputs
unsharded. All run `multihost_worker.py` with the same XLA flags, the suite's cheap-compile
ones (`xla_flags.py`), because XLA:CPU compile time dominates this test.
"""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import multihost_worker as worker
import xla_flags

_TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(out, *, devices: int, args: list[str]) -> subprocess.Popen:
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags.flags(devices),
             PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
  return subprocess.Popen([sys.executable, worker.__file__, f"--out={out}", *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen]) -> None:
  """Waits (bounded) for all; kills leftovers; fails with the log of a failed one."""
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=_TIMEOUT_S)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, f"worker exited with {p.returncode}:\n{log[-3000:]}"


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  port = _free_port()
  multi, single = tmp_path / "two.npz", tmp_path / "one.npz"
  procs = [_start(multi, devices=4, args=[
      f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
      "--mesh=data=2,model=4"]) for i in range(2)]
  procs.append(_start(single, devices=8, args=["--mesh=none"]))
  _finish(procs)
  got, ref = np.load(multi), np.load(single)
  assert int(got["process_count"]) == 2 and int(got["device_count"]) == 8
  assert int(ref["process_count"]) == 1
  # data=2 puts process 0's four devices on rows 0..1: it fed only those rows.
  np.testing.assert_array_equal(got["rows_0"], [0, worker.BATCH // 2])
  for name in worker.SAMPLINGS:
    for field in ("tokens", "lengths", "accepted"):
      np.testing.assert_array_equal(got[f"{name}_{field}"], ref[f"{name}_{field}"])
  # The decodes are not degenerate: rows run past one token, some drafts are accepted.
  assert np.all(ref["greedy_lengths"] > 1) and np.any(ref["sampled_lengths"] > 1)
  assert np.sum(ref["greedy_accepted"]) > 0


def test_single_process_helpers():
  """In one process: no-op initialize, argument checks, and row feeding."""
  from absl import flags
  from spec_decode import distributed, partitioning

  assert distributed.initialize() is False
  with pytest.raises(ValueError, match="coordinator_address"):
    distributed.initialize(num_processes=2, process_id=0)
  with pytest.raises(ValueError, match="process_id"):
    distributed.initialize("127.0.0.1:1", num_processes=2, process_id=2)
  fv = flags.FlagValues()
  distributed.define_flags(fv)
  distributed.define_flags(fv)  # idempotent
  fv(["prog", "--num_processes=3", "--process_id=1", "--coordinator_address=127.0.0.1:9"])
  assert (fv.num_processes, fv.process_id) == (3, 1)
  mesh = partitioning.make_mesh("data=2,model=4")
  assert distributed.process_rows(mesh, 6) == slice(0, 6)  # one process holds every row
  rows = np.arange(12).reshape(6, 2)
  arr = distributed.global_batch(rows, mesh, 6)
  assert arr.sharding.spec == partitioning.batch_sharding(mesh, (6,)).spec
  np.testing.assert_array_equal(distributed.gather({"x": arr})["x"], rows)
  with pytest.raises(ValueError, match="rows"):
    distributed.global_batch(rows[:3], mesh, 6)
