"""gin at the command lines' edge: registration, finding files, strict parsing.

Shared by the command lines (`cli.main`, `cli.train`) and the experiment drivers; no
absl flags are defined on import (`define_flags` defines --gin_file and --gin_bindings
for a command). Every class marked `configurable.register` where it is defined (configs,
`decoding` plug-ins through `decoding.registry`) is made gin-configurable under its name
(`register_gin`): a new config needs no line here. Parsing is strict: unknown
configurables and parameters are errors (gin's skip_unknown=False), and so is a macro
bound on the command line that no gin file uses (`--gin.GAMA=9` would otherwise change
nothing). An unquoted string gets a hint to quote it. gin files are code (a binding can
call any registered configurable): parse only files you trust.
"""

from __future__ import annotations

import difflib
import io
import logging
import os
import re
import tokenize
from typing import Any, Sequence

from absl import flags

from spec_decode import configurable, paths

_registered: set[str] = set()


def register_gin() -> None:
  """Makes every configurable class gin-configurable under its registered name (idempotent;
  classes defined since the last call are added)."""
  import gin

  # The layers whose modules define configurable classes; importing them runs the
  # registrations (decoding plug-ins, experiment and model specs, head networks, trainers).
  import spec_decode.decoding  # noqa: F401
  import spec_decode.experiment  # noqa: F401
  import spec_decode.heads  # noqa: F401
  import spec_decode.train  # noqa: F401
  if not _registered:
    gin.add_config_file_search_path(paths.REPO_ROOT)
  for name, cls in configurable.classes().items():
    if name not in _registered:
      gin.external_configurable(cls, name)
      _registered.add(name)


def define_flags(bindings_example: str) -> None:
  """--gin_file and --gin_bindings (once per process), for a command's `main`."""
  if "gin_file" not in flags.FLAGS:
    flags.DEFINE_multi_string("gin_file", [], "gin config files, parsed in order")
    flags.DEFINE_multi_string("gin_bindings", [], f"{bindings_example}; --gin.NAME=VALUE is "
                              "rewritten to one of these")


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
    in_repo = os.path.join(paths.REPO_ROOT, path)
    if not os.path.exists(in_repo):
      raise FileNotFoundError(f"gin file not found: {path} (looked in {os.getcwd()} and "
                              f"{paths.REPO_ROOT}); configs are in configs/ (e.g. "
                              "configs/default.gin)")
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
  for name, line in _macros_bound(gin_bindings):
    if name not in used:
      close = difflib.get_close_matches(name, sorted(used), n=1)
      hint = f"did you mean {close[0]}?" if close else f"macros the config uses: {sorted(used)}"
      raise GinConfigError(f"gin binding '{line}' sets the macro {name}, which no gin "
                           f"file uses, so it would change nothing; {hint}")


_INCLUDE = re.compile(r"""^include\s+(['"])(.+?)\1\s*(?:#.*)?$""")


def check_gin_text(path: str, _seen: set[str] | None = None) -> None:
  """GinConfigError naming `path` (and the line) when it is not UTF-8 text, its brackets
  or strings are left open (gin's own parser raises a bare tokenize error for those), or
  it includes a file that is not there (as gin looks: the path as given, then under each
  search path, the repository root among them); the same checks for every file it
  includes, recursively."""
  seen = set() if _seen is None else _seen
  if os.path.realpath(path) in seen:
    return
  seen.add(os.path.realpath(path))
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    line = 1 + e.object[:e.start].count(b"\n")
    raise GinConfigError(f"{path}, line {line}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start}); gin files must be UTF-8") from None
  for number, line in enumerate(text.splitlines(), 1):
    match = _INCLUDE.match(line.strip())
    if match:
      check_gin_text(_find_include(path, number, match.group(2)), seen)
  try:
    for _ in tokenize.generate_tokens(io.StringIO(text).readline):
      pass
  except tokenize.TokenError as e:
    line = e.args[1][0] if len(e.args) > 1 and e.args[1] else "?"
    raise GinConfigError(f"{path}, line {line}: {e.args[0]} (an unclosed bracket, brace or "
                         "string?)") from None
  except (SyntaxError, IndentationError):
    pass  # left to gin's parser, whose errors name the file and line


