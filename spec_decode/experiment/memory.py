"""Per-device memory plan of a sharded decode, without allocating anything.

  python -m spec_decode.cli.memory --target=t5_1_1_xxl --draft=t5_1_1_small \\
      --mesh=data=1,model=8 --batch=1 --input_len=512 --output_len=256 --gamma=7 \\
      --dtype=bfloat16

What is computed how (all per device):
  * params, caches: exact and analytic, in --dtype at full depth: the
    abstract parameter tree (`model.param_shapes()`) and decode cache
    (`jax.eval_shape` of encode + init_cache) under the shardings the decoders
    use; bytes of the largest shard (`partitioning.shard_bytes`).
  * working memory: everything else live at the program's peak (activations,
    logits and probabilities, loop state, copies XLA makes of cache buffers).
    It comes from `jax.jit(...).lower(ShapeDtypeStructs).compile()
    .memory_analysis()` of the whole jitted decode, the same function and
    layouts `decoding.speculative(mesh=...)` runs: peak = arguments + temp +
    outputs - aliased, minus that program's own params, inputs and caches.
    The program is compiled in --compile_dtype, float32 by default, because
    XLA:CPU computes bfloat16 matmuls in float32 and keeps float32 copies of
    the weights as temporaries, which no TPU or GPU does. In float32 every
    activation is twice its bfloat16 size (logits and probabilities are
    float32 either way), so the working memory is an upper bound for bfloat16.
  * depth: by default the program has the models' full depth (slow to compile for
    XXL + small). --depth=N compiles N layers per stack instead (fast, for CI):
    params and caches stay exact, but the working memory is then that of the
    shallower program, which underestimates it: buffer reuse across the unrolled
    layers is not linear in depth (XXL + small, batch 32, model=8: 0.76 GiB at
    depth 1, 2.12 GiB at full depth; see experiments/results/memory_xxl.md).
  * Meshes are simulated on CPU devices (--xla_force_host_platform_device_count,
    set by re-executing the command when too few devices are visible), so the
    working memory is XLA:CPU's buffer assignment, an estimate for TPU/GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_decode import decoding, partitioning
from spec_decode.decoding.sampling import Sampling
from spec_decode.models import t5

GiB = 1024 ** 3
# Assumed memory per device (one TPU chip or one GPU), bytes.
DEVICE_BYTES = {"TPU v5e (16 GiB)": 16 * GiB, "TPU v4 (32 GiB)": 32 * GiB,
                "A100 (40 GB)": 40e9, "A100 (80 GB)": 80e9, "H100 (80 GB)": 80e9,
                "TPU v5p (95 GiB)": 95 * GiB}


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """memory_analysis() of one compiled program, bytes per device."""
  argument: int
  output: int
  alias: int
  temp: int

  @classmethod
  def of(cls, compiled) -> "ProgramMemory":
    m = compiled.memory_analysis()
    return cls(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
               alias=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes))

  @property
  def peak(self) -> int:
    """Upper bound of live bytes: temp is XLA's arena, already sized by live ranges."""
    return self.argument + self.temp + self.output - self.alias


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  """Per-device bytes of one decode configuration (see the module docstring)."""
  target: str
  draft: str | None
  mesh: dict[str, int]
  batch: int
  input_len: int
  output_len: int
  gamma: int
  dtype: str
  target_params: int        # per device, exact
  draft_params: int
  target_params_total: int  # whole model
  draft_params_total: int
  target_cache: int         # per device, exact
  draft_cache: int
  inputs: int               # encoder tokens, rng, row ids (per device)
  working: int              # measured: peak - params - caches - inputs of the compiled program
  program: ProgramMemory    # raw numbers of the compiled program
  compile_dtype: str
  compiled_depth: int | None  # None: full depth

  @property
  def params(self) -> int:
    return self.target_params + self.draft_params

  @property
  def caches(self) -> int:
    return self.target_cache + self.draft_cache

  @property
  def peak(self) -> int:
    """Estimated peak bytes per device: exact params and caches plus working memory."""
    return self.params + self.caches + self.inputs + self.working

  @property
  def peak_low(self) -> int:
    """`peak` with the working memory scaled from compile_dtype to dtype (e.g. halved
    for a float32 compile of a bfloat16 plan): a lower bound, as buffers that stay
    float32 (logits, probabilities) do not shrink."""
    ratio = min(1.0, jnp.dtype(self.dtype).itemsize / jnp.dtype(self.compile_dtype).itemsize)
    return self.params + self.caches + self.inputs + int(self.working * ratio)

  def fits(self, device_bytes: float) -> str:
    """'yes' (peak fits), 'maybe' (only peak_low fits) or 'no'."""
    if self.peak <= device_bytes:
      return "yes"
    return "maybe" if self.peak_low <= device_bytes else "no"

  @classmethod
  def from_dict(cls, d: dict) -> "MemoryPlan":
    """Inverse of `dataclasses.asdict` (derived keys such as 'peak' are ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    d = {k: v for k, v in d.items() if k in names}
    return cls(**dict(d, program=ProgramMemory(**d["program"])))


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _tree_bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _decode_args(target, draft, mesh, *, batch, input_len, rules, draft_rules):
  """(abstract positional args, their shardings, the batch sharding) of the decode impls."""
  tokens = jax.ShapeDtypeStruct((batch, input_len), jnp.int32)
  bsh = partitioning.batch_sharding(mesh, tokens.shape, rules)
  arrays = [target.param_shapes()]
  shardings = [partitioning.param_shardings(target, mesh, rules)]
  if draft is not None:
    arrays.append(draft.param_shapes())
    shardings.append(partitioning.param_shardings(draft, mesh, draft_rules))
  n_tokens = 1 if draft is None else 2  # the draft gets its own encoder tokens
  arrays += [tokens] * n_tokens + [jax.eval_shape(lambda: jax.random.PRNGKey(0)),
                                   jax.ShapeDtypeStruct((batch,), jnp.int32)]
  shardings += [bsh] * n_tokens + [partitioning.replicated(mesh), bsh]
  return [_abstract(a, s) for a, s in zip(arrays, shardings)], shardings, bsh


def _compile(target, draft, mesh, *, batch, input_len, output_len, gamma, rules, draft_rules,
             sampling) -> ProgramMemory:
  """Compiles the sharded decode (the runner's, for `Speculative(gamma)` or, when draft is
  None, `Autoregressive()`: the program `decoding.run` executes) on abstract inputs."""
  args, shardings, bsh = _decode_args(target, draft, mesh, batch=batch, input_len=input_len,
                                      rules=rules, draft_rules=draft_rules)
  algorithm = decoding.Autoregressive() if draft is None else decoding.Speculative(gamma=gamma)
  jitted, _ = decoding.runner.sharded(algorithm, target, draft, mesh,
                                      batch_shape=(batch, input_len), max_decode_len=output_len,
                                      sampling=sampling, rules=rules, draft_rules=draft_rules)
  if draft is None:  # the runner's draft arguments are None without a draft
    args = args[:1] + [None] + args[1:2] + [None] + args[2:]
  return ProgramMemory.of(jitted.lower(*args).compile())


def cache_bytes(model, mesh, *, batch: int, input_len: int, length: int,
                rules: partitioning.Rules) -> int:
  """Per-device bytes of `model`'s decode cache (abstract; nothing is allocated)."""
  def build(params, tokens):
    return model.init_cache(params, model.encode(params, tokens), length)
  shapes = jax.eval_shape(build, model.param_shapes(),
                          jax.ShapeDtypeStruct((batch, input_len), jnp.int32))
  shardings = partitioning.tree_shardings(partitioning.cache_axes(shapes), shapes, mesh, rules,
                                          partitioning.model_units(model))
  return partitioning.shard_bytes(shapes, shardings)


