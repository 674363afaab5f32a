"""Memory a decode call needs, checked before it is compiled; compiled loops kept in bounds.

`check_fits` runs in `decoding.run` before a new program is traced. It adds up, from the
models' configs alone (no tracing, no allocation), the buffers a decode of this shape
cannot do without:

  caches     every decoder layer's self-attention keys and values at
             batch x cache room (max_decode_len + gamma + 1 for speculative loops) and
             cross-attention keys and values at batch x input length, for the target
             and the draft model;
  encoder    the encoder's output states, its largest MLP activation and one layer's
             attention scores (float32), per model;
  logits     the target's logits and probabilities over the vocabulary at every scored
             position (gamma + 1 per row), the draft's per-position distributions.

Parameters are not counted: they are already allocated when `run` is called, so they are
already missing from the free memory it compares with. The sum is a floor, not a peak:
XLA needs more (other activations, copies), so a run this check passes can still run
out of memory (the command line then reports XLA's error in one line), but a run it
refuses cannot fit. The refusal (`DecodeMemoryError`, a ValueError) names the estimate,
the free memory and where it was read, and the largest batch (and gamma) that would fit.

Free memory: on CPU the least of the kernel's MemAvailable, the cgroup's limit minus its
use, and the address-space limit (RLIMIT_AS) minus this process's mapped size; on
accelerators the device's bytes_limit minus bytes_in_use (`Device.memory_stats`),
the least over the devices in use; unknown (no check) where neither can be read.

`before_compile` also keeps a process under the kernel's limit on memory maps
(`release_executables_if_crowded`): XLA:CPU maps every compiled executable's code into
regions of its own, and a process that compiles ~80 decoding loops (a notebook sweeping
gamma and temperature) used to die inside LLVM.
"""

from __future__ import annotations

import dataclasses
import resource
from typing import Any, Callable

from absl import logging
import jax
import numpy as np

GiB = 1024 ** 3


class DecodeMemoryError(ValueError):
  """A decode that cannot fit in the memory of the devices it would run on."""


@dataclasses.dataclass(frozen=True)
class Footprint:
  """Bytes a decode call needs at least, by part (see the module doc)."""
  caches: int
  encoder: int
  logits: int

  @property
  def total(self) -> int:
    return self.caches + self.encoder + self.logits

  def describe(self) -> str:
    return (f"{_gib(self.total)} (caches {_gib(self.caches)}, encoder {_gib(self.encoder)}, "
            f"logits {_gib(self.logits)})")


def _gib(n: float) -> str:
  return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 2**20:.1f} MiB"


def _config(model):
  """The T5-style config of `model` (layers, heads, widths), or None for models without
  one (n-gram tables): those hold no cache and no encoder."""
  config = getattr(model, "config", None)
  needed = ("num_decoder_layers", "num_encoder_layers", "num_heads", "head_dim", "emb_dim",
            "mlp_dim", "vocab_size")
  return config if config is not None and all(hasattr(config, a) for a in needed) else None


def _itemsize(config) -> int:
  try:
    return int(np.dtype(getattr(config, "dtype", np.float32)).itemsize)
  except TypeError:
    return 4


def model_bytes(model, *, batch: int, input_len: int, cache_room: int,
                scored: int) -> Footprint:
  """The floor of one model's decode buffers (bytes): `cache_room` self-attention slots
  and `input_len` cross-attention positions per row, `scored` positions of logits per
  row per call."""
  c = _config(model)
  if c is None:
    return Footprint(0, 0, 0)
  b = _itemsize(c)
  width = c.num_heads * c.head_dim
  caches = c.num_decoder_layers * 2 * batch * (cache_room + input_len) * width * b
  mlp = len(getattr(c, "mlp_activations", ("gelu", "linear"))) * c.mlp_dim
  encoder = batch * input_len * (c.emb_dim * b + mlp * b + c.num_heads * input_len * 4)
  logits = 2 * batch * scored * c.vocab_size * 4  # logits and probabilities, float32
  return Footprint(caches, encoder, logits)


def decode_bytes(algorithm, target, draft, *, batch: int, input_len: int,
                 draft_input_len: int | None, max_decode_len: int) -> Footprint:
  """The floor of a decode call's buffers (bytes): the target's and the draft's."""
  room = algorithm.cache_room(max_decode_len)
  K = algorithm.max_proposal or 0
  parts = [model_bytes(target, batch=batch, input_len=input_len, cache_room=room,
                       scored=K + 1)]
  if draft is not None:
    parts.append(model_bytes(draft, batch=batch, input_len=draft_input_len or input_len,
                             cache_room=room, scored=K))
  return Footprint(*(sum(getattr(p, f.name) for p in parts)
                     for f in dataclasses.fields(Footprint)))


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None


