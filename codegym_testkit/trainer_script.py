"""Scripted play for the trainer adapters' tests: recorded oracle trajectories (codegym/samples/
trajectories.jsonl) replayed as hermes tool calls (the format verl's `HermesToolParser` and TRL's
Qwen template read), a byte-level tokenizer with a ChatML chat template written here, and a real
Hugging Face tokenizer built offline (`chatml_tokenizer`, which imports transformers when called).
At import it needs only the standard library and the client, so that the tests of the trainers
themselves (tests/test_verl_real.py, tests/test_trl_real.py) can use it from a venv that holds the
trainers and the client, not the servers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from codegym_client.abilities import make_ability
from codegym_client.verl import Episode

SAMPLES = Path(__file__).resolve().parents[1] / "codegym" / "samples"
TRAJECTORIES = [
    json.loads(line)
    for line in (SAMPLES / "trajectories.jsonl").read_text(encoding="utf-8").splitlines()
    if line.strip()
]


def ability(trajectory: dict[str, Any]) -> str:
    return make_ability(trajectory["env_id"], trajectory["config"])


def trajectory(env_id: str, steps: int | None = None) -> dict[str, Any]:
    """The first recorded oracle trajectory of `env_id` (with `steps` steps, when given)."""
    return next(
        t for t in TRAJECTORIES if t["env_id"] == env_id and (steps is None or len(t["steps"]) == steps)
    )


class ByteTokenizer:
    """A tokenizer as verl uses one: one token per byte, a ChatML chat template with a system prompt
    and the tools in it (as Qwen's), tool messages as `<tool_response>` user turns."""

    pad_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

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

    def __init__(self, turns: list[str], tokenizer: Any = TOKENIZER) -> None:
        self.turns = list(turns)
        self.tokenizer = tokenizer
        self.prompts: list[str] = []

    def next_turn(self, prompt_ids: list[int]) -> list[int]:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        text = self.turns.pop(0) if self.turns else "I give up.<|im_end|>"
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def __call__(self, prompt_ids: list[int]) -> Any:
        return SimpleNamespace(token_ids=self.next_turn(prompt_ids), log_probs=None)


def oracle_turns(recorded: dict[str, Any]) -> list[str]:
    return [
        f"<think>Next: {action[:20]}</think>\n{hermes(action)}<|im_end|>" for action, _ in recorded["steps"]
    ]


def model_text(episode: Episode) -> str:
    return TOKENIZER.decode(
        [t for t, m in zip(episode.response_ids, episode.response_mask, strict=True) if m]
    )


# A ChatML template in the manner of Qwen2.5's: the tools in the system prompt, an assistant's tool
# calls as hermes blocks, consecutive tool messages one user turn of `<tool_response>` blocks.
CHATML_TEMPLATE = (  # HF renders with trim_blocks: a newline right after a tag is written as {{ '\\n' }}
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% else %}{% set system = 'You are a helpful assistant.' %}{% endif %}"
    "<|im_start|>system\n{{ system }}"
    "{% if tools %}{{ '\\n\\n' }}# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>{% endif %}<|im_end|>\n"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}{{ '\\n' }}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer(*special: str, template: str = CHATML_TEMPLATE) -> Any:
    """A real Hugging Face fast tokenizer built here, without a hub: one token per byte (byte-level
    BPE with no merges, so `\\n` is one token), `<|im_start|>`, `<|im_end|>` (eos) and
    `<|endoftext|>` (pad) special tokens (and `special`), and a chat template (`CHATML_TEMPLATE`).
    What verl's Qwen Continuous Token builder needs of a Qwen tokenizer. Imports `tokenizers` and `transformers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *special],
    )
    tokenizer.chat_template = template
    return tokenizer


async def call_as_tool_agent_loop(tools: dict[str, Any], action: str, agent_data: Any) -> tuple[Any, float]:
    """One recorded action through verl `BaseTool`s as verl's `ToolAgentLoop._call_tool` drives
    them: a tool instance created, executed once and released, for every single call."""
    call = json.loads(action)
    tool = tools[call["name"]]
    instance_id, _ = await tool.create(create_kwargs={})
    try:
        response, reward, _ = await tool.execute(instance_id, call["parameters"], agent_data=agent_data)
    finally:
        await tool.release(instance_id)
    return response, reward
