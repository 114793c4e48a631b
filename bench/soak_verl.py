"""Soak through verl itself: `CodeGymAgentLoop` built and run the way verl's `AgentLoopWorker` does,
many episodes in flight, against a runtime that may be failing underneath.

Why: bench/soak.py's verl path calls `run_episode` (the episode `CodeGymAgentLoop` plays) from the
project's venv, which has no verl or torch. What verl trains on is what the agent loop class hands
it: the `AgentLoopOutput` built by verl's own base class, its Continuous Token builder (Qwen's
boundary tokens), verl's hermes `ToolParser`, and the mask the loop sets on a row a fault ended.
This runs that class, in the trainers' venv, so a soak can check the rows verl would get while
`bench/soak.py` (or anything else) restarts runtimes, kills or freezes workers and restarts Redis.

How: run in the trainers venv (verl 0.9.1, torch CPU, the client installed editable), from the repo
root, against a runtime serving the sample library (`codegym up`, or tests/helpers/with_runtime.py):

    .venv-trainers/bin/python bench/soak_verl.py --target HOST:PORT[,HOST:PORT] --minutes M \\
        [--rollouts 8] [--think-s 1] [--outage-wait-s 600] [--seed N]

The loop is built as tests/test_verl_real.py builds it (codegym_testkit/verl_loops.py):
examples/verl/codegym_agent_loop.yaml registered in verl's `_agent_loop_registry`, instantiated
with hydra with verl's wrappers and the part of the trainer config the loops read, a real Hugging
Face tokenizer with a ChatML template (`chatml_tokenizer`: one token per byte, Qwen's special
tokens) and `hf_model_type="qwen2"`. One loop instance per episode (verl builds one per row); the
runtime client is the loop's own, shared per process (`shared_client`). The server manager is
scripted, one per episode: its `generate` waits a think time (uniform 0.5-1.5 x `--think-s`), then
answers the recording's next action (codegym/samples/trajectories.jsonl) as a hermes tool call
after a short `<think>`. The response length and tool-response limit are far above the longest
recording, so neither cuts an episode.

`--rollouts` episodes are kept in flight (each: a random recording, `run(sampling_params,
ability=..., raw_prompt=...)` as verl calls it, then the next) until `--minutes` have passed; the
episodes then in flight are let finish. One JSON line per episode on stdout, flushed:

    {"path": "verl", "env_id": ..., "outcome": ..., "reason": ..., "steps": ..., "example": ...}

  finished  the environment ended the episode after every recorded step, and every observation
            the model was shown is the recorded one (the final answer's is never shown)
  shaped    an observation the model was shown differs from the recording: recovered from what
            verl trains on, the response tokens with mask 0 (the tool messages), decoded and
            read between `<tool_response>` tags, in order. A fault must never cause this.
  failed    `codegym_infrastructure_failure` is set (reason: `codegym_failure_reason`) and the
            row's response mask is all zeros, so verl learns nothing from it
  lost      an exception escaped `run` (in verl it fails the worker), a failed row whose mask is
            not all zeros ("failed row not masked"), or the episode stopped otherwise (the stop
            reason: max_turns, no_tool_call, response_length, ...)

A summary (episodes per minute, outcomes) goes to stderr with the logs. Exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from bench.judge import Judge  # noqa: E402
from codegym_client.verl import CodeGymAgentLoop  # noqa: E402
from codegym_testkit.trainer_script import TRAJECTORIES, ability, chatml_tokenizer, oracle_turns  # noqa: E402
from codegym_testkit.verl_loops import instantiate, our_entry, trainer_config  # noqa: E402

PROMPT = [{"role": "user", "content": "Solve the task with the tools."}]
# One token per byte: the longest recording is ~45 KB of turns and observations; verl's usual
# 8,192 would cut it. The tool-response limit is far above any recorded observation (170 chars).
RESPONSE_TOKENS = 1 << 20
TOOL_RESPONSE_CHARS = 1 << 16
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)

log = logging.getLogger("soak_verl")


class ThinkingServer:
    """verl's `LLMServerClient.generate` as the loop calls it: thinks, then answers the recording's
    next action as a hermes tool call (a give-up turn, no call, once the recording is played)."""

    def __init__(self, line: dict[str, Any], tokenizer: Any, rng: random.Random, think_s: float) -> None:
        self.turns = oracle_turns(line)
        self.tokenizer = tokenizer
        self.rng = rng
        self.think_s = think_s
        self.request_ids: list[str] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: Any, **_: Any
    ) -> Any:
        self.request_ids.append(request_id)
        await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.think_s)
        text = self.turns.pop(0) if self.turns else "I give up.<|im_end|>"
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return TokenOutput(token_ids=ids, log_probs=None, num_preempted=0)


def shown_observations(output: Any, tokenizer: Any) -> list[str]:
    """The tool responses in what verl trains on: each run of response tokens with mask 0 (what
    the model did not generate) decoded, and the `<tool_response>` contents in it, in order."""
    shown: list[str] = []
    run: list[int] = []
    for token, mask in [*zip(output.response_ids, output.response_mask, strict=True), (None, 1)]:
        if mask == 0:
            run.append(int(token))
        elif run:
            shown += TOOL_RESPONSE.findall(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return shown


def classify(line: dict[str, Any], output: Any, tokenizer: Any) -> dict[str, Any]:
    """One episode's line (without the exception case) from the `AgentLoopOutput` verl gets: a
    failed row must be masked whole (what only verl can get wrong), then bench/judge.py's verdict."""
    extra = output.extra_fields
    steps = int(extra.get("codegym_steps") or 0)
    result = {
        "path": "verl",
        "env_id": line["env_id"],
        "outcome": "",
        "reason": "",
        "steps": steps,
        "example": "",
    }
    failed = bool(extra.get("codegym_infrastructure_failure"))
    if failed and any(output.response_mask):
        trained = sum(1 for m in output.response_mask if m)
        return result | {
            "outcome": "lost",
            "reason": "failed row not masked",
            "example": f"{trained} of {len(output.response_mask)} response tokens with mask 1; "
            f"{extra.get('codegym_failure_reason')}"[:300],
        }
    judge = Judge(line)
    for observation in shown_observations(output, tokenizer):
        judge.saw(observation)
    verdict = judge.verdict(
        failure=str(extra.get("codegym_failure_reason") or "infrastructure") if failed else None,
        done=bool(extra.get("codegym_done")),
        steps=steps,
        reward=float(output.reward_score or 0.0),
        last_shown=False,  # the final answer's observation is never shown
        stop=f"stop={extra.get('codegym_stop')}",
    )
    example = verdict.example
    if verdict.outcome == "lost":
        example += f", done={extra.get('codegym_done')}, truncated={extra.get('codegym_truncated')}"
    return result | {"outcome": verdict.outcome, "reason": verdict.reason, "example": example}


