"""The episode's token stream, as verl's agent loops keep it. No verl here.

A `Stream` is the prompt's token ids followed by the response's, with the response's mask (1: the
model's tokens, 0: tool messages) and log-probs. A `Renderer` grows it: the prompt, each model turn
as generated, each turn's tool messages. verl 0.9 grows it with its Continuous Token builder
(`ContinuousTokenRenderer` in codegym_client/verl/agent_loop.py hands the agent loop's own to the
episode); `ChatTemplateRenderer`, the default, is verl 0.8's way, with nothing but a tokenizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["ChatTemplateRenderer", "Renderer", "Stream", "Tokenizer", "as_ids"]


class Tokenizer(Protocol):
    """What the episode needs of a Hugging Face tokenizer."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> str: ...


def as_ids(value: Any) -> list[int]:
    """Token ids from `apply_chat_template(tokenize=True)` (a list, or a mapping in transformers 5)."""
    if isinstance(value, Mapping):
        value = value["input_ids"]
    return [int(i) for i in value]


@dataclass(frozen=True)
class Stream:
    """The episode's token stream as verl's agent loops keep it: `token_ids` is the prompt followed
    by the response; `mask` covers the response (its last `len(mask)` tokens); `logprobs`, when the
    server returns them, too."""

    token_ids: list[int]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: len(self.token_ids) - len(self.mask)]

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - len(self.mask) :]


class Renderer(Protocol):
    """How messages and model turns become tokens of the stream. Each method returns the new
    stream and leaves the one it was given as it was (the episode may decline a longer one)."""

    async def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Stream: ...

    async def model_turn(self, stream: Stream, turn: list[int], logprobs: list[float] | None) -> Stream: ...

    async def messages(
        self,
        stream: Stream,
        previous: list[dict[str, Any]],
        updated: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> Stream: ...


class ChatTemplateRenderer:
    """verl 0.8's `ToolAgentLoop` rendering, with nothing but a tokenizer: the prompt is the chat
    template of the messages with the tools and the generation prompt; a model turn is appended as
    generated; appended messages are rendered alone with the generation prompt and the system
    prompt the template adds to any conversation cut off (`initialize_system_prompt` in verl 0.8's
    verl/utils/chat_template.py)."""

    def __init__(self, tokenizer: Tokenizer, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._system_prompt_len: int | None = None

    async def _render(self, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        def render() -> Any:
            return self.tokenizer.apply_chat_template(
                conversation, tokenize=True, **{**self.template_kwargs, **kwargs}
            )

        return as_ids(await asyncio.get_running_loop().run_in_executor(None, render))

    async def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Stream:
        return Stream(await self._render(messages, tools=tools, add_generation_prompt=True))

    async def model_turn(self, stream: Stream, turn: list[int], logprobs: list[float] | None) -> Stream:
        merged = stream.logprobs
        if logprobs:
            merged = (stream.logprobs or []) + [float(p) for p in logprobs]
        return Stream(stream.token_ids + turn, stream.mask + [1] * len(turn), merged)

    async def messages(
        self,
        stream: Stream,
        previous: list[dict[str, Any]],
        updated: list[dict[str, Any]],
        tools: list[dict[str, Any]],
    ) -> Stream:
        if self._system_prompt_len is None:
            one = await self._render([{"role": "user", "content": ""}], add_generation_prompt=False)
            two = await self._render([{"role": "user", "content": ""}] * 2, add_generation_prompt=False)
            self._system_prompt_len = len(one) - (len(two) - len(one))
        added = (await self._render(updated[len(previous) :], add_generation_prompt=True))[
            self._system_prompt_len :
        ]
        logprobs = stream.logprobs + [0.0] * len(added) if stream.logprobs else stream.logprobs
        return Stream(stream.token_ids + added, stream.mask + [0] * len(added), logprobs)
