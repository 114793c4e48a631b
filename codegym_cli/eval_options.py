"""`codegym eval`: play a model as an agent on every task through the runtime; figures per environment.

    codegym eval --target 127.0.0.1:50051 --library lib.db --llm-base-url URL --model M --samples 4 --out ev1

Writes OUT/episodes.jsonl (one line per counted episode: messages, actions, observations, reward,
turns, tokens, end reason), OUT/failures.jsonl (attempts that failed outside the agent: the
runtime or the LLM endpoint, with their error) and OUT/summary.json (success rate, pass@1, pass@k,
mean turns, tokens, end reasons; per environment, overall and per task config; how many episodes
were not counted and why), and prints the table. Run the same command again after an
interruption or a failure: counted episodes are kept, the rest (failed attempts included) are
played. With --library, each config's success rate over its counted episodes is stored in the
library as `{model}_Bo{k}_score`, which `codegym export` writes into extra_info (and
`--difficulty` filters on); a config with no counted episode gets no score. `--learnability`
plays only the library's task configs a run's served episodes labelled so (`codegym library
label`). Exit code 1 when some episode of this run was not counted.
"""

from __future__ import annotations

import argparse

from codegym_cli.export_options import learnability_argument
from codegym_cli.later import later
from codegym_cli.synthesize import add_llm_arguments
from codegym_client.defaults import DEFAULT_TARGET


def count_or_auto(text: str) -> str:
    """`--give-up-after`: a count ≥ 0, or "auto" (the default depends on --concurrency)."""
    if text != "auto" and not (text.isdigit() and int(text) >= 0):
        raise argparse.ArgumentTypeError(f"a count >= 0 or auto, not {text!r}")
    return text


def register(sub: argparse._SubParsersAction) -> None:
    from codegym.library.location import add_library_argument

    ev = sub.add_parser(
        "eval",
        help="play an OpenAI-compatible model as an agent on every task through the runtime",
        description=__doc__,
    )
    ev.add_argument("--target", default=DEFAULT_TARGET, help="runtime HOST:PORT")
    source = ev.add_mutually_exclusive_group()
    add_library_argument(source, "play every task config of this library")
    source.add_argument("--instances", default="", help="play these training instances (JSONL) instead")
    ev.add_argument("--out", required=True, help="folder for episodes.jsonl and summary.json")
    ev.add_argument("--samples", type=int, default=1, help="episodes per task (K of pass@K)")
    ev.add_argument("--concurrency", type=int, default=8, help="episodes in flight (and LLM requests)")
    ev.add_argument(
        "--tool-mode",
        choices=("text", "json"),
        default="text",
        help="function-call text or native tool calls",
    )
    ev.add_argument(
        "--max-turns", type=int, default=0, help="model replies per episode (0 = plugin_call_max_round)"
    )
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ev.add_argument("--max-tokens", type=int, default=1024, help="completion token cap per reply")
    ev.add_argument("--prefix", default="", help="only env ids starting with this")
    ev.add_argument("--limit", type=int, default=0, help="only the first N tasks (0 = all)")
    ev.add_argument(
        "--learnability",
        type=learnability_argument,
        default=None,
        metavar="LABEL[,LABEL...]",
        help="only the library's configs labelled so by `codegym library label` (unsolved, learnable, mastered)",
    )
    ev.add_argument("--step-timeout-s", type=float, default=60.0, help="deadline of one runtime call")
    ev.add_argument(
        "--wait-s", type=float, default=60.0, help="how long to wait for the runtime to answer at start"
    )
    ev.add_argument(
        "--give-up-after",
        type=count_or_auto,
        default="auto",
        help="start no new episode after this many failed attempts in a row (an outage); "
        "0 = never, auto = max(16, 2 × --concurrency)",
    )
    add_llm_arguments(ev, stages=False)
    ev.set_defaults(func=later("codegym_cli.eval", "cmd_eval"))
