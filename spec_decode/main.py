"""`python -m spec_decode.main`: the experiment command (`spec_decode.cli.main`).

With no arguments it runs configs/default.gin, the demo EnDe experiment.
"""

if __name__ == "__main__":
  from spec_decode.cli import main

  main.run_command()