async def episode(
    line: dict[str, Any], entry: Any, config: Any, tokenizer: Any, rng: random.Random, think_s: float
) -> dict[str, Any]:
    server = ThinkingServer(line, tokenizer, rng, think_s)
    try:
        loop = instantiate(entry, config, server, tokenizer)
        assert isinstance(loop, CodeGymAgentLoop)
        output = await loop.run({"temperature": 1.0}, ability=ability(line), raw_prompt=PROMPT)
    except Exception as exc:  # out of an agent loop: verl's worker fails
        log.exception("an exception escaped CodeGymAgentLoop.run (%s)", line["env_id"])
        return {
            "path": "verl",
            "env_id": line["env_id"],
            "outcome": "lost",
            "reason": f"exception: {type(exc).__name__}",
            "steps": 0,
            "example": str(exc)[:300],
        }
    return classify(line, output, tokenizer)


async def soak(args: argparse.Namespace) -> Counter[str]:
    tokenizer = chatml_tokenizer()
    config = trainer_config(RESPONSE_TOKENS, max_tool_response_length=TOOL_RESPONSE_CHARS)
    entry = our_entry(args.target, outage_wait_s=args.outage_wait_s)
    lines = [t for t in TRAJECTORIES if t.get("steps")]
    master = random.Random(args.seed)
    started = time.monotonic()
    until = started + args.minutes * 60
    outcomes: Counter[str] = Counter()
    steps = [0]

    async def slot(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            result = await episode(rng.choice(lines), entry, config, tokenizer, rng, args.think_s)
            outcomes[result["outcome"]] += 1
            steps[0] += result["steps"]
            print(json.dumps(result), flush=True)

    await asyncio.gather(*(slot(master.randrange(1 << 30)) for _ in range(max(1, args.rollouts))))
    elapsed = time.monotonic() - started
    total = sum(outcomes.values())
    log.info(
        "%d episodes, %d steps in %.1f min (%.1f episodes per min; %d in flight, think %.2f s): %s",
        total,
        steps[0],
        elapsed / 60,
        total / max(elapsed / 60, 1e-9),
        args.rollouts,
        args.think_s,
        dict(outcomes),
    )
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the runtime, HOST:PORT[,HOST:PORT]")
    parser.add_argument("--minutes", type=float, required=True, help="how long episodes are started")
    parser.add_argument("--rollouts", type=int, default=8, help="episodes in flight")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time before each model turn")
    parser.add_argument(
        "--outage-wait-s", type=float, default=600.0, help="the agent loop's outage wait (its default)"
    )
    parser.add_argument("--seed", type=int, default=None, help="for the recordings and think times")
    args = parser.parse_args()
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,  # verl's import configures the root logger already
    )
    for name in ("soak_verl", "codegym_client"):  # not verl's per-loop INFO lines
        logging.getLogger(name).setLevel(logging.INFO)
    asyncio.run(soak(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
