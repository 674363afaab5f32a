"""The package's layers, read from the source with `ast` (nothing is imported).

  0  infrastructure: compile_options, tree_util, theory, metrics, paths, configurable, native,
     kernels
  1  models, checkpoints, data, partitioning, distributed
  2  decoding (the runner, algorithms, drafters, verifiers, the loop timer)
  3  heads (networks over a target's states)
  4  experiment (the runner of experiments) and train, side by side: neither imports the other
  5  cli and main (the command lines)
  6  experiments/ (the drivers)

An import is an edge to the module it names: `import a.b.c` and `from a.b.c import x` to
a.b.c, `from a.b import c` to the submodule a.b.c when there is one, else to the package
a.b (its __init__): an import that takes a name from a package hops through its
__init__. Every import counts, also one inside a function. The graph has no cycle, and no
edge runs from a lower layer to a higher one. Registration on definition keeps it so: a
new drafter, verifier, head network or config is found without a central list.
"""

import ast
import os

import pytest

from spec_decode import configurable, paths

ROOT = paths.REPO_ROOT
LAYERS = [
    (0, ("spec_decode", "spec_decode.compile_options", "spec_decode.tree_util",
         "spec_decode.theory", "spec_decode.metrics", "spec_decode.paths",
         "spec_decode.configurable", "spec_decode.native", "spec_decode.kernels")),
    (1, ("spec_decode.models", "spec_decode.checkpoints", "spec_decode.data",
         "spec_decode.partitioning", "spec_decode.distributed")),
    (2, ("spec_decode.decoding",)),
    (3, ("spec_decode.heads",)),
    (4, ("spec_decode.experiment", "spec_decode.train")),
    (5, ("spec_decode.cli", "spec_decode.main")),
    (6, ("experiments",)),
]
SIBLINGS = ("spec_decode.experiment", "spec_decode.train")  # layer 4: apart


def _modules() -> dict[str, str]:
  """{module name: file path} of spec_decode and experiments."""
  out = {}
  for top in ("spec_decode", "experiments"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      if "results" in os.path.relpath(dirpath, ROOT).split(os.sep):
        continue
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
          out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = \
              os.path.join(dirpath, f)
  return out


MODULES = _modules()


def _is_package(name: str) -> bool:
  return MODULES.get(name, "").endswith("__init__.py")


def _imports(name: str) -> set[str]:
  """The internal modules `name` imports (see the module doc)."""
  tree = ast.parse(open(MODULES[name], encoding="utf-8").read())
  package = name if _is_package(name) else name.rpartition(".")[0]
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
      for a in node.names:
        sub = f"{base}.{a.name}"
        out.add(sub if sub in MODULES else base)
  return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
  best = None
  for rank, prefixes in LAYERS:
    for p in prefixes:
      if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[1]):
        best = (rank, len(p))
  assert best is not None, f"{name} is on no layer"
  return best[0]


def _cycles() -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, on, stack, out = {}, {}, set(), [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(GRAPH[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(GRAPH):
    if v not in index:
      visit(v)
  return out


def test_the_graph_is_read():
  assert "spec_decode.decoding.runner" in GRAPH["spec_decode.decoding.algorithms.speculative"]
  assert "spec_decode.experiment.model_specs" in GRAPH["spec_decode.experiment.setup"]
  assert {"spec_decode.cli.gin", "spec_decode.cli.main"} <= set(MODULES)


def test_the_import_graph_has_no_cycle():
  assert _cycles() == []


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
  upward = sorted(f"{a} -> {b}" for a, bs in GRAPH.items() for b in bs
                  if _layer(a) < _layer(b))
  assert upward == []


def test_training_and_the_experiment_runner_stand_apart():
  within = lambda name, p: name == p or name.startswith(p + ".")
  crossing = sorted(f"{a} -> {b}" for a, bs in GRAPH.items() for b in bs
                    for p, q in (SIBLINGS, SIBLINGS[::-1]) if within(a, p) and within(b, q))
  assert crossing == []


def _module_level_flag_definitions(path: str) -> list[int]:
  """Lines of absl flag definitions that run on import (outside functions and outside
  `if __name__ == "__main__"`)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  lines = []

  def scan(body):
    for node in body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        continue
      if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
        continue
      for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and "DEFINE_" in ast.unparse(sub.func):
          lines.append(sub.lineno)
  scan(tree.body)
  return lines


@pytest.mark.parametrize("name", sorted(MODULES))
def test_flags_are_defined_only_when_a_command_runs(name):
  assert _module_level_flag_definitions(MODULES[name]) == []


def test_configurable_classes_need_no_central_list():
  """Every config class and plug-in is registered where it is defined; the gin layer names
  none of them (a new drafter, head or training recipe edits no central file)."""
  from spec_decode.cli import gin as gin_layer
  gin_layer.register_gin()
  source = open(MODULES["spec_decode.cli.gin"], encoding="utf-8").read()
  names = configurable.classes()
  assert {"ExperimentConfig", "GammaChoice", "ModelSpec", "Sampling", "Speculative",
          "EagleDrafter", "TreeVerifier", "TrainConfig", "EagleTrainConfig",
          "MedusaTrainConfig", "MtpTrainConfig"} <= set(names)
  # parse_experiment builds the ExperimentConfig; nothing else is named, nothing listed
  assert [n for n in names if n in source and n != "ExperimentConfig"] == []
  assert source.count("external_configurable(") == 1
  from spec_decode.checkpoints import heads as head_checkpoints
  assert set(head_checkpoints.kinds()) >= {"eagle", "medusa", "mtp"}
  for layer_file in ("spec_decode.experiment.model_specs", "spec_decode.checkpoints.heads"):
    text = open(MODULES[layer_file], encoding="utf-8").read()
    assert "EagleHead" not in text and "MedusaHeads" not in text and "MtpModules" not in text
