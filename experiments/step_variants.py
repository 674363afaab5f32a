r"""One model step under XLA compile-option variants: its cost and the kernels it launches.

  python -m experiments.step_variants --models t5_1_1_small --dtype bfloat16 \
      --vocab_size 32128 --input_length 512 --position 64 --tokens 1,5 \
      --variants project,no_command_buffers,loop_command_buffers,no_triton_gemm

On an accelerator a small model's decode step is not bound by its weight reads: a
T5.1.1-small step reads 83 MB in 0.02 ms of an H200's bandwidth, yet measured 0.37 ms
(`experiments/results/gpu_h200`), and that step is the draft's cost c in every
speculative iteration. A step's time is then its kernel launches times the cost of
each. This experiment measures, per model and per named set of XLA options (a variant;
join names with '+' to combine them):

  T(N)       the marginal cost of one decode of N tokens inside a jitted loop
             (`timing.step_time`, cache filled to --position), for each --tokens N;
  launches   the instructions of the compiled step loop's body that run as their own
             kernel or library call (fusions, library calls such as cuBLAS GEMMs, copies,
             ...; a rough count: one instruction can issue several kernels) for N = 1,
             and at the largest N, and T(1) per launch.

The first variant is measured again at the end, so the table shows the run's own
spread. Options a jaxlib does not accept are reported as such, not measured. Writes
<results_dir>/step_variants.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import collections
import re
from typing import Any, Mapping, Sequence

from experiments import harness
from experiments.harness import Column, fmt

# Named XLA option sets. "project" is what the decoding loops compile with (the backend's
# defaults in `spec_decode.compile_options`); the others add to it.
_ALL_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
VARIANTS: Mapping[str, Mapping[str, Any]] = {
    "project": {},
    # GEMMs through cuBLAS only (no Triton GEMM fusions chosen by the autotuner).
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
    # Every kernel launched on its own (no CUDA graphs).
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
    # CUDA graphs that also take in loops and conditionals (XLA's default leaves them out).
    "loop_command_buffers": {"xla_gpu_enable_command_buffer": _ALL_COMMANDS + ",WHILE,CONDITIONAL"},
    # ... with loops of a known trip count unrolled inside the graph.
    "unrolled_loop_command_buffers": {
        "xla_gpu_enable_command_buffer": _ALL_COMMANDS + ",WHILE,CONDITIONAL",
        "xla_gpu_command_buffer_unroll_loops": True},
    # Graphs of any size (XLA's default: 5 commands at least).
    "small_command_buffers": {"xla_gpu_graph_min_graph_size": 1},
}

# Named switches of the model code (`spec_decode.models.t5` attributes read when a function
# is traced); a variant may name these too. The default of each is the project's.
SWITCHES: Mapping[str, tuple[str, Any]] = {
    # one-row products (a one-token step at batch 1) as XLA lowers them
    "one_row_as_one": ("ONE_ROW_AS_TWO", False),
    # ... or stacked to two rows, a GEMM (the project's default on GPU backends)
    "one_row_as_two": ("ONE_ROW_AS_TWO", True),
}

# Opcodes that launch nothing of their own on the device.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "after-all", "opt-barrier", "partition-id", "replica-id", "domain"})
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def variant_options(name: str) -> dict[str, Any]:
  """The XLA options of a variant name ('a+b' merges a's and b's)."""
  out: dict[str, Any] = {}
  for part in name.split("+"):
    if part not in VARIANTS and part not in SWITCHES:
      raise ValueError(f"unknown variant {part!r}; known: {', '.join([*VARIANTS, *SWITCHES])}")
    out.update(VARIANTS.get(part, {}))
  return out


def variant_switches(name: str) -> dict[str, Any]:
  """The model-code switches a variant name sets (`models.t5.switched` arguments)."""
  return dict(SWITCHES[p] for p in name.split("+") if p in SWITCHES)


def computations(hlo_text: str) -> dict[str, list[str]]:
  """Each computation of an HLO module's text: name -> its instructions' opcodes."""
  out: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and "=" not in line.split("(")[0]:
        current = m.group(1)
        out[current] = []
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      out[current].append(m.group(1))
  return out


def loop_launches(hlo_text: str) -> dict[str, int]:
  """Launch counts of the largest while-loop body in a compiled module (a decode step
  loop's step): fusions, custom calls (library calls: GEMMs, ...), other launching
  instructions and their total. Instructions inside fusions are not counted: a fusion is
  one kernel."""
  comps = computations(hlo_text)
  bodies = set(_BODY.findall(hlo_text))
  if not bodies:
    raise ValueError("no while loop in the compiled module")
  body = max((b for b in bodies if b in comps), key=lambda b: len(comps[b]))
  counts = collections.Counter(op for op in comps[body] if op not in _FREE)
  fusions, calls = counts.pop("fusion", 0), counts.pop("custom-call", 0)
  other = sum(counts.values())
  return {"fusions": fusions, "custom_calls": calls, "other": other,
          "total": fusions + calls + other}


def measure(args) -> list[dict[str, Any]]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spec_decode import compile_options
  from spec_decode.decoding import timing
  from spec_decode.models import t5
  project = dict(compile_options.resolve(None))  # the decoding loops' options here
  rows = []
  order = list(args.variants) + args.variants[:1]  # the first again: the run's spread
  for text in args.models:
    spec = harness.model_spec(text, vocab_size=args.vocab_size, dtype=args.dtype)
    models = harness.load_models(spec)
    model, params = models.target, models.target_params
    n_params = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
    enc = jnp.asarray(np.random.RandomState(0).randint(
        2, model.vocab_size, (args.batch_size, args.input_length)).astype(np.int32))
    length = args.position + max(args.tokens) + 1
    for i, variant in enumerate(order):
      options = {**project, **variant_options(variant)}
      row = {"model": spec.label, "params": n_params, "batch": args.batch_size,
             "variant": variant + (" (again)" if i == len(args.variants) else ""),
             "options": options}
      kw = dict(cache_length=length, position=args.position, compiler_options=options)
      try:
        with t5.switched(**variant_switches(variant)):
          times = {n: timing.step_time(model, params, enc, num_tokens=n,
                                       repeats=args.repeats, **kw) for n in args.tokens}
          launches = {n: loop_launches(timing.decode_loop(
              model, params, enc, num_tokens=n, steps=1, **kw).compiled_text())
              for n in sorted({1, max(args.tokens)})}
      except Exception as e:  # an option this jaxlib refuses: say so, go on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"{spec.label} [{variant}]: {row['error']}", flush=True)
        rows.append(row)
        continue
      n_max = max(args.tokens)
      one = launches[1]
      row.update(t_ms={str(n): t * 1e3 for n, t in times.items()}, launches=one,
                 launches_max=launches[n_max]["total"],
                 us_per_launch=times[1] * 1e6 / max(one["total"], 1))
      rows.append(row)
      print(f"{spec.label} [{row['variant']}]: T(1) {times[1] * 1e3:.3f} ms, "
            + ", ".join(f"T({n})/T(1) {times[n] / times[1]:.3f}" for n in args.tokens if n > 1)
            + f"; {one['total']} launches per step ({one['fusions']} fusions, "
            f"{one['custom_calls']} library calls), {row['us_per_launch']:.2f} us each",
            flush=True)
    del params, models
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.step_variants", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="t5_1_1_small",
                 help="comma list: demo:<name> or a T5 preset (random weights)")
  p.add_argument("--vocab_size", type=int, default=None, help="vocabulary of preset models")
  p.add_argument("--dtype", default=None, help="parameter dtype, e.g. bfloat16")
  p.add_argument("--variants", default="project,no_command_buffers,loop_command_buffers,"
                 "no_triton_gemm",
                 help=f"comma list of {', '.join([*VARIANTS, *SWITCHES])} ('+' joins)")
  p.add_argument("--tokens", default="1", help="N values (1 is added)")
  p.add_argument("--batch_size", type=int, default=1)
  p.add_argument("--input_length", type=int, default=512)
  p.add_argument("--position", type=int, default=64, help="cache entries already filled")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--name", default="step_variants", help="output stem")
  args = p.parse_args(list(argv))
  args.models = [m for m in args.models.split(",") if m]
  args.variants = [v for v in args.variants.split(",") if v]
  args.tokens = tuple(sorted({1} | set(harness.parse_ints(args.tokens, "tokens"))))
  if not args.models or not args.variants:
    p.error("--models and --variants must name at least one each")
  for v in args.variants:
    try:
      variant_options(v)
    except ValueError as e:
      p.error(str(e))
  if (min(args.tokens) < 1 or args.repeats < 1 or args.input_length < 1 or args.position < 0
      or args.batch_size < 1):
    p.error("--tokens, --repeats, --batch_size and --input_length must be >= 1, "
            "--position >= 0")
  return args


def run(args, meta) -> harness.Output:
  rows = measure(args)
  cols = [Column("model", "model"), Column("variant", "XLA options"),
          Column("t1", "T(1)", lambda v: fmt(v, 3, " ms"))]
  cols += [Column(f"r{n}", f"T({n})/T(1)", lambda v: fmt(v, 3)) for n in args.tokens if n > 1]
  cols += [Column("total", "launches per step"), Column("fusions", "fusions"),
           Column("custom_calls", "library calls"),
           Column("launches_max", f"launches at N = {max(args.tokens)}"),
           Column("us_per_launch", "T(1) per launch", lambda v: fmt(v, 2, " us")),
           Column("error", "not measured")]
  table = []
  for r in rows:
    t = r.get("t_ms") or {}
    table.append(dict(r, t1=t.get("1"), **{f"r{n}": t[str(n)] / t["1"] for n in args.tokens
                                           if n > 1 and t},
                      **(r.get("launches") or {})))
  options = "; ".join(
      f"{v}: {variant_options(v) or variant_switches(v) or 'the project defaults'}"
      for v in args.variants)
  notes = [f"random-weight models ({args.dtype or 'float32'}), batch {args.batch_size}, "
           f"encoder input {args.input_length} tokens, cache filled to {args.position}; "
           f"marginal step costs (`timing.step_time`), median of {args.repeats} rounds.",
           f"Variants (XLA options added to the project's): {options}.",
           "Launches: instructions of the compiled step loop's body that run as their own "
           "kernel or library call, for N = 1 and the largest N (a rough count: one library "
           "call can run several kernels)."]
  return harness.Output(args.name, "One model step under XLA option variants", cols, table,
                        notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.step_variants", argv, parse_args, run)


if __name__ == "__main__":
  main()