def _find_include(path: str, line: int, include: str) -> str:
  """Where gin finds `include` (from `path`, line `line`): the path as given, else under
  one of gin's search paths; GinConfigError naming both when it is nowhere. (gin itself
  fails with a TypeError when the include's first directory is also an importable
  namespace package, as configs/ is from the repository root.)"""
  import gin.config
  prefixes = list(getattr(gin.config, "_LOCATION_PREFIXES", [""]))
  for prefix in prefixes + [paths.REPO_ROOT]:
    candidate = os.path.join(prefix, include) if prefix else include
    if os.path.isfile(candidate):
      return candidate
  looked = [os.getcwd()] + [p for p in prefixes if p] + [paths.REPO_ROOT]
  raise GinConfigError(f"{path}, line {line}: included file {include!r} not found (looked "
                       f"in {', '.join(dict.fromkeys(looked))})")


def _drop_gin_path_not_found(record) -> bool:
  """A logging filter: gin logs 'Path not found' at ERROR for every place it searched
  for an include before it raises the error that names the include, file and line; the
  raised error is the one line a user needs."""
  return not (record.pathname.endswith(os.path.join("gin", "resource_reader.py"))
              and str(record.msg).startswith("Path not found"))


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> None:
  """Clears gin and parses files (found as `resolve_gin_file` says) and bindings, strictly."""
  import gin
  register_gin()
  root = logging.getLogger()
  if _drop_gin_path_not_found not in root.filters:
    root.addFilter(_drop_gin_path_not_found)
  gin.clear_config()  # one parse per run; also unlocks a config an earlier parse locked
  files = [resolve_gin_file(f) for f in gin_files]
  for f in files:
    check_gin_text(f)
  try:
    gin.parse_config_files_and_bindings(files, list(gin_bindings), skip_unknown=False)
  except (tokenize.TokenError, UnicodeDecodeError) as e:  # an included file, or a binding
    what = e.args[0] if isinstance(e, tokenize.TokenError) and e.args else str(e)
    culprit = _unclosed_binding(gin_bindings)
    if culprit is not None:
      raise GinConfigError(f"gin binding '{culprit}': gin syntax error: {what} (an unclosed "
                           "bracket, brace or string)") from e
    raise GinConfigError(f"gin syntax error in {files} or the files they include: "
                         f"{what}") from e
  except SyntaxError as e:
    token = str(e).split("Failed to parse token", 1)
    if len(token) == 2:
      bad = token[1].split("'")[1] if "'" in token[1] else token[1].strip()
      if bad.lstrip("+-").lower() in ("inf", "infinity", "nan"):
        raise GinConfigError(f"cannot parse the gin value {bad!r}: gin takes Python literals, "
                             "and numbers here must be finite (bindings: "
                             f"{list(gin_bindings)})") from e
      raise GinConfigError(f"cannot parse the gin value {bad!r}: strings must be quoted, e.g. "
                           f"--gin.NAME=\"'{bad}'\" (bindings: {list(gin_bindings)})") from e
    where = (f"{e.filename}, line {e.lineno}" if e.filename else
             f"gin binding '{e.text.strip()}'" if e.text else "the gin bindings")
    raise GinConfigError(f"{where}: gin syntax error: {e.msg} (gin takes Python literals, "
                         "references @name and %MACRO, not expressions)") from e
  except ValueError as e:  # gin's finalize names the macro, then dumps the whole config
    name = _undefined_macro(e)
    if name is None:
      raise
    raise GinConfigError(f"the macro {name} is referenced (%{name}) but never set: bind it "
                         f"(in a gin file, or --gin.{name}=VALUE) or fix the "
                         "reference") from e
  _check_macros(gin_bindings)


