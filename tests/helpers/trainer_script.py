"""Scripted play for the trainer adapters' tests: moved to codegym_testkit/trainer_script.py, which the
benchmarks share; the tests keep importing it by this name."""

from codegym_testkit.trainer_script import *  # noqa: F403