def host_free_bytes() -> tuple[int, str] | None:
  """(bytes this process can still allocate on the host, what limits it), or None."""
  found = []
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          found.append((int(line.split()[1]) * 1024, "MemAvailable"))
          break
  except (OSError, ValueError, IndexError):
    pass
  limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
  if limit is not None and used is not None:
    found.append((max(0, limit - used), "the cgroup's memory.max"))
  soft, _ = resource.getrlimit(resource.RLIMIT_AS)
  if soft != resource.RLIM_INFINITY:
    mapped = 0
    try:
      with open("/proc/self/status") as f:
        for line in f:
          if line.startswith("VmSize:"):
            mapped = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
      pass
    found.append((max(0, soft - mapped), "the address-space limit (RLIMIT_AS)"))
  return min(found) if found else None


def device_free_bytes(devices) -> tuple[int, str] | None:
  """(the least free bytes over this process's `devices`, which device kind), or None when
  unknown (another host's devices report nothing here; each host checks its own)."""
  devices = [d for d in devices if d.process_index == jax.process_index()]
  if not devices:
    return None
  if all(d.platform == "cpu" for d in devices):
    free = host_free_bytes()
    return None if free is None else (free[0], f"host memory ({free[1]})")
  least = None
  for d in devices:
    try:
      stats = d.memory_stats() or {}
    except Exception:  # a backend without memory statistics
      return None
    if "bytes_limit" not in stats:
      return None
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    least = free if least is None else min(least, free)
  return least, f"{devices[0].device_kind} device memory (bytes_limit - bytes_in_use)"


def _largest(fits, start: int) -> int:
  """The largest n in [0, start) with fits(n) (fits monotone decreasing), by bisection."""
  lo, hi = 0, start
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def check_fits(algorithm, target, draft, *, batch: int, input_len: int,
               draft_input_len: int | None, max_decode_len: int, devices,
               free: tuple[int, str] | None = None) -> Footprint:
  """Raises DecodeMemoryError when a decode of this shape cannot fit (see the module
  doc); returns its footprint. `free` (bytes, source) overrides the measured free memory."""
  need = decode_bytes(algorithm, target, draft, batch=batch, input_len=input_len,
                      draft_input_len=draft_input_len, max_decode_len=max_decode_len)
  devices = list(devices)
  sharded_over = max(1, len(devices)) if devices and devices[0].platform != "cpu" else 1
  free = free if free is not None else device_free_bytes(devices)
  if free is None or need.total / sharded_over <= free[0]:
    return need
  budget = free[0] * sharded_over

  def fits(**change) -> bool:
    shape = dict(batch=batch, input_len=input_len, draft_input_len=draft_input_len,
                 max_decode_len=max_decode_len)
    alg = algorithm
    if "gamma" in change:
      alg = dataclasses.replace(algorithm, gamma=change.pop("gamma"))
    shape.update(change)
    return decode_bytes(alg, target, draft, **shape).total <= budget

  hints = []
  rows = _largest(lambda b: fits(batch=b), batch)
  if rows:
    hints.append(f"the largest batch that fits is {rows}")
  else:
    length = _largest(lambda n: n >= 1 and fits(batch=1, max_decode_len=n), max_decode_len)
    hints.append("not even one row fits" + (
        f"; at batch 1 the largest max_decode_len that fits is {length}" if length else ""))
  gamma = getattr(algorithm, "gamma", None)
  if isinstance(gamma, int) and gamma > 1 and dataclasses.is_dataclass(algorithm):
    g = _largest(lambda k: k >= 1 and fits(gamma=k), gamma)
    if g >= 1:
      hints.append(f"at batch {batch} the largest gamma that fits is {g}")
  where = f" over {sharded_over} devices" if sharded_over > 1 else ""
  # A tree or lookup drafter's proposal size is its own setting (a tree's budget), not gamma.
  size, drafter = getattr(algorithm, "max_proposal", None), getattr(algorithm, "drafter", None)
  drafts = (f" ({type(drafter).__name__} proposes up to {size} tokens per target call)"
            if gamma and isinstance(size, int) and size != gamma and drafter is not None else "")
  raise DecodeMemoryError(
      f"a decode of batch {batch} x {input_len} input tokens, max_decode_len {max_decode_len}"
      f"{f', gamma {gamma}' if gamma else ''}{drafts} needs at least {need.describe()}{where}, "
      f"but {_gib(free[0])} {'per device are' if sharded_over > 1 else 'are'} free in "
      f"{free[1]}; {'; '.join(hints)}")


