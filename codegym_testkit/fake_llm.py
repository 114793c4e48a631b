"""A local OpenAI-compatible chat-completions server with scripted answers (real HTTP).

The real `openai` client talks to it over loopback, so retries, timeouts, `n`, headers and usage
accounting are exercised end to end. A `script` function maps each request body to a `Reply`;
`default_script` answers every stage of the synthesis pipeline with valid output. For the sample
problems of codegym/samples/problems.jsonl it answers with their real sample environments, seeded test
configs (codegym_testkit/sample_configs.py) and each env's own solve() among wrong candidates, so a
pipeline run over those problems ends with a verified library; any other problem gets the
ArrayGcd sample environment renamed per problem.

It also plays as an agent (`codegym eval`): a chat completion whose first user message is
CodeGym's protocol and a sample environment's task (or ArrayGcd's, which the renamed fallback
environments share) is answered with the next tool call of that environment's own solve()
(codegym_testkit/solve_agent.py), as function-call text, or as a native tool call when the request
carries `tools`. Any config of those environments is solved that way, a pipeline's as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from codegym.contract.source import method_source
from codegym_testkit import solve_agent
from codegym_testkit.sample_configs import SAMPLE_CLASSES, sample_configs
from codegym_testkit.solve_agent import (
    QUESTION_MARK,
    first_user_text,
    is_agent_request,
    next_action,
    observations_of,
    tool_call,
)

ENV_DIR = Path(__file__).resolve().parents[1] / "codegym" / "samples" / "envs"
SAMPLE = (ENV_DIR / "Sample_0006_I__ArrayGcdEnv.py").read_text()
SAMPLE_TASK = (ENV_DIR / "Sample_0006_I__ArrayGcdEnv.task.md").read_text().strip()


@dataclass(frozen=True)
class SampleEnv:
    env_class: str
    source: str
    task: str
    path: Path


def _sample_envs() -> dict[str, SampleEnv]:
    """Sample environments by their problem statement (codegym/samples/problems.jsonl → envs/)."""
    by_question: dict[str, SampleEnv] = {}
    for line in (ENV_DIR.parent / "problems.jsonl").read_text().splitlines():
        problem = json.loads(line)
        for path in ENV_DIR.glob(f"{problem['question_id']}__*Env.py"):
            env_class = path.stem.split("__", 1)[1]
            task = path.with_suffix(".task.md").read_text().strip()
            by_question[problem["question"]] = SampleEnv(env_class, path.read_text(), task, path)
    return by_question


SAMPLES_BY_QUESTION = _sample_envs()
SAMPLES_BY_CLASS = {s.env_class: s for s in SAMPLES_BY_QUESTION.values()}


@dataclass
class Reply:
    contents: list[str] = field(default_factory=list)
    status: int = 200
    finish_reason: str = "stop"
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    error: str = ""
    # Per choice, native function calls: [{"id", "type": "function", "function": {"name", "arguments"}}].
    tool_calls: list[list[dict[str, Any]]] = field(default_factory=list)


def stage_of(body: dict[str, Any]) -> str:
    if is_agent_request(body):
        return "agent"
    text = str(body["messages"][-1].get("content") or "")
    if text.startswith("Turn a coding problem"):
        return "environment"
    if text.startswith("Write 5 HARD"):
        return "hard_tests"
    if text.startswith("Write task configs"):
        return "unit_tests"
    if text.startswith("An agent solves a task"):
        return "solve_functions"
    return "unknown"


def own_section(body: dict[str, Any]) -> str:
    """The part of the prompt after the one-shot example."""
    text: str = body["messages"][-1]["content"]
    for marker in ("### Your problem", "### Your environment", "### Your task"):
        if marker in text:
            return text.split(marker, 1)[1]
    return text


def env_class_for(body: dict[str, Any]) -> str:
    """A class name per problem, stable across requests (derived from the prompt's own part)."""
    section = own_section(body)
    if stage_of(body) == "environment":
        return "P" + hashlib.sha1(section.encode()).hexdigest()[:6].upper() + "GcdEnv"
    if stage_of(body) in ("unit_tests", "hard_tests"):  # these stages carry the env source
        return section.split("\nclass ", 1)[1].split("(", 1)[0].strip()
    return ""


def good_env(env_class: str) -> str:
    return f"<task>\n{SAMPLE_TASK}\n</task>\n<env>\n```python\n{SAMPLE.replace('ArrayGcdEnv', env_class)}```\n</env>"


def good_tests(env_class: str, count: int = 15, start: int = 2) -> str:
    lines = [
        f'{env_class}@{{"nums": [{start * (i + 1)}, {start * (i + 2)}, {3 * (i + 1)}]}}' for i in range(count)
    ]
    return "<tests>\n" + "\n".join(lines) + "\n</tests>"


# A correct candidate, as a model following the solve prompt would write it.
GOOD_SOLVE = method_source(SAMPLE, "solve")


def sample_for(body: dict[str, Any]) -> SampleEnv | None:
    """The sample environment a request is about, if any (by problem, env class or task text)."""
    section = own_section(body)
    stage = stage_of(body)
    if stage == "environment":
        return next((s for q, s in SAMPLES_BY_QUESTION.items() if q in section), None)
    if stage in ("unit_tests", "hard_tests"):
        return SAMPLES_BY_CLASS.get(env_class_for(body))
    # ArrayGcd's task is also the fallback environment's: its candidates stay the generic ones.
    return next((s for s in SAMPLES_BY_CLASS.values() if s.task in section and s.task != SAMPLE_TASK), None)


def sample_tests(sample: SampleEnv, count: int, seed: int, hard: bool) -> str:
    assert sample.env_class in SAMPLE_CLASSES
    configs = sample_configs(sample.env_class, count, seed, hard=hard)
    return "<tests>\n" + "\n".join(f"{sample.env_class}@{json.dumps(c)}" for c in configs) + "\n</tests>"


def sample_script(body: dict[str, Any], sample: SampleEnv) -> Reply:
    n = int(body.get("n") or 1)
    stage = stage_of(body)
    if stage == "environment":
        return Reply([f"<task>\n{sample.task}\n</task>\n<env>\n```python\n{sample.source}```\n</env>"] * n)
    if stage == "unit_tests":
        return Reply([sample_tests(sample, 15, seed=i, hard=False) for i in range(n)])
    if stage == "hard_tests":
        return Reply([sample_tests(sample, 5, seed=100 + i, hard=True) for i in range(n)])
    good = method_source(sample.source, "solve")
    wrong = (
        "def solve(self):\n    import json\n"
        "    return self.step(json.dumps({'name': 'Done', 'parameters': {'answer': 0}}))[1]\n"
    )
    # A few wrong candidates first: the oracle is not simply the first one.
    variants = [f"<answer>\n{wrong}</answer>", "no code here", f"<answer>\n{good}</answer>"]
    return Reply([variants[i % len(variants)] for i in range(n)])


def sample_by_task(user_text: str) -> SampleEnv | None:
    """The sample environment whose task statement is the agent's question (the longest wins)."""
    question = user_text.split(QUESTION_MARK, 1)[-1]
    matches = [s for s in SAMPLES_BY_CLASS.values() if s.task and s.task in question]
    return max(matches, key=lambda s: len(s.task), default=None)


def agent_script(body: dict[str, Any]) -> Reply:
    """An agent's turn: the oracle's next tool call (a reply without one when it has none)."""
    n = int(body.get("n") or 1)
    messages = body["messages"]
    sample = sample_by_task(first_user_text(messages))
    if sample is None:
        return Reply(["I do not know this task, so I call no tool."] * n)
    seen = observations_of(messages)
    action = next_action(sample.path, sample.env_class, seen)
    if action is None:
        return Reply(["I have no tool left to call."] * n)
    if body.get("tools"):
        return Reply([""] * n, tool_calls=[[tool_call(action, len(seen))]] * n)
    return Reply([f"<|FunctionCallBegin|>[{action}]<|FunctionCallEnd|>"] * n)


def default_script(body: dict[str, Any]) -> Reply:
    n = int(body.get("n") or 1)
    stage = stage_of(body)
    if stage == "agent":
        return agent_script(body)
    sample = sample_for(body)
    if sample is not None:
        return sample_script(body, sample)
    env_class = env_class_for(body)
    if stage == "environment":
        return Reply([good_env(env_class)] * n)
    if stage == "unit_tests":
        return Reply([good_tests(env_class, start=2 + i) for i in range(n)])
    if stage == "hard_tests":
        return Reply([good_tests(env_class, count=5, start=1000 + i) for i in range(n)])
    if stage == "solve_functions":
        variants = [
            f"<think>try</think><answer>\n{GOOD_SOLVE}</answer>",
            f"<answer>\n```python\n{GOOD_SOLVE}```\n</answer>",
            "I would loop over the elements.",
        ]
        return Reply([variants[i % len(variants)] for i in range(n)])
    return Reply(status=400, error="unexpected prompt")


class ScriptedLLM:
    """Serve `script` on 127.0.0.1:0 in a thread; every request body is kept in `requests`."""

    def __init__(
        self,
        script: Callable[[dict[str, Any]], Reply] = default_script,
        *,
        n_supported: bool = True,
        port: int = 0,
    ) -> None:
        self.script = script
        self.n_supported = n_supported
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                with outer.lock:
                    outer.requests.append(body)
                if int(body.get("n") or 1) > 1 and not outer.n_supported:
                    self._send(
                        400, {"error": {"message": "n > 1 is not supported", "type": "invalid_request_error"}}
                    )
                    return
                reply = outer.script(body)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                if reply.status != 200:
                    self._send(
                        reply.status, {"error": {"message": reply.error or "scripted error"}}, reply.headers
                    )
                    return
                prompt_tokens = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4
                completion_tokens = sum(len(c) for c in reply.contents) // 4
                self._send(
                    200,
                    {
                        "id": "chatcmpl-scripted",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": body.get("model", "scripted"),
                        "choices": [
                            {
                                "index": i,
                                "message": {"role": "assistant", "content": c}
                                | ({"tool_calls": reply.tool_calls[i]} if i < len(reply.tool_calls) else {}),
                                "finish_reason": "tool_calls"
                                if i < len(reply.tool_calls)
                                else reply.finish_reason,
                            }
                            for i, c in enumerate(reply.contents)
                        ],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                        },
                    },
                    reply.headers,
                )

            def _send(
                self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> ScriptedLLM:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        solve_agent.stop()  # the agent's child interpreter, if it played (restarted on demand)

    def count(self, stage: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if stage is None or stage_of(r) == stage)


def main() -> None:
    """Serve until Ctrl-C (`python -m codegym_testkit.fake_llm`, the path the docs give)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m codegym_testkit.fake_llm",
        description="A scripted OpenAI-compatible server on 127.0.0.1, to try `codegym synthesize`, "
        "`codegym pipeline run` and `codegym eval` (it plays the sample environments as their oracle "
        "would) without a model; it prints the base URL to pass as --llm-base-url. "
        "Example: python -m codegym_testkit.fake_llm --port 8000",
    )
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    options = parser.parse_args()
    with ScriptedLLM(port=options.port) as llm:
        print(f"scripted OpenAI-compatible server at {llm.base_url} (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
