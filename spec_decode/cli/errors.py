"""What the command lines share: errors and console output.

A known error -- bad input the person running the command can fix -- ends the
command with ONE line on stderr naming the problem (and, where the message
has one, the fix) and exit code 2; `--verbose` adds the traceback. Anything
else is a bug and keeps Python's traceback (exit code 1).

  def main(argv):
    with errors.handle_errors("spec_decode.main"):
      ...

Known errors are `KNOWN_ERRORS`: ValueError (which CheckpointError and gin's
binding errors are), OSError (missing files, permissions, time-outs),
SyntaxError from gin's parser, and ImportError of an optional extra (the line
says which extra to install). Running out of memory (XLA's RESOURCE_EXHAUSTED, a
MemoryError) is one line with exit code 2 too, naming the allocation and what to lower,
and so is a backend JAX cannot start (JAX_PLATFORMS naming one that is not installed).

`quiet_logging()` keeps INFO chatter (JAX's platform probing, TensorFlow's CUDA
probing) off the console unless --verbose.
"""

from __future__ import annotations

import _thread
import contextlib
import logging as py_logging
import os
import re
import signal
import sys
import threading
import traceback
from typing import Callable

from absl import flags, logging

EXIT_USAGE = 2
KNOWN_ERRORS = (ValueError, OSError, SyntaxError, ImportError)

# Modules of the optional extras of setup.py, so a missing one names its extra.
EXTRAS = {
    "data": ("seqio", "tensorflow", "tensorflow_text", "tensorflow_datasets", "sacrebleu",
             "rouge_score", "importlib_resources"),
    "test": ("pytest", "scipy", "torch", "transformers", "matplotlib"),
}



def define_flags() -> None:
  """--verbose (once per process; each command defines it when it runs)."""
  if "verbose" not in flags.FLAGS:
    flags.DEFINE_bool("verbose", False, "on an error, print the traceback; log at INFO")


def _verbose() -> bool:
  try:
    return bool(flags.FLAGS.verbose)
  except (flags.UnparsedFlagAccessError, AttributeError):
    return False


def missing_extra(error: BaseException) -> str | None:
  """The setup.py extra whose module an ImportError lacks, or None."""
  if not isinstance(error, ImportError):
    return None
  top = (getattr(error, "name", None) or "").split(".")[0]
  return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def is_known(error: BaseException) -> bool:
  if isinstance(error, ImportError):
    return missing_extra(error) is not None  # any other failed import is a bug
  return isinstance(error, KNOWN_ERRORS)


# The line gin adds to an error raised inside a configurable's call.
_GIN_CALL = re.compile(r"In call to configurable '([^']+)' \(<[^>]*>\)$")


def _gin_call_lines(lines: list[str]) -> list[str]:
  """`lines` with gin's "In call to configurable 'X' (<class ...>)" dropped where the
  message already names X (the project's checks name the setting: 'X.field must be ..'),
  else shortened to "in gin configurable X"."""
  named = " ".join(line for line in lines if not _GIN_CALL.match(line))
  out = []
  for line in lines:
    m = _GIN_CALL.match(line)
    if m is None:
      out.append(line)
    elif m.group(1).rsplit("/", 1)[-1].rsplit(".", 1)[-1] not in named:
      out.append(f"in gin configurable {m.group(1)}")
  return out


def describe(error: BaseException) -> str:
  """One line: the problem and, where known, the fix."""
  extra = missing_extra(error)
  if extra:
    top = error.name.split(".")[0]
    return (f"the optional module {top!r} is not installed; install the [{extra}] extra: "
            f"pip install -e '.[{extra}]'")
  text = str(error) or type(error).__name__
  if isinstance(error, OSError) and error.filename and error.strerror:
    text = f"{error.strerror}: {error.filename}"
  lines = _gin_call_lines([line.strip() for line in text.splitlines() if line.strip()])
  return f"{type(error).__name__}: " + " | ".join(lines)


def flags_parser(program: str, rewrite: Callable[[list[str]], list[str]] = list):
  """A `flags_parser` for absl's app.run: parses the command line (after `rewrite`), and
  an unknown flag or a bad value (a non-boolean for a boolean flag) ends the command with
  one line and exit code 2 instead of absl's traceback."""
  def parse(argv):
    try:
      return flags.FLAGS(rewrite(argv))
    except flags.Error as e:
      # absl words a bad boolean as "flag --x=maybe: ('Non-boolean argument to boolean
      # flag', 'maybe')": the reason and the value as a tuple; say it as a sentence.
      text = re.sub(r"\('([^']*)', ('[^']*'|\S+?)\)", r"\1 \2", str(e))
      print(f"{program}: error: {text} (--helpfull lists the flags)", file=sys.stderr,
            flush=True)
      raise SystemExit(EXIT_USAGE) from None
  return parse