def _static_bytes(target, draft, mesh, *, batch, input_len, room, rules, draft_rules):
  """Per-device (target params, draft params, target cache, draft cache, inputs)."""
  args, shardings, _ = _decode_args(target, draft, mesh, batch=batch, input_len=input_len,
                                    rules=rules, draft_rules=draft_rules)
  per_arg = [partitioning.shard_bytes(a, s) for a, s in zip(args, shardings)]
  n_params = 1 if draft is None else 2
  t_cache = cache_bytes(target, mesh, batch=batch, input_len=input_len, length=room,
                        rules=rules)
  d_cache = 0 if draft is None else cache_bytes(draft, mesh, batch=batch, input_len=input_len,
                                                length=room, rules=draft_rules)
  return (per_arg[0], 0 if draft is None else per_arg[1], t_cache, d_cache,
          sum(per_arg[n_params:]))


def plan(target_config: t5.T5Config, draft_config: t5.T5Config | None, mesh, *, batch: int,
         input_len: int, output_len: int, gamma: int = 7, rules=None, draft_rules=None,
         sampling: Sampling = Sampling(), depth: int | None = None,
         compile_dtype=jnp.float32, names: tuple[str, str | None] = ("target", "draft")
         ) -> MemoryPlan:
  """Per-device memory of decoding with `target_config` (and `draft_config`) on `mesh`.

  draft_config None plans the autoregressive baseline. depth: layers per
  stack of the compiled program (None: the models' own). See the module docstring.
  """
  for name, v in (("batch", batch), ("input_len", input_len), ("output_len", output_len),
                  ("gamma", gamma)):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  if depth is not None and (not isinstance(depth, int) or depth < 1):
    raise ValueError(f"depth must be None or a positive int, got {depth!r}")
  rules = partitioning.standard_logical_axis_rules() if rules is None else \
      partitioning.validate_rules(rules)
  draft_rules = partitioning.data_parallel_rules(rules) if draft_rules is None else \
      partitioning.validate_rules(draft_rules)
  room = output_len if draft_config is None else output_len + gamma + 1
  common = dict(batch=batch, input_len=input_len, room=room, rules=rules,
                draft_rules=draft_rules)
  models = lambda tc, dc: (t5.T5(tc), None if dc is None else t5.T5(dc))

  target, draft = models(target_config, draft_config)
  tp, dp, tc, dc, inputs = _static_bytes(target, draft, mesh, **common)

  def compiled_config(c):
    c = c.replace(dtype=compile_dtype)
    return c if depth is None else c.replace(num_encoder_layers=depth, num_decoder_layers=depth)
  ctarget, cdraft = models(compiled_config(target_config),
                           None if draft_config is None else compiled_config(draft_config))
  program = _compile(ctarget, cdraft, mesh, batch=batch, input_len=input_len,
                     output_len=output_len, gamma=gamma, rules=rules, draft_rules=draft_rules,
                     sampling=sampling)
  persistent = sum(_static_bytes(ctarget, cdraft, mesh, **common))
  return MemoryPlan(
      target=names[0], draft=names[1] if draft_config is not None else None,
      mesh=dict(mesh.shape), batch=batch, input_len=input_len, output_len=output_len,
      gamma=gamma, dtype=str(jnp.dtype(target_config.dtype)), target_params=tp,
      draft_params=dp, target_params_total=_tree_bytes(target.param_shapes()),
      draft_params_total=0 if draft is None else _tree_bytes(draft.param_shapes()),
      target_cache=tc, draft_cache=dc, inputs=inputs,
      working=max(program.peak - persistent, 0), program=program,
      compile_dtype=str(jnp.dtype(compile_dtype)), compiled_depth=depth)