# --- compiled programs ------------------------------------------------------------------

def memory_map_use() -> tuple[int, int] | None:
  """(memory regions this process maps, the kernel's limit), or None off Linux."""
  try:
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read().strip())
  except (OSError, ValueError):
    return None
  return used, limit


# When to drop the compiled programs: above this fraction of vm.max_map_count. A driver
# that times its decoders side by side must hold all their programs at once (measured, big
# EnDe pair: 0.9-1.1k regions per decoding loop and input length; 13 decoders x 3 lengths
# = ~39k, which at 0.5 (32.8k) were dropped and recompiled inside every timed call). Above
# 0.75 (49k of 65530) there is still room for a dozen such loops, and `before_compile`
# refuses to compile with fewer than MAP_HEADROOM regions left.
RELEASE_FRACTION = 0.75


def release_executables_if_crowded(fraction: float = RELEASE_FRACTION) -> bool:
  """Drops every compiled executable (`jax.clear_caches`) once the process maps more
  than `fraction` of the kernel's vm.max_map_count memory regions; True if it did.

  XLA:CPU maps each executable's code and data into regions of its own (measured
  here: ~6 for a small function, ~770 for a speculative decoding loop of the demo
  pair, a few hundred for an autoregressive one) and keeps them while the executable
  is cached. A process that holds about 80 decoding loops (a gamma x draft sweep)
  reaches the limit (65530 by default), and the next compilation fails inside XLA
  ("LLVM ERROR: Unable to allocate section memory", or a segmentation fault).
  Dropping the caches only costs recompiling what is used again.
  """
  return _release_if_crowded(memory_map_use(), fraction)


def _release_if_crowded(use: tuple[int, int] | None,
                        fraction: float = RELEASE_FRACTION) -> bool:
  """`release_executables_if_crowded` from a reading of `memory_map_use` already made."""
  if use is None or use[0] <= fraction * use[1]:
    return False
  global _RELEASES
  logging.info("releasing compiled executables: %d of %d memory maps in use", *use)
  jax.clear_caches()
  _SEEN.clear()
  _RELEASES += 1
  return True


_RELEASES = 0


def releases() -> int:
  """How many times this process has dropped its compiled executables
  (`release_executables_if_crowded`, `before_compile`): a caller that compiled several
  programs in a row (a warm-up) compares it before and after to learn whether the first
  ones were dropped again while the later ones compiled."""
  return _RELEASES


def warm_again_if_released(released: int, warm_up: Callable[[], Any]) -> None:
  """After a warm-up that compiled several programs, begun at `releases()` == `released`:
  when the process dropped its compiled programs meanwhile (the first ones among them,
  as a later one compiled), runs `warm_up()` once more so that no timed call compiles."""
  if releases() != released:
    warm_up()


class MemoryMapsExhausted(MemoryError):
  """Too few memory regions left to compile another program safely (see `before_compile`)."""


# Memory regions a new decoding loop may need: ~770 for the demo pair's speculative loop;
# deeper models unroll more layers, so keep several times that free.
MAP_HEADROOM = 4096

_SEEN: set[Any] = set()  # decode programs `before_compile` has checked in this process


def before_compile(key, check) -> None:
  """Once per distinct decode program `key` (hashable; what selects a compiled program):
  makes room among the memory maps (`release_executables_if_crowded`), refuses to compile
  when even then fewer than MAP_HEADROOM regions are left (`MemoryMapsExhausted`: XLA
  would abort the process, not raise), and runs `check()` (which raises to refuse). Later
  calls with a key already seen cost one set lookup."""
  if key in _SEEN:
    return
  use = memory_map_use()  # one read of the map table (~60k lines when crowded) unless released
  if _release_if_crowded(use):
    use = memory_map_use()
  if use is not None and use[1] - use[0] < MAP_HEADROOM:
    raise MemoryMapsExhausted(
        f"this process maps {use[0]} of the {use[1]} memory regions Linux allows it "
        f"(vm.max_map_count), even after dropping its compiled programs; compiling another "
        f"decoding loop (hundreds of regions) would crash XLA; free what holds the regions, "
        f"or raise the limit: sysctl -w vm.max_map_count={2 * use[1]}")
  check()
  _SEEN.add(key)

