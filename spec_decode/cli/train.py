r"""The training command: runs the training config its gin files bind.

  python -m spec_decode.cli.train --gin_file=configs/demo/ende_small.gin [--gin.NAME=VALUE]

Every training config (`TrainConfig` for T5 models, `EagleTrainConfig`,
`MtpTrainConfig`, `MedusaTrainConfig` for draft heads, or any config registered
with `configurable.register(runnable=True)`) has a `run` method; the gin files
must bind exactly one of them. Errors in what you typed end in one line and
exit code 2 (`--verbose` shows the traceback); Ctrl-C ends in one line saying where the
saved steps are, and exit code 130.
"""

from __future__ import annotations

from typing import Any, Sequence

from absl import app, flags

from spec_decode import configurable
from spec_decode.cli import errors
from spec_decode.cli import gin as gin_layer

PROGRAM = "spec_decode.cli.train"


def parse_config(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> Any:
  """The one training config the gin files bind, built (a `GinConfigError` unless exactly
  one is bound)."""
  gin_layer.parse_gin(gin_files, gin_bindings)
  runnable = configurable.runnable()
  bound = [name for name, cls in runnable.items() if gin_layer.bound(cls)]
  if len(bound) != 1:
    what = "none" if not bound else f"{len(bound)} ({', '.join(bound)})"
    raise gin_layer.GinConfigError(
        f"the gin files {list(gin_files)} must configure one training run of "
        f"{sorted(runnable)}, they configure {what}; pass --gin_file=configs/demo/... "
        "(see configs/demo/)")
  return gin_layer.build(runnable[bound[0]], f"a {bound[0]}", "configs/demo/...", gin_bindings)


def main(argv: Sequence[str]) -> None:
  with errors.handle_errors(PROGRAM):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    errors.quiet_logging()
    cfg = parse_config(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings)
    with errors.one_line_on_interrupt(lambda: interrupted_line(cfg)):
      cfg.run(report=lambda s: print(s, flush=True))
    errors.ignore_late_interrupts()  # done: a Ctrl-C now would only disturb the exit


def interrupted_line(cfg) -> str:
  """What a Ctrl-C leaves of a training run: where its saved steps are and how to go on."""
  workdir = getattr(cfg, "workdir", None)
  if not workdir:
    return (f"{PROGRAM}: interrupted: this run has no workdir, so no step was saved; set "
            f"{type(cfg).__name__}.workdir to make a run resumable")
  every = getattr(cfg, "save_every", None)
  when = f" (saved every {every} steps)" if every else ""
  return (f"{PROGRAM}: interrupted: the train state is saved in {workdir}{when}; rerun the "
          f"same command to resume from its last saved step")


def run_command() -> None:
  gin_layer.define_flags("extra gin bindings, e.g. TrainConfig.num_steps=10")
  errors.define_flags()
  app.run(main, flags_parser=errors.flags_parser(PROGRAM, gin_layer.rewrite_gin_args))


if __name__ == "__main__":
  run_command()