# ------------------------------------------------------------------ report
def _gib(x: float) -> str:
  return f"{x / GiB:.2f}"


def format_table(plans: Sequence[MemoryPlan]) -> str:
  """A markdown table, one row per plan, GiB per device."""
  head = ("| mesh | batch | target params | draft params | target cache | draft cache "
          "| working | peak | peak low |\n|---|---|---|---|---|---|---|---|---|")
  rows = []
  for p in plans:
    mesh = ",".join(f"{k}={v}" for k, v in p.mesh.items())
    rows.append(f"| {mesh} | {p.batch} | {_gib(p.target_params)} | {_gib(p.draft_params)} | "
                f"{_gib(p.target_cache)} | {_gib(p.draft_cache)} | {_gib(p.working)} | "
                f"{_gib(p.peak)} | {_gib(p.peak_low)} |")
  return "\n".join([head] + rows)


def format_fits(plans: Sequence[MemoryPlan], devices=None) -> str:
  """Which device kinds hold each plan (`MemoryPlan.fits`: yes / maybe / no)."""
  devices = DEVICE_BYTES if devices is None else devices
  head = "| mesh | devices | batch | " + " | ".join(devices) + " |\n|---|---|---|" + \
      "---|" * len(devices)
  rows = []
  for p in plans:
    mesh = ",".join(f"{k}={v}" for k, v in p.mesh.items())
    marks = " | ".join(p.fits(b) for b in devices.values())
    rows.append(f"| {mesh} | {int(np.prod(list(p.mesh.values())))} | {p.batch} | {marks} |")
  return "\n".join([head] + rows)


def describe(p: MemoryPlan) -> str:
  depth = "full depth" if p.compiled_depth is None else f"depth {p.compiled_depth} (reduced)"
  return (f"target {p.target} + draft {p.draft}, {p.dtype}, input {p.input_len}, output "
          f"{p.output_len}, gamma {p.gamma}; target params {p.target_params_total / 1e9:.2f} GB "
          f"total, draft {p.draft_params_total / 1e9:.3f} GB total; working memory compiled "
          f"in {p.compile_dtype} at {depth}; GiB per device")
