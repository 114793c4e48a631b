"""The scripted Hugging Face causal LM: moved to codegym_testkit/scripted_lm.py, which the
benchmarks share; the tests keep importing it by this name."""

from codegym_testkit.scripted_lm import *  # noqa: F403
