"""Memory before compile, compiled programs in bounds, non-finite logits counted.

A decode that cannot fit is refused before it is traced (`footprint.check_fits`, from the
models' configs alone), naming the estimate, the free memory and the largest batch and
gamma that fit; an experiment refuses gamma beyond max_decode_len; every new decode program
makes room among the process's memory maps (`footprint.before_compile`); target logits
holding NaN/Inf are counted per row (`nonfinite_calls`) and reported by the experiment's
summary. The command line turns XLA's and Python's out-of-memory errors into one line."""

import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from spec_decode import decoding, paths
from spec_decode.cli import errors as cli_errors
from spec_decode.decoding import footprint, runner
from spec_decode.experiment import status
from spec_decode.models import t5
from spec_decode.tree_util import flatten, unflatten

ROOT = paths.REPO_ROOT
V = 64


@pytest.fixture(scope="module")
def pair():
  target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=V))
  draft = t5.T5(t5.T5Config.preset("t5_tiny", vocab_size=V, num_encoder_layers=1,
                                   num_decoder_layers=1))
  return target, target.init(jax.random.PRNGKey(0)), draft, draft.init(jax.random.PRNGKey(1))


@pytest.fixture
def fresh(monkeypatch):
  """No decode program seen yet in this test (the check runs once per program)."""
  monkeypatch.setattr(footprint, "_SEEN", set())


def _tokens(batch, length=8, seed=0):
  return np.random.RandomState(seed).randint(2, V, (batch, length)).astype(np.int32)


def test_footprint_counts_caches_encoder_and_logits_and_grows_with_batch_and_gamma(pair):
  target, _, draft, _ = pair
  c = target.config
  one = footprint.decode_bytes(decoding.Autoregressive(), target, None, batch=1, input_len=8,
                               draft_input_len=None, max_decode_len=16)
  width = c.num_heads * c.head_dim
  assert one.caches == c.num_decoder_layers * 2 * (16 + 8) * width * 4
  assert one.logits == 2 * c.vocab_size * 4  # logits and probabilities of one position
  assert one.encoder > 8 * c.emb_dim * 4
  four = footprint.decode_bytes(decoding.Autoregressive(), target, None, batch=4, input_len=8,
                                draft_input_len=None, max_decode_len=16)
  assert four.total == 4 * one.total  # every part is per row
  spec = [footprint.decode_bytes(decoding.Speculative(gamma=g), target, draft, batch=1,
                                 input_len=8, draft_input_len=8, max_decode_len=16).total
          for g in (1, 4, 8)]
  assert spec[0] > one.total and spec[0] < spec[1] < spec[2]  # the draft's and gamma's share


