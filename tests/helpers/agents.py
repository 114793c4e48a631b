"""Scripted agents behind the scripted server: moved to codegym_testkit/agents.py, which the
benchmarks share; the tests keep importing it by this name."""

from codegym_testkit.agents import *  # noqa: F403
