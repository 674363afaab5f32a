r"""Writes the README's 'Results' section from experiments/results/*.json.

  python -m experiments.results_readme [--results_dir experiments/results] [--output FILE]

Every result file the drivers wrote (table_N, ablate_*, batch_scaling_*,
benchmark_*) becomes a subsection: its table and notes, the command that
produced it, the machine and date, and its figures (linked relative to the
repository root). Measurements this environment could not make (GPU / TPU,
paper-scale checkpoints) are listed with the command that makes them.
Default output: <results_dir>/README_results.md, ready to paste into README.md.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
from typing import Sequence

from experiments import harness

ORDER = ("table_1", "table_2", "table_3", "table_4", "table_5", "ablate_", "batch_scaling_",
         "benchmark_")

# What this CPU-only environment cannot measure, and the command that does.
NOT_MEASURED = (
    ("end to end with a T5-base draft (its step alone is in gpu_h200/, gpu_h100/)",
     "python -m experiments.benchmark --target t5_1_1_xxl --draft t5_1_1_base --dtype bfloat16 "
     "--batch_size 1 --input_length 512 --decode_len 128 --name gpu_xxl_base"),
    ("the same with a T5-large draft (its step alone is in gpu_h100/)",
     "python -m experiments.benchmark --target t5_1_1_xxl --draft t5_1_1_large --dtype bfloat16 "
     "--batch_size 1 --input_length 512 --decode_len 128 --name gpu_xxl_large"),
    ("GPU batch scaling of step costs at B = 4, 16, 64 (1, 8, 32: gpu_h200/)",
     "python -m experiments.benchmark --target t5_1_1_xxl --draft t5_1_1_small --dtype bfloat16 "
     "--batch_size B --input_length 512 --decode_len 128 --name gpu_xxl_small_bB"),
    ("step costs on a TPU slice with model parallelism",
     "python -m experiments.benchmark --target t5_1_1_xxl --draft t5_1_1_small --dtype bfloat16 "
     "--mesh data=1,model=8 --name tpu_xxl_small"),
    ("Tables 2-5 at the paper's scale (fine-tuned T5.1.1 checkpoints)",
     "python -m experiments.reproduce --table all --scale paper --checkpoints "
     "ende_target=PATH,ende_small=PATH,ende_base=PATH,ende_large=PATH,cnndm_target=PATH,"
     "cnndm_small=PATH,cnndm_base=PATH,cnndm_large=PATH "
     "--gin_bindings \"ExperimentConfig.mesh = 'data=1,model=8'\""),
    ("batch scaling with the paper's models on an accelerator",
     "python -m experiments.batch_scaling --scale paper "
     "--checkpoints ende_target=PATH,ende_small=PATH"),
)


def _not_measured() -> str:
  rows = "".join(f"| {what} | `{cmd}` |\n" for what, cmd in NOT_MEASURED)
  return ("### Not measured here\n\nThe development machines have CPUs only (a GPU is lent to some "
          "sessions) and no T5.1.1 checkpoints; "
          "these commands make the missing measurements.\n\n"
          "| what | command |\n|---|---|\n" + rows)


def _rank(stem: str) -> tuple[int, str]:
  for i, prefix in enumerate(ORDER):
    if stem.startswith(prefix):
      return i, stem
  return len(ORDER), stem


def _cpu(doc: dict) -> str | None:
  """The CPU model a result file's run recorded (e.g. 'AMD EPYC (family 25, model 1)')."""
  machine = (doc.get("meta") or {}).get("machine") or {}
  cpu = (machine.get("decoding") or {}).get("cpu") or {}
  return cpu.get("model") or machine.get("cpu_model")


def _title(stem: str, doc: dict) -> str:
  text = doc.get("readme_markdown") or doc["markdown"]
  first = text.splitlines()[0] if text else ""
  return first.lstrip("# ").strip() if first.startswith("#") else stem


