"""The XLA flags every test process compiles with: conftest.py sets them for the suite's own
processes, and a test that starts processes with a device count of its own passes
`flags(devices)`, so every program a test compares compiles alike (see conftest.py)."""

CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                 "--xla_cpu_parallel_codegen_split_count=1")


def flags(devices: int) -> str:
  """XLA_FLAGS for a process simulating `devices` CPU devices."""
  return " ".join((f"--xla_force_host_platform_device_count={devices}",) + CHEAP_COMPILE)
