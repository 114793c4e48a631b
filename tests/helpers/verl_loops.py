"""verl's agent loops built as verl's worker builds them: moved to codegym_testkit/verl_loops.py, which the
benchmarks share; the tests keep importing it by this name."""

from codegym_testkit.verl_loops import *  # noqa: F403