def _unclosed_binding(gin_bindings: Sequence[str]) -> str | None:
  """The first binding that Python's tokenizer cannot finish alone (an unclosed bracket,
  brace or string), or None."""
  for binding in gin_bindings:
    try:
      for _ in tokenize.generate_tokens(io.StringIO(binding + "\n").readline):
        pass
    except (tokenize.TokenError, SyntaxError):
      return binding.strip()
  return None


def _undefined_macro(error: ValueError) -> str | None:
  """The name of the macro gin found no binding for (a %NAME reference nothing sets)."""
  text = str(error)
  head = "No bindings specified for '"
  if text.startswith(head) and "/gin.macro'" in text.split("\n", 1)[0]:
    return text[len(head):].split("/gin.macro'", 1)[0]
  return None


def bound(cls) -> bool:
  """Whether the parsed config binds parameters of `cls` (gin keys: (scope, selector))."""
  import gin
  selector = f"{cls.__module__}.{cls.__name__}"
  return any(sel == selector for _, sel in gin.config._CONFIG)


def _macros_bound(gin_bindings: Sequence[str]) -> list[tuple[str, str]]:
  """(name, binding line) of every macro the command line binds."""
  out = []
  for binding in gin_bindings:
    for line in binding.splitlines():
      name = _binding_name(line)
      if line.strip() and not line.lstrip().startswith("#") and "." not in name \
          and "/" not in name:
        out.append((name, line.strip()))
  return out


def _check_macros_read(gin_bindings: Sequence[str]) -> None:
  """Each macro bound on the command line must have been read by the objects just built:
  one that only unbuilt bindings use (a GAMMA where every decoder carries its own gamma)
  would change nothing."""
  import gin
  read = {scope for scope, selector in gin.config._OPERATIVE_CONFIG
          if selector == "gin.macro"}
  for name, line in _macros_bound(gin_bindings):
    if name not in read:
      raise GinConfigError(f"gin binding '{line}' sets the macro {name}, which none of the "
                           "configured objects reads (the files bind it only where nothing "
                           "is built from it), so it would change nothing")


def build(cls, what: str, example: str, gin_bindings: Sequence[str] = ()) -> Any:
  """An instance of configurable `cls` as the parsed gin files bind it (`what` and an
  example gin file name it in the error when they do not configure one); each macro
  bound in `gin_bindings` must have been read in building it."""
  import gin
  try:
    built = gin.get_configurable(cls)()
  except TypeError as e:
    if "missing" not in str(e):
      raise
    raise GinConfigError(f"the gin files do not configure {what} ({e}); pass "
                         f"--gin_file={example}") from e
  _check_macros_read(gin_bindings)
  return built


def parse_experiment(gin_files: Sequence[str], gin_bindings: Sequence[str]):
  """Parses gin files and bindings and builds the ExperimentConfig they describe.

  Unknown configurables and parameters are errors (gin's default), and so is
  a macro bound in `gin_bindings` that no file uses (`--gin.GAMA=9`).
  """
  from spec_decode.experiment import ExperimentConfig
  parse_gin(gin_files, gin_bindings)
  return build(ExperimentConfig, f"an experiment (files {list(gin_files)})",
               "configs/... (see configs/)", gin_bindings)


def run_experiment(gin_files: Sequence[str], gin_bindings: Sequence[str], output_dir: str, *,
                   show_progress: bool = True) -> dict:
  """Parses the gin files into an ExperimentConfig and runs it into output_dir
  (`experiment.run_experiment`: resumable), then writes gin's operative config there
  (config.gin); returns the summary ({} on processes other than 0). The output directory
  is checked before any model loads."""
  import gin

  from spec_decode import experiment
  from spec_decode.experiment import results
  config = parse_experiment(gin_files, gin_bindings)
  results.check_output_dir(output_dir)
  experiment.progress(f"experiment {', '.join(gin_files)} -> {output_dir}",
                      enabled=show_progress)
  summary = experiment.run_experiment(config, output_dir=output_dir,
                                      show_progress=show_progress)
  if summary:  # process 0 writes
    results.write_text(os.path.join(output_dir, "config.gin"), gin.operative_config_str())
    summary["output_dir"] = output_dir
  return summary