def out_of_memory(error: BaseException) -> str | None:
  """One line for an allocation that failed (XLA's RESOURCE_EXHAUSTED, a MemoryError from
  numpy or Python), or None for any other error."""
  text = str(error)
  if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") \
      and "RESOURCE_EXHAUSTED" in text:
    first = next((line.strip() for line in text.splitlines() if line.strip()), text)
    return (f"out of memory: {first}; the decode did not fit on the device: lower the batch "
            "size, gamma or max_decode_len (spec_decode.cli.memory plans a run's memory)")
  if isinstance(error, MemoryError):
    return (f"out of memory: {text or type(error).__name__}; lower the batch size, gamma or "
            "max_decode_len")
  return None


def backend_unavailable(error: BaseException) -> str | None:
  """One line when JAX cannot start the backend asked for (JAX_PLATFORMS names one this
  installation lacks), or None."""
  text = str(error)
  if isinstance(error, RuntimeError) and text.startswith("Unable to initialize backend"):
    return (f"{text.splitlines()[0]} (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}; "
            "unset it to use the backends this installation has)")
  return None


@contextlib.contextmanager
def handle_errors(program: str, *, verbose: bool | None = None,
                  hint: str = "--verbose shows the traceback"):
  """Turns a known error -- or running out of memory -- into one line on stderr and exit
  code 2 (SystemExit). hint: how to see the traceback instead, said at the line's end."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    line = describe(e) if is_known(e) else (out_of_memory(e) or backend_unavailable(e))
    if line is None:
      raise
    if verbose if verbose is not None else _verbose():
      traceback.print_exc()
    else:
      print(f"{program}: error: {line} ({hint})",
            file=sys.stderr, flush=True)
    raise SystemExit(EXIT_USAGE) from None


@contextlib.contextmanager
def interrupts_not_swallowed(delay_s: float = 0.05):
  """A Ctrl-C whose KeyboardInterrupt is raised inside a callback Python runs for C code
  (JAX's garbage-collection callback, a finalizer) is only reported by Python, as
  'Exception ignored in ...' and a traceback, and the command goes on as if no key had been
  pressed. While this is active, such an interrupt is not printed and is raised again in
  the main thread `delay_s` later, where it ends the command as every Ctrl-C does."""
  previous = sys.unraisablehook

  def hook(unraisable):
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
      timer = threading.Timer(delay_s, _thread.interrupt_main)
      timer.daemon = True
      timer.start()
      return
    previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  finally:
    sys.unraisablehook = previous


EXIT_INTERRUPTED = 130  # as a shell reports a process ended by SIGINT


@contextlib.contextmanager
def one_line_on_interrupt(line: Callable[[], str]):
  """A command's Ctrl-C (also one Python would swallow, `interrupts_not_swallowed`) ends it
  with line() on stderr and exit code EXIT_INTERRUPTED, at once (`exit_now`); with
  --verbose the KeyboardInterrupt propagates with its traceback."""
  try:
    with interrupts_not_swallowed():
      yield
  except KeyboardInterrupt:
    if _verbose():
      raise
    print(f"\n{line()}", file=sys.stderr, flush=True)
    exit_now(EXIT_INTERRUPTED)


def ignore_late_interrupts() -> None:
  """For a command whose work is done and written: a Ctrl-C from here on (during the
  interpreter's shutdown and JAX's exit hooks) is ignored. Otherwise one that arrives as a
  finished run exits raises KeyboardInterrupt inside an exit hook, which prints 'Exception
  ignored in atexit callback' and a traceback, and the command still exits 0 (a toy run
  that finished within 3 s of its start of compilation on an AMD EPYC of family 26, with its
  programs in the compile cache). Main thread only, where Python's signal handlers live."""
  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def exit_now(code: int) -> None:
  """Ends the process with `code` at once, after flushing stdout and stderr, without the
  interpreter's shutdown: after a Ctrl-C during compilation, XLA's compiler threads are
  still running, and tearing the interpreter down under them crashed the process
  (segmentation fault, exit 139) after its one line. Files the command writes are closed
  by then (their `with` blocks have unwound) and its lock is released by the kernel."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(code)


def quiet_logging() -> None:
  """Only warnings and errors on the console unless --verbose (or an explicit -v)."""
  if _verbose() or flags.FLAGS["verbosity"].present:
    return
  logging.set_verbosity(logging.WARNING)
  for name in ("jax._src.xla_bridge", "jax"):
    py_logging.getLogger(name).setLevel(py_logging.WARNING)
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's C++ CUDA probing
