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
<results_dir>/step_variants.{md,csv,json}; with --save_hlo also each compiled step loop's
optimized HLO (<name>_<model>_<variant>_n<N>.hlo.gz), which

  python -m experiments.step_variants --kinds A.hlo.gz,B.hlo.gz

tabulates by what each launch does (`launch_kinds`: the fusion's kind and root, the dots,
reductions, concatenations ... inside it), side by side, to find the kernels one adds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
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
    # ... stacked by a broadcast, which a GEMM fusion may absorb (no concatenation kernel)
    "one_row_as_two_broadcast": ("ONE_ROW_AS_TWO", "broadcast"),
    # the decoder's self-attention products as XLA's dots (the default off the CPU) ...
    "self_attention_dots": ("ROWWISE_SELF_ATTENTION", False),
    # ... or as summed multiplies (the default on the CPU: no copies of the cache)
    "self_attention_rowwise": ("ROWWISE_SELF_ATTENTION", True),
    # the new tokens' K/V written into the cache as a vmapped scatter (the default off the
    # CPU) ...
    "scatter_writes": ("ROW_WRITES", False),
    # ... or as one in-place dynamic-update-slice per row (the default on the CPU)
    "row_writes": ("ROW_WRITES", True),
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


def computations(hlo_text: str, lines: bool = False) -> dict[str, list[str]]:
  """Each computation of an HLO module's text: name -> its instructions' opcodes (lines:
  the instructions' text instead)."""
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
      out[current].append(line.strip() if lines else m.group(1))
  return out


def _loop_body(hlo_text: str, comps: dict[str, list[str]]) -> str:
  """The largest while-loop body of a compiled module (a decode step loop's step)."""
  bodies = [b for b in set(_BODY.findall(hlo_text)) if b in comps]
  if not bodies:
    raise ValueError("no while loop in the compiled module")
  return max(bodies, key=lambda b: len(comps[b]))


def loop_launches(hlo_text: str) -> dict[str, int]:
  """Launch counts of the largest while-loop body in a compiled module (a decode step
  loop's step): fusions, custom calls (library calls: GEMMs, ...), other launching
  instructions and their total. Instructions inside fusions are not counted: a fusion is
  one kernel."""
  comps = computations(hlo_text)
  counts = collections.Counter(op for op in comps[_loop_body(hlo_text, comps)]
                               if op not in _FREE)
  fusions, calls = counts.pop("fusion", 0), counts.pop("custom-call", 0)
  other = sum(counts.values())
  return {"fusions": fusions, "custom_calls": calls, "other": other,
          "total": fusions + calls + other}


_FUSION = re.compile(r"\bfusion\(.*\),\s*kind=(\w+),\s*calls=%?([\w.\-]+)")
# What a fused computation holds that says what its kernel does.
_NOTABLE = ("dot", "reduce", "scatter", "gather", "dynamic-update-slice", "concatenate",
            "exponential", "sort")


def launch_kinds(hlo_text: str) -> collections.Counter:
  """The launches of the compiled step loop's body (as `loop_launches` counts them) by what
  they do: 'kind fusion, root OP (the notable ops inside)' for a fusion, the opcode for any
  other launching instruction. Comparing two modules' kinds shows which kernels one adds."""
  comps = computations(hlo_text, lines=True)
  kinds: collections.Counter = collections.Counter()
  for line in comps[_loop_body(hlo_text, comps)]:
    op = _INSTRUCTION.match("  " + line).group(1)
    m = _FUSION.search(line) if op == "fusion" else None
    if m:
      fused = comps.get(m.group(2), [])
      fused_ops = {_INSTRUCTION.match("  " + f).group(1) for f in fused}
      root = next((_INSTRUCTION.match("  " + f).group(1) for f in fused
                   if f.startswith("ROOT")), "?")
      notable = "+".join(o for o in _NOTABLE if o in fused_ops)
      kinds[f"{m.group(1)} fusion, root {root}" + (f" ({notable})" if notable else "")] += 1
    elif op not in _FREE:
      kinds[op] += 1
  return kinds


def text_safe(label: str) -> str:
  """A model label as a file-name part ('t5_1_1_small (random)' -> 't5_1_1_small_random')."""
  return re.sub(r"[^\w.\-]+", "_", label).strip("_")


def save_hlo(text: str, path: str) -> None:
  import gzip
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with gzip.open(path, "wt", encoding="utf-8") as f:
    f.write(text)


def kinds_table(paths: Sequence[str]) -> str:
  """A Markdown table of `launch_kinds` of each compiled module's text file (gzip too)."""
  import gzip
  counts = []
  for path in paths:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
      counts.append(launch_kinds(f.read()))
  names = sorted(set().union(*counts), key=lambda k: (-max(c[k] for c in counts), k))
  head = "| launch | " + " | ".join(os.path.basename(p) for p in paths) + " |\n"
  head += "|---|" + "---|" * len(paths) + "\n"
  body = "".join(f"| {k} | " + " | ".join(str(c[k]) for c in counts) + " |\n" for k in names)
  total = "| total | " + " | ".join(str(sum(c.values())) for c in counts) + " |\n"
  return head + body + total


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
          launches = {}
          for n in sorted({1, max(args.tokens)}):
            text = timing.decode_loop(model, params, enc, num_tokens=n, steps=1,
                                      **kw).compiled_text()
            launches[n] = loop_launches(text)
            if args.save_hlo and i < len(args.variants):
              save_hlo(text, os.path.join(args.results_dir, f"{args.name}_{text_safe(spec.label)}"
                                          f"_{variant}_n{n}.hlo.gz"))
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
  p.add_argument("--save_hlo", action="store_true",
                 help="also write each compiled step loop's optimized HLO (gzip)")
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


def main(argv: Sequence[str] | None = None) -> dict[str, str] | str:
  """The measurement (`harness.main`), or with --kinds A,B,... only the table of saved
  modules' launch kinds, printed and returned."""
  args = list(sys.argv[1:] if argv is None else argv)
  if any(a.split("=")[0] == "--kinds" for a in args):
    p = argparse.ArgumentParser(prog="python -m experiments.step_variants --kinds")
    p.add_argument("--kinds", required=True, help="comma list of saved .hlo(.gz) files")
    paths = [f for f in p.parse_args(args).kinds.split(",") if f]
    if not paths:
      p.error("--kinds must name at least one saved module")
    with harness.cli_errors("experiments.step_variants") if argv is None \
        else contextlib.nullcontext():
      table = kinds_table(paths)
    print(table, end="")
    return table
  return harness.main("experiments.step_variants", argv, parse_args, run)


if __name__ == "__main__":
  main()
