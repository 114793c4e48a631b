"""The scripted OpenAI-compatible server: moved to codegym_testkit/fake_llm.py, which the
benchmarks share; the tests keep importing it by this name."""

from codegym_testkit.fake_llm import *  # noqa: F403
from codegym_testkit.fake_llm import main

if __name__ == "__main__":  # `python -m tests.helpers.fake_llm`, the command the docs give
    main()