def _headings(docs: dict[str, dict]) -> dict[str, str]:
  """{stem: its subsection's heading}: the file's title; where files share a title (a table
  measured on several CPU families, one file per family), the title and the run's CPU, or
  the file's name where the CPU does not tell them apart either."""
  titles = {stem: _title(stem, doc) for stem, doc in docs.items()}
  count = collections.Counter(titles.values())
  with_cpu = {stem: f"{titles[stem]} ({_cpu(doc)})" for stem, doc in docs.items()}
  count_cpu = collections.Counter(with_cpu[s] for s in docs if count[titles[s]] > 1)
  out = {}
  for stem, doc in docs.items():
    if count[titles[stem]] == 1:
      out[stem] = titles[stem]
    elif _cpu(doc) and count_cpu[with_cpu[stem]] == 1:
      out[stem] = with_cpu[stem]
    else:
      out[stem] = f"{titles[stem]} ({stem})"
  return out


def _section(stem: str, doc: dict, results_rel: str, title: str | None = None) -> str:
  """One result file as a README subsection (its own markdown, title demoted, links fixed).

  A driver's shorter "readme_markdown" is used when it wrote one; run listings
  ('## Runs') stay in the result files. title: the heading (default the file's title).
  """
  text = doc.get("readme_markdown") or doc["markdown"]
  text = re.sub(r"^## Runs\n.*?(?=^## |\Z)", "", text, flags=re.M | re.S)
  lines = text.splitlines()
  title = title or _title(stem, doc)
  body = "\n".join(lines[1:]).strip("\n")
  body = re.sub(r"^## ", "#### ", body, flags=re.M)
  body = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)",
                lambda m: f"![{m.group(1)}]({results_rel}/{m.group(2)})", body)
  files = f"`{results_rel}/{stem}.md` (also `.csv`, `.json`)"
  if doc.get("readme_markdown"):
    files = f"`{results_rel}/{stem}.md` (all rows; also `.csv`, `.json`)"
  return f"### {title}\n\nFiles: {files}\n\n{body.strip()}\n"


def build(results_dir: str) -> str:
  rel = os.path.relpath(os.path.abspath(results_dir), harness.REPO_ROOT)
  parts = ["## Results", "",
           "Generated by `python -m experiments.results_readme` from the files in "
           f"`{rel}/`; every table and figure names the command, machine and date that "
           "produced it. Demo-scale numbers come from the small CPU-trained demo models "
           "(demo_models/) on the synthetic tasks: they test the paper's claims in "
           "miniature, they are not the paper's numbers, which are shown alongside.", ""]
  stems = sorted((os.path.splitext(os.path.basename(p))[0]
                  for p in glob.glob(os.path.join(results_dir, "*.json"))), key=_rank)
  docs = {}
  for stem in stems:
    with open(os.path.join(results_dir, f"{stem}.json"), encoding="utf-8") as f:
      doc = json.load(f)
    if isinstance(doc, dict) and "markdown" in doc:
      docs[stem] = doc  # else not a driver's output (e.g. memory_xxl.json, see below)
  headings = _headings(docs)
  for stem, doc in docs.items():
    parts.append(_section(stem, doc, rel, headings[stem]))
  if os.path.exists(os.path.join(results_dir, "memory_xxl.md")):
    parts.append(f"### Memory plan of T5-XXL decoding\n\nSee `{rel}/memory_xxl.md`.\n")
  for report in sorted(glob.glob(os.path.join(results_dir, "gpu_*", "README.md"))):
    where = os.path.relpath(report, harness.REPO_ROOT)
    with open(report, encoding="utf-8") as f:
      title = f.readline().lstrip("# ").strip()
    parts.append(f"### {title}\n\nSee `{where}` (measured on a lent GPU; that file names the "
                 "commands and device calls that made it).\n")
  parts.append(_not_measured())
  return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> str:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(prog="python -m experiments.results_readme", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--results_dir", default=harness.RESULTS_DIR)
  p.add_argument("--output", default=None)
  args = p.parse_args(argv)
  if not os.path.isdir(args.results_dir):
    raise FileNotFoundError(f"No such file or directory: the results directory "
                            f"{args.results_dir!r} (run a driver under experiments/ first, "
                            "or pass --results_dir)")
  out = args.output or os.path.join(args.results_dir, "README_results.md")
  text = build(args.results_dir)
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {out}")
  return out


if __name__ == "__main__":
  with harness.cli_errors("experiments.results_readme"):
    main()
