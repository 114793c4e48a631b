"""A scripted model for the verl adapter's tests: recorded oracle trajectories (examples/
trajectories.jsonl) replayed as hermes tool calls, the format verl's `HermesToolParser` reads, and a
byte-level tokenizer with a ChatML chat template written here. Imports only the standard library and
pytest, so that the tests of verl's own classes (tests/test_verl_real.py) can use it from a venv that
holds verl and the client, not the servers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from codegym_client.verl import Episode

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRAJECTORIES = [
    json.loads(line)
    for line in (EXAMPLES / "trajectories.jsonl").read_text(encoding="utf-8").splitlines()
    if line.strip()
]


def ability(trajectory: dict[str, Any]) -> str:
    return f"codegym_v1@{trajectory['env_id']}@{json.dumps(trajectory['config'])}"


def trajectory(env_id: str, steps: int | None = None) -> dict[str, Any]:
    """The first recorded oracle trajectory of `env_id` (with `steps` steps, when given)."""
    return next(
        t for t in TRAJECTORIES if t["env_id"] == env_id and (steps is None or len(t["steps"]) == steps)
    )


class ByteTokenizer:
    """A tokenizer as verl uses one: one token per byte, a ChatML chat template with a system prompt
    and the tools in it (as Qwen's), tool messages as `<tool_response>` user turns."""

    pad_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        text = "<|im_start|>system\nYou are a helpful assistant."
        if tools:
            text += "\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>"
        text += "<|im_end|>\n"
        for message in conversation:
            if message["role"] == "tool":
                text += (
                    f"<|im_start|>user\n<tool_response>\n{message['content']}\n</tool_response><|im_end|>\n"
                )
            else:
                text += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


TOKENIZER = ByteTokenizer()


def hermes(action: str) -> str:
    call = json.loads(action)
    return f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': call['parameters']})}\n</tool_call>"


class ScriptedModel:
    """`generate` replaying turns (text) in order, recording every prompt it was given."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)
        self.prompts: list[str] = []

    async def __call__(self, prompt_ids: list[int]) -> Any:
        self.prompts.append(TOKENIZER.decode(prompt_ids))
        text = self.turns.pop(0) if self.turns else "I give up.<|im_end|>"
        return SimpleNamespace(token_ids=TOKENIZER.encode(text), log_probs=None)


def oracle_turns(recorded: dict[str, Any]) -> list[str]:
    return [
        f"<think>Next: {action[:20]}</think>\n{hermes(action)}<|im_end|>" for action, _ in recorded["steps"]
    ]


def model_text(episode: Episode) -> str:
    return TOKENIZER.decode(
        [t for t, m in zip(episode.response_ids, episode.response_mask, strict=True) if m]
    )
