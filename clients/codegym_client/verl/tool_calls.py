"""A model turn's tool calls, read without verl: the parse functions `run_episode` takes.

A parse function gets the turn's token ids outside `<think>...</think>` (`visible_text`: verl's
hermes parser reads calls anywhere, so a call the model only thought about would be run) and the
session's tool schemas, and returns the turn's calls as (name, arguments as JSON text), as verl's
`FunctionCall` carries them. `text_tool_parser` reads the hermes format (verl's default) or CodeGym's
text protocol; `verl_tool_parser` (codegym_client/verl/agent_loop.py) wraps verl's own parsers.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from codegym_client.actions import ActionParseError, parse_function_calls
from codegym_client.verl.tokens import Tokenizer

__all__ = ["TEXT_FORMATS", "ParseToolCalls", "ToolCall", "text_tool_parser", "visible_text"]

log = logging.getLogger(__name__)

ToolCall = tuple[str, str]  # (name, arguments as JSON text), as verl's FunctionCall carries them
# (the turn's token ids outside <think>, the session's tool schemas) -> the turn's calls
ParseToolCalls = Callable[[list[int], list[dict[str, Any]]], Awaitable[list[ToolCall]]]

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def visible_text(text: str) -> str:
    """`text` without its reasoning: `<think>...</think>` blocks removed, everything before an
    unmatched `</think>` (templates that open the think block in the prompt) and everything after
    an unmatched `<think>` (reasoning cut off by the length limit)."""
    text = _THINK.sub("", text)
    _, closed, after = text.rpartition("</think>")
    if closed:
        text = after
    opened = text.find("<think>")
    return text if opened < 0 else text[:opened]


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes_calls(text: str) -> list[ToolCall]:
    """verl's HermesToolParser on text: each `<tool_call>{"name", "arguments"}</tool_call>`; a
    block that does not parse is dropped (as verl logs and drops it)."""
    calls: list[ToolCall] = []
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
            calls.append((str(call["name"]), json.dumps(call["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError) as exc:
            log.debug("dropping a tool call that does not parse: %s", exc)
    return calls


def _codegym_calls(text: str) -> list[ToolCall]:
    """CodeGym's text protocol (`<|FunctionCallBegin|>[...]<|FunctionCallEnd|>`, the last block)."""
    try:
        actions = parse_function_calls(text)
    except ActionParseError:
        return []
    return [(a.name, json.dumps(a.parameters, ensure_ascii=False)) for a in actions]


TEXT_FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": _hermes_calls,
    "codegym": _codegym_calls,
}


def text_tool_parser(format: str, tokenizer: Tokenizer) -> ParseToolCalls:
    """A parser for `format` that needs no verl: `hermes` (verl's default format) or `codegym`."""
    try:
        parse = TEXT_FORMATS[format]
    except KeyError:
        raise ValueError(f"no built-in parser for format {format!r}: {sorted(TEXT_FORMATS)}") from None

    async def parse_ids(ids: list[int], tools: list[dict[str, Any]]) -> list[ToolCall]:
        return parse(tokenizer.decode(ids, skip_special_tokens=False))

    return parse_ids
