"""gin at the command lines' edge: registration, finding files, strict parsing.

Shared by `spec_decode.main` and `spec_decode.train` (no absl flags here).
Parsing is strict: unknown configurables and parameters are errors (gin's
skip_unknown=False), and so is a macro bound on the command line that no gin
file uses (`--gin.GAMA=9` would otherwise change nothing). An unquoted string
gets a hint to quote it. gin files are code (a binding can call any registered
configurable): parse only files you trust.
"""

from __future__ import annotations

import difflib
import os
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_registered = False


def register_gin() -> None:
  """Makes the library's config classes gin-configurable (idempotent)."""
  global _registered
  if _registered:
    return
  import gin

  from spec_decode import decoding, experiment, model_specs
  gin.external_configurable(experiment.ExperimentConfig, "ExperimentConfig")
  for cls in decoding.registry.all_classes():  # algorithms, drafters, verifiers
    gin.external_configurable(cls, cls.__name__)
  gin.external_configurable(model_specs.ModelSpec, "ModelSpec")
  from spec_decode import train
  gin.external_configurable(train.TrainConfig, "TrainConfig")
  from spec_decode.heads import medusa, train_eagle, train_mtp
  gin.external_configurable(medusa.TrainConfig, "MedusaTrainConfig")
  gin.external_configurable(train_eagle.EagleTrainConfig, "EagleTrainConfig")
  gin.external_configurable(train_mtp.MtpTrainConfig, "MtpTrainConfig")
  gin.add_config_file_search_path(REPO_ROOT)
  _registered = True


def rewrite_gin_args(argv: Sequence[str]) -> list[str]:
  """T5X-style '--gin.NAME=VALUE' -> '--gin_bindings=NAME = VALUE'."""
  out = []
  for arg in argv:
    if arg.startswith("--gin.") and "=" in arg:
      name, value = arg[len("--gin."):].split("=", 1)
      out.append(f"--gin_bindings={name} = {value}")
    else:
      out.append(arg)
  return out


def resolve_gin_file(path: str) -> str:
  """`path` as given if it exists, else relative to the repository root (if there)."""
  if not (os.path.isabs(path) or os.path.exists(path)):
    in_repo = os.path.join(REPO_ROOT, path)
    if not os.path.exists(in_repo):
      raise FileNotFoundError(f"gin file not found: {path} (looked in {os.getcwd()} and "
                              f"{REPO_ROOT}); configs are in configs/ (e.g. configs/default.gin)")
    path = in_repo
  if os.path.isdir(path):
    raise IsADirectoryError(f"--gin_file {path} is a directory; pass a .gin file in it, e.g. "
                            f"{next(iter(sorted(_gin_files_in(path))), 'DIR/NAME.gin')}")
  if not os.path.exists(path):
    raise FileNotFoundError(f"gin file not found: {path}")
  return path


def _gin_files_in(directory: str) -> list[str]:
  return [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".gin")]


class GinConfigError(ValueError):
  """A gin file or binding that cannot be used as given."""


def _binding_name(binding: str) -> str:
  return binding.split("=", 1)[0].strip()


def _check_macros(gin_bindings: Sequence[str]) -> None:
  """Each macro bound on the command line must be used by the config (a typo is an error)."""
  import gin
  macro_fn = gin.get_configurable(gin.config.macro)
  config = gin.config._CONFIG  # gin keeps bindings here; it has no public view of macros
  used = {"/".join(ref.scopes) for ref in gin.config.iterate_references(config, to=macro_fn)}
  for binding in gin_bindings:
    for line in binding.splitlines():
      name = _binding_name(line)
      if not line.strip() or line.lstrip().startswith("#") or "." in name or "/" in name:
        continue
      if name not in used:
        close = difflib.get_close_matches(name, sorted(used), n=1)
        hint = f"did you mean {close[0]}?" if close else f"macros the config uses: {sorted(used)}"
        raise GinConfigError(f"gin binding '{line.strip()}' sets the macro {name}, which no gin "
                             f"file uses, so it would change nothing; {hint}")


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> None:
  """Clears gin and parses files (found as `resolve_gin_file` says) and bindings, strictly."""
  import gin
  register_gin()
  gin.clear_config()  # one parse per run; also unlocks a config an earlier parse locked
  files = [resolve_gin_file(f) for f in gin_files]
  try:
    gin.parse_config_files_and_bindings(files, list(gin_bindings), skip_unknown=False)
  except SyntaxError as e:
    token = str(e).split("Failed to parse token", 1)
    if len(token) == 2:
      bad = token[1].split("'")[1] if "'" in token[1] else token[1].strip()
      raise GinConfigError(f"cannot parse the gin value {bad!r}: strings must be quoted, e.g. "
                           f"--gin.NAME=\"'{bad}'\" (bindings: {list(gin_bindings)})") from e
    raise GinConfigError(f"gin syntax error: {e}") from e
  _check_macros(gin_bindings)


def run_trainer(program: str, config_cls, gin_name: str, example_gin: str, train_fn) -> None:
  """`python -m <program> --gin_file=... [--gin.NAME=VALUE]`: builds the gin-configured
  `config_cls` (registered as `gin_name`) and calls train_fn(config); one line per error."""
  from absl import app, flags

  from spec_decode import cli
  if "gin_file" not in flags.FLAGS:
    flags.DEFINE_multi_string("gin_file", [], "gin files to parse (in order)")
    flags.DEFINE_multi_string("gin_bindings", [], f"extra gin bindings, e.g. "
                              f"{gin_name}.num_steps=10; --gin.NAME=VALUE also works")
  cli.define_flags()

  def main(argv) -> None:
    import gin
    with cli.handle_errors(program):
      if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
      cli.quiet_logging()
      parse_gin(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
      try:
        cfg = gin.get_configurable(config_cls)()
      except TypeError as e:
        raise GinConfigError(f"the gin files do not configure a {gin_name} ({e}); pass "
                             f"--gin_file={example_gin}") from e
      train_fn(cfg)

  app.run(main, flags_parser=lambda argv: flags.FLAGS(rewrite_gin_args(argv)))
