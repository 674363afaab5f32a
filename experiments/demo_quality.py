r"""Quality of the shipped demo models on held-out examples of the generated tasks.

  python -m experiments.demo_quality                       # both tasks, every shipped model
  python -m experiments.demo_quality --tasks ende --num_examples 50
  python -m experiments.demo_quality --tasks ende --models target_big \
      --kernel_weights float32,bfloat16,bfloat16_dot,int8 --stem kernel_quality

Each model decodes the first --num_examples test examples greedily (batch
--batch_size, one jitted autoregressive loop) and is scored with its task's
metric: BLEU (sacrebleu, T5's settings) on synthetic_ende, ROUGE-1/2/Lsum on
synthetic_cnndm. Two reference rows bound the scale: 'reference sample'
scores an independent draw of the task's own stochastic choices (another
reference for the same input: what a model sampling the true distribution
would get), and 'reference mode' scores the most likely choices (the best
a greedy decoder can do against sampled references, up to ties).
With --kernel_weights (a comma list of `T5.kernel_weights` settings) each model
decodes once per setting of the CPU decode kernel's weight format, and each row
after the first says which fraction of its outputs is token-for-token identical
to the first setting's (the quality change of bfloat16 / int8 weights against
float32). Writes <results_dir>/<stem>.{md,csv,json}.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from experiments import harness, setups
from experiments.harness import Column, fmt

MODELS = ("target", "large", "base", "small", "small_distilled")
TASK_MODELS = {task: ("target_big",) + MODELS for task in ("ende", "cnndm")}
METRICS = {"ende": ("bleu",), "cnndm": ("rouge1", "rouge2", "rougeLsum")}


def _score(task: str, targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  from spec_decode import metrics
  if task == "ende":
    return {"bleu": metrics.bleu(targets, predictions)["bleu"]}
  return metrics.rouge(targets, predictions)


def _decode(path: str, enc, max_decode_len: int, batch_size: int,
            kernel_weights: str = "auto") -> tuple[list[list[int]], int]:
  """Greedy outputs of the checkpoint at `path` on enc (the CPU kernel's weights in the
  format `kernel_weights`), and its parameter count."""
  import dataclasses

  import numpy as np

  from spec_decode import decoding
  models = harness.load_models(harness.model_spec(path, dtype="float32"))
  target = dataclasses.replace(models.target, kernel_weights=kernel_weights)
  greedy = harness.decode_fn(decoding.Autoregressive(), target, models.target_params,
                             max_decode_len=max_decode_len)
  batches, n = harness.batches(enc, batch_size)  # one shape: one compile
  rows = [row for b in batches for row in np.asarray(greedy(*b).tokens).tolist()][:n]
  return rows, models.target.num_params()


def _references(task_name: str, n: int) -> dict[str, list[str]]:
  """Other references for the same inputs: one resampled, one of the most likely choices."""
  from spec_decode.data.synthetic import splits
  return {"reference sample": splits.references(task_name, "test", size=n, mode="sample"),
          "reference mode": splits.references(task_name, "test", size=n, mode="mode")}


def score(args) -> list[dict[str, Any]]:
  from spec_decode.data import tokenized
  from spec_decode.data import synthetic_tasks
  rows = []
  for task in args.tasks:
    name, input_length, output_length = setups.DEMO_TASKS[task]
    source = synthetic_tasks.offline_source(name)
    examples = source.examples("test", args.num_examples)
    targets = [ex["targets"] for ex in examples]
    enc = tokenized.pad_rows(source.tokenized("test", args.num_examples).inputs, input_length, 16)
    for label, preds in _references(name, len(examples)).items():
      rows.append({"task": setups.TASK_LABELS[task], "model": label, "params": None,
                   "examples": len(examples), **_score(task, targets, preds)})
    for m in args.models or TASK_MODELS.get(task, MODELS):
      path = os.path.join(args.demo_models, f"{task}_{m}")
      if not os.path.isdir(path):
        rows.append({"task": setups.TASK_LABELS[task], "model": f"{task}_{m}",
                     "note": "not shipped"})
        continue
      first = None
      for weights in args.kernel_weights:
        print(f"{task}_{m} kernel_weights={weights}", flush=True)
        tokens, num_params = _decode(path, enc, output_length, args.batch_size, weights)
        preds = [source.vocabulary.decode(t) for t in tokens]
        row = {"task": setups.TASK_LABELS[task], "model": f"{task}_{m}",
               "params": num_params, "examples": len(examples), **_score(task, targets, preds)}
        if len(args.kernel_weights) > 1:
          first = tokens if first is None else first
          row["kernel_weights"] = weights
          row["identical"] = sum(a == b for a, b in zip(tokens, first)) / len(tokens)
        rows.append(row)
  return rows


def parse_args(argv: Sequence[str]):
  p = argparse.ArgumentParser(prog="python -m experiments.demo_quality", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tasks", default="ende,cnndm")
  p.add_argument("--num_examples", type=int, default=200)
  p.add_argument("--batch_size", type=int, default=25)
  p.add_argument("--demo_models", default=setups.DEMO_DIR)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--stem", default="demo_quality")
  p.add_argument("--models", default="",
                 help="comma list of model names (e.g. target_big,small); default: every "
                      "shipped model of the task")
  p.add_argument("--kernel_weights", default="auto",
                 help="comma list of T5.kernel_weights settings; with more than one, each "
                      "model decodes once per setting and rows say the fraction of outputs "
                      "identical to the first setting's")
  args = p.parse_args(list(argv))
  from spec_decode.kernels import cpu_matmul
  args.models = tuple(m.strip() for m in args.models.split(",") if m.strip())
  args.kernel_weights = tuple(w.strip() for w in args.kernel_weights.split(",") if w.strip())
  bad = [w for w in args.kernel_weights if w not in cpu_matmul.WEIGHTS]
  if bad or not args.kernel_weights:
    p.error(f"--kernel_weights: each must be one of {cpu_matmul.WEIGHTS}, got {bad or 'none'}")
  args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
  for t in args.tasks:
    if t not in setups.TASKS:
      p.error(f"unknown task {t!r}; known: {setups.TASKS}")
  if args.num_examples < 1 or args.batch_size < 1:
    p.error("--num_examples and --batch_size must be >= 1")
  return args


def run(args, meta) -> harness.Output:
  rows = score(args)
  columns = [Column("task", "task"), Column("model", "model"),
             Column("params", "params", lambda x: "" if x is None else f"{x / 1e6:.2f}M"),
             Column("examples", "examples")]
  if len(args.kernel_weights) > 1:
    columns += [Column("kernel_weights", "kernel weights"),
                Column("identical", "identical to first", lambda x: fmt(x, 3))]
  for key in sorted({k for t in args.tasks for k in METRICS[t]}):
    columns.append(Column(key, key.replace("rouge", "ROUGE-").replace("bleu", "BLEU"),
                          lambda x: fmt(x, 1)))
  columns.append(Column("note", "note", lambda x: x or ""))
  notes = ["Greedy decoding of the first test examples of each generated task; BLEU = "
           "sacrebleu with T5's settings, ROUGE = rouge_score F-measure x 100 (T5's settings).",
           "'reference sample' = an independent draw of the generator's stochastic choices for "
           "the same inputs (the score of sampling the true distribution); 'reference mode' = "
           "the generator's most likely choices (about the best a greedy decoder can score "
           "against sampled references)."]
  return harness.Output(args.stem, "Demo model quality", columns, rows, notes)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
  return harness.main("experiments.demo_quality", argv, parse_args, run, private=())


if __name__ == "__main__":
  main()
