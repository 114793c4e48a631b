"""What the tests and the benchmarks share: scripted models and trainers, a scripted
OpenAI-compatible server and its agents, recorded trajectories as a trainer plays them, waiting.

Why a package of its own: the benchmarks (bench/) used to import tests/helpers, an arrow that
neither the import graph nor tests/test_dependency_direction.py saw. Both now import this; it
imports the servers and the client, never tests/ or bench/. It is not shipped (pyproject.toml's
package list and clients/pyproject.toml leave it out): it runs from a checkout.

The modules the trainers' venv imports (`trainer_script`, `script`, `scripted_lm`, `verl_loops`:
verl, TRL and torch beside the client, no servers) import nothing of the servers at import time.
"""