def test_a_decode_that_cannot_fit_is_refused_with_the_largest_batch_and_gamma(pair):
  target, _, draft, _ = pair
  algo = decoding.Speculative(gamma=8)
  need = footprint.decode_bytes(algo, target, draft, batch=64, input_len=8, draft_input_len=8,
                                max_decode_len=16).total
  free = (need // 3, "test memory")
  with pytest.raises(footprint.DecodeMemoryError) as e:
    footprint.check_fits(algo, target, draft, batch=64, input_len=8, draft_input_len=8,
                         max_decode_len=16, devices=jax.devices()[:1], free=free)
  message = str(e.value)
  assert "batch 64 x 8 input tokens, max_decode_len 16, gamma 8 needs at least" in message
  assert "are free in test memory" in message
  rows = int(message.split("the largest batch that fits is ")[1].split(";")[0].split()[0])
  size = lambda b, g=8: footprint.decode_bytes(
      decoding.Speculative(gamma=g), target, draft, batch=b, input_len=8, draft_input_len=8,
      max_decode_len=16).total
  assert size(rows) <= free[0] < size(rows + 1)  # the largest, not just one that fits
  assert isinstance(e.value, ValueError)  # the command line's one-line known error
  # a smaller gamma does not fit at batch 64 either: none is offered; at batch 20 one is
  free = (size(20, 3), "test memory")
  with pytest.raises(footprint.DecodeMemoryError, match="at batch 20 the largest gamma that "
                                                        "fits is 3"):
    footprint.check_fits(algo, target, draft, batch=20, input_len=8, draft_input_len=8,
                         max_decode_len=16, devices=jax.devices()[:1], free=free)
  one_row = (size(1) - 1, "test memory")  # nothing fits at max_decode_len 16: a shorter one
  with pytest.raises(footprint.DecodeMemoryError, match="not even one row fits; at batch 1 "
                                                        "the largest max_decode_len that fits "
                                                        "is 1[0-5]"):
    footprint.check_fits(algo, target, draft, batch=20, input_len=8, draft_input_len=8,
                         max_decode_len=16, devices=jax.devices()[:1], free=one_row)
  fitting = footprint.check_fits(algo, target, draft, batch=1, input_len=8, draft_input_len=8,
                                 max_decode_len=16, devices=jax.devices()[:1], free=free)
  assert fitting.total == size(1)
  # a tree's size is its budget, not gamma: the message said only "gamma 4"
  tree = decoding.Speculative(gamma=4, drafter=decoding.TreeDrafter(budget=48),
                              verifier=decoding.TreeVerifier())
  with pytest.raises(footprint.DecodeMemoryError, match=r", gamma 4 \(TreeDrafter proposes up "
                                                        r"to 48 tokens per target call\) needs"):
    footprint.check_fits(tree, target, draft, batch=20, input_len=8, draft_input_len=8,
                         max_decode_len=16, devices=jax.devices()[:1], free=one_row)


def test_run_refuses_an_impossible_batch_before_compiling(pair, fresh, monkeypatch):
  target, tp, draft, dp = pair
  monkeypatch.setattr(footprint, "device_free_bytes", lambda devices: (1 << 16, "test memory"))
  compiled = []
  monkeypatch.setattr(runner, "_unsharded_jit", lambda options: compiled.append(options))
  with pytest.raises(footprint.DecodeMemoryError, match="needs at least .* but 64.0 KiB|"
                                                        "needs at least .* but 0.1 MiB"):
    decoding.run(decoding.Speculative(gamma=4), target, tp, _tokens(32), draft=draft,
                 draft_params=dp, max_decode_len=16)
  assert not compiled  # refused before anything was traced or compiled


def test_the_host_memory_read_is_the_tightest_limit():
  free = footprint.host_free_bytes()
  assert free is not None and free[0] > 0  # Linux: MemAvailable at least
  with open("/proc/meminfo") as f:
    available = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
  assert free[0] <= available * 1.05


def test_an_experiment_refuses_gamma_beyond_max_decode_len():
  """The library decodes it (exactly: the exactness oracles end sequences inside a block),
  an experiment refuses it: every extra drafted token is only cost."""
  from spec_decode.cli import gin as gin_layer
  with pytest.raises(ValueError, match=r"decoders\['speculative'\] has gamma 100000, larger "
                                       r"than the \d+ tokens decoded per example"):
    gin_layer.parse_experiment(["configs/toy_random.gin"], ["GAMMA = 100000"])


def test_a_new_program_first_makes_room_among_the_memory_maps(pair, fresh, monkeypatch):
  target, tp, _, _ = pair
  use = [(60000, 65530)]
  monkeypatch.setattr(footprint, "memory_map_use", lambda: use[0])
  cleared = []
  real_clear = jax.clear_caches

  def clear():
    cleared.append(1)
    use[0] = (1000, 65530)
    real_clear()

  monkeypatch.setattr(jax, "clear_caches", clear)
  decoding.run(decoding.Autoregressive(), target, tp, _tokens(2), max_decode_len=4)
  assert cleared == [1]
  use[0] = (60000, 65530)
  decoding.run(decoding.Autoregressive(), target, tp, _tokens(2), max_decode_len=4)
  assert cleared == [1]  # the same program: no check, no release
  # not even a release leaves room: a Python error, not a crash inside LLVM
  monkeypatch.setattr(jax, "clear_caches", lambda: None)
  use[0] = (63000, 65530)
  with pytest.raises(footprint.MemoryMapsExhausted, match="maps 63000 of the 65530 memory "
                                                          "regions.*vm.max_map_count"):
    decoding.run(decoding.Autoregressive(), target, tp, _tokens(2), max_decode_len=5)
  assert isinstance(footprint.MemoryMapsExhausted("x"), MemoryError)


def _nan_params(params):
  flat = {k: np.array(v) for k, v in flatten(params).items()}
  flat["decoder/logits_dense/kernel"][:, 3] = np.nan
  return unflatten(flat)


@pytest.mark.parametrize("algorithm", [decoding.Autoregressive(), decoding.Speculative(gamma=3)],
                         ids=["autoregressive", "speculative"])
def test_non_finite_target_logits_are_counted_per_row(pair, algorithm):
  target, tp, draft, dp = pair
  kw = dict(draft=draft, draft_params=dp) if algorithm.needs_draft else {}
  good = decoding.run(algorithm, target, tp, _tokens(3), max_decode_len=8, **kw)
  np.testing.assert_array_equal(good.stats.nonfinite_calls, 0)
  bad = decoding.run(algorithm, target, _nan_params(tp), _tokens(3), max_decode_len=8, **kw)
  calls = np.asarray(bad.stats.nonfinite_calls)
  np.testing.assert_array_equal(calls, np.asarray(bad.stats.target_calls))
  assert (calls > 0).all()


def test_the_summary_names_rows_with_non_finite_logits():
  rows = [{"decoders": {"baseline": {"stats": {"target_calls": 4, "nonfinite_calls": 4}},
                        "speculative": {"stats": {"target_calls": 2, "nonfinite_calls": 0}}}},
          {"decoders": {"baseline": {"stats": {"target_calls": 4, "nonfinite_calls": 1}},
                        "speculative": {"stats": {"target_calls": 2, "nonfinite_calls": 2}}}},
          {"decoders": {"baseline": {"stats": {"target_calls": 4}}}}]  # an older row
  assert status.nonfinite_rows(rows) == {"baseline": 2, "speculative": 1}
  assert status.nonfinite_rows(rows[2:]) == {}


def test_out_of_memory_is_one_line():
  assert cli_errors.out_of_memory(ValueError("x")) is None
  assert "lower the batch size" in cli_errors.out_of_memory(MemoryError("Unable to allocate"))
  script = textwrap.dedent("""
      import resource
      resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
      import jax, jax.numpy as jnp
      from spec_decode.cli import errors
      with errors.handle_errors("prog", verbose=False):
        jax.jit(lambda: jnp.ones((1 << 32,), jnp.float32))().block_until_ready()
  """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and lines[0].startswith("prog: error: out of memory: "
                                                 "RESOURCE_EXHAUSTED: Out of memory allocating "
                                                 "17179869184 bytes"), proc.stderr


def test_the_command_line_refuses_a_batch_too_large_before_compiling(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "spec_decode.main", "--gin_file=configs/toy_random.gin",
       "--gin.BATCH_SIZE=50000000", f"--output_dir={tmp_path / 'o'}", "--noprogress"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2, proc.stderr
  assert len(lines) == 1 and "DecodeMemoryError: a decode of batch " in lines[0], proc.stderr
  assert "the largest batch that fits is " in lines[0]


# A process with the memory map table nearly full, as after compiling ~80 decoding loops:
# LEFT regions remain. Distinct speculative loops (~700 regions each) then compile in turn.
_CROWDED = textwrap.dedent("""
    import mmap, sys
    import jax, numpy as np
    from spec_decode import decoding
    from spec_decode.decoding import footprint
    from spec_decode.models import t5
    left, loops = int(sys.argv[1]), int(sys.argv[2])
    target = t5.T5(t5.T5Config.preset("t5_1_1_tiny", vocab_size=64))
    draft = t5.T5(t5.T5Config.preset("t5_tiny", vocab_size=64, num_encoder_layers=1,
                                     num_decoder_layers=1))
    tp, dp = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
    tokens = np.random.RandomState(0).randint(2, 64, (2, 8)).astype(np.int32)
    decoding.run(decoding.Speculative(gamma=1), target, tp, tokens, draft=draft,
                 draft_params=dp, max_decode_len=12).tokens.block_until_ready()
    planted = []  # regions of alternating protection, so the kernel cannot merge them
    used, limit = footprint.memory_map_use()
    for i in range(limit - used - left):
      prot = mmap.PROT_READ if i % 2 else mmap.PROT_READ | mmap.PROT_WRITE
      planted.append(mmap.mmap(-1, mmap.PAGESIZE, prot=prot))
    print("planted", len(planted), footprint.memory_map_use(), flush=True)
    for g in range(1, loops + 1):
      try:
        out = decoding.run(decoding.Speculative(gamma=g), target, tp, tokens, draft=draft,
                           draft_params=dp, max_decode_len=12,
                           sampling=decoding.Sampling(temperature=1.0),
                           rng=jax.random.PRNGKey(g))
        out.tokens.block_until_ready()
      except footprint.MemoryMapsExhausted as e:
        print("refused", g, e, flush=True)
        sys.exit(3)
      print("loop", g, footprint.memory_map_use(), flush=True)
    print("all complete", flush=True)
""")


@pytest.mark.slow
def test_many_compiled_loops_never_crash_the_process():
  """With 6000 regions left, five distinct loops complete (~3500 regions without release:
  past the headroom by the third); with 1000 left, the next compile is refused with a Python
  error naming the limit. Without the release and the headroom check, XLA aborted this
  process within ten loops ('LLVM ERROR: Unable to allocate section memory')."""
  run = lambda left, loops: subprocess.run(
      [sys.executable, "-c", _CROWDED, str(left), str(loops)], cwd=ROOT, capture_output=True,
      text=True, timeout=400)
  proc = run(6000, 5)
  assert proc.returncode == 0 and "all complete" in proc.stdout, (proc.stdout, proc.stderr)
  proc = run(1000, 2)
  assert proc.returncode == 3, (proc.stdout, proc.stderr)
  assert "refused 1" in proc.stdout and "vm.max_map_count" in proc.stdout


_COMPILES = []  # backend compiles seen by the listener below (registered once per process)


def _count_compiles(name, *_, **__):
  if name == "/jax/core/compile/backend_compile_duration":
    _COMPILES.append(name)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def test_a_release_during_warm_up_is_followed_by_a_second_warm_up(fresh, monkeypatch, tmp_path):
  """An experiment compiles each decoder before its timed batches; when the process drops
  its compiled programs while a later decoder compiles (`before_compile` finding the memory
  maps crowded), the decoders compiled before are compiled again, untimed: no timed batch
  includes a compile."""
  from spec_decode import experiment
  from spec_decode.cli import gin as gin_layer
  from spec_decode.decoding import timing
  from spec_decode.experiment import run as run_module
  config = gin_layer.parse_experiment(["configs/toy_random.gin"], [
      "NUM_EXAMPLES = 4", "BATCH_SIZE = 4", "ExperimentConfig.step_timing_repeats = 1"])
  checks = []

  def use():  # crowded at the second new program's check: the baseline's is dropped then
    checks.append(1)
    return (60000, 65530) if len(checks) == 2 else (1000, 65530)

  monkeypatch.setattr(footprint, "memory_map_use", use)
  monkeypatch.setattr(footprint, "release_executables_if_crowded", lambda *a, **k: False)
  timed_compiles, measuring = [], []
  real_timed, real_measure = timing.timed_in_turns, run_module.measure.measure_step_times

  def timed(calls, repeats):  # a timed batch: every decoder's calls on it
    before = len(_COMPILES)
    out = real_timed(calls, repeats)
    if not measuring:
      timed_compiles.append(len(_COMPILES) - before)
    return out

  def measure_step_times(*a, **k):  # the step costs after the batches compile their own
    measuring.append(1)
    return real_measure(*a, **k)

  monkeypatch.setattr(timing, "timed_in_turns", timed)
  monkeypatch.setattr(run_module.measure, "measure_step_times", measure_step_times)
  released = footprint.releases()
  experiment.run_experiment(config, output_dir=str(tmp_path / "run"), show_progress=False)
  assert footprint.releases() == released + 1
  assert timed_compiles and all(n == 0 for n in timed_compiles), timed_compiles
