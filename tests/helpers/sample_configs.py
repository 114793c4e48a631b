"""Seeded test configs of the sample environments: moved to codegym_testkit/sample_configs.py, which the
benchmarks share; the tests keep importing it by this name."""

from codegym_testkit.sample_configs import *  # noqa: F403
