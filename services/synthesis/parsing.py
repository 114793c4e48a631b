"""Reading LLM output: explicit markers, `ast`, the contract checker; never substring guesses.

- Reasoning (`... </think>`) is dropped before looking for markers.
- The *last complete* `<tag>...</tag>` block is the answer (earlier ones are drafts).
- Code is validated by parsing it; the env class is found in the syntax tree.
- A solve candidate is spliced into the env source by replacing the `solve` method's line span.
Every rejection carries a reason a person can act on.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from codegym.contract import EnvStringError, analyze_source, parse_env_str
from codegym.contract.source import find_env_classes, find_method, method_span

FENCE = re.compile(r"^\s*```[\w+-]*\s*\n(.*?)\n\s*```\s*$", re.DOTALL)
DIFFICULTY_BY_BLOCK = ("easy", "medium", "hard")


@dataclass
class ParsedEnv:
    status: str  # ok | missing_marker | syntax_error | contract_violation | truncated
    reasons: list[str] = field(default_factory=list)
    task_text: str = ""
    env_source: str = ""
    env_class: str = ""


@dataclass
class ParsedTest:
    status: str  # ok | invalid_test
    reason: str = ""
    env_str: str = ""
    config_json: str = ""
    difficulty: str = ""


@dataclass
class ParsedSolve:
    status: str  # ok | missing_marker | syntax_error | contract_violation | truncated
    reasons: list[str] = field(default_factory=list)
    solve_source: str = ""
    env_source: str = ""


def drop_reasoning(text: str) -> str:
    """Everything after the last `</think>` (models that think aloud put the answer after it)."""
    _, sep, after = text.rpartition("</think>")
    return after if sep else text


def last_block(text: str, tag: str) -> str | None:
    """Content of the last complete `<tag>...</tag>` block, or None."""
    close = f"</{tag}>"
    end = text.rfind(close)
    if end < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return text[start + len(tag) + 2 : end]


def unfence(code: str) -> str:
    """Code without a surrounding Markdown fence, with a trailing newline."""
    match = FENCE.match(code.strip("\n"))
    body = match.group(1) if match else code
    return body.strip("\n") + "\n"


def parse_env_output(text: str, finish_reason: str = "stop") -> ParsedEnv:
    answer = drop_reasoning(text)
    task = last_block(answer, "task")
    env = last_block(answer, "env")
    if task is None or env is None:
        missing = [name for name, block in (("<task>", task), ("<env>", env)) if block is None]
        if finish_reason == "length":
            return ParsedEnv(
                "truncated", [f"completion cut by the token limit before {' and '.join(missing)} closed"]
            )
        return ParsedEnv("missing_marker", [f"no complete {' or '.join(missing)} block"])
    source = unfence(env)
    task_text = task.strip()
    if not task_text:
        return ParsedEnv("missing_marker", ["the <task> block is empty"], env_source=source)
    try:
        ast.parse(source)
    except SyntaxError as exc:
        return ParsedEnv("syntax_error", [f"env source line {exc.lineno}: {exc.msg}"], task_text, source)
    spec = analyze_source(source)
    if spec.violations:
        reasons = [
            f"{v.code}: {v.message}" + (f" (line {v.line})" if v.line else "") for v in spec.violations
        ]
        return ParsedEnv("contract_violation", reasons, task_text, source, spec.class_name)
    if "solve" not in spec.methods:
        return ParsedEnv(
            "contract_violation", ["missing_method: no solve()"], task_text, source, spec.class_name
        )
    return ParsedEnv("ok", [], task_text, source, spec.class_name)


def parse_test_lines(text: str, env_class: str, *, hard: bool = False) -> list[ParsedTest]:
    """One `Env@{json}` per line; difficulty by position (5 easy, 5 medium, 5 hard) unless `hard`."""
    answer = drop_reasoning(text)
    block = last_block(answer, "tests")
    body = block if block is not None else answer
    lines = [ln.strip() for ln in body.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("```") and not ln.startswith("#")]
    tests: list[ParsedTest] = []
    for index, line in enumerate(lines):
        difficulty = "hard" if hard else DIFFICULTY_BY_BLOCK[min(index // 5, 2)]
        name, sep, config = line.partition("@")
        if not sep:
            tests.append(ParsedTest("invalid_test", f"line {index + 1}: not 'Env@{{json}}': {line[:80]}"))
            continue
        if name.strip() != env_class:
            tests.append(
                ParsedTest("invalid_test", f"line {index + 1}: names {name.strip()!r}, not {env_class}", line)
            )
            continue
        try:
            value = json.loads(config)
        except ValueError as exc:
            tests.append(
                ParsedTest("invalid_test", f"line {index + 1}: config is not valid JSON: {exc}", line)
            )
            continue
        if not isinstance(value, dict):
            tests.append(ParsedTest("invalid_test", f"line {index + 1}: config is not a JSON object", line))
            continue
        try:
            parse_env_str(line)
        except EnvStringError as exc:
            tests.append(ParsedTest("invalid_test", f"line {index + 1}: {exc}", line))
            continue
        config_json = json.dumps(value, ensure_ascii=False)
        tests.append(ParsedTest("ok", "", f"{env_class}@{config_json}", config_json, difficulty))
    return tests


def parse_solve_output(text: str, env_source: str, finish_reason: str = "stop") -> ParsedSolve:
    answer = drop_reasoning(text)
    block = last_block(answer, "answer")
    if block is None:
        if finish_reason == "length":
            return ParsedSolve("truncated", ["completion cut by the token limit before </answer>"])
        return ParsedSolve("missing_marker", ["no complete <answer> block"])
    source = unfence(block)
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return ParsedSolve("syntax_error", [f"solve line {exc.lineno}: {exc.msg}"], source)
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "solve"]
    if len(functions) != 1:
        return ParsedSolve(
            "contract_violation", [f"expected one top-level def solve(self), found {len(functions)}"], source
        )
    args = functions[0].args.args
    if not args or args[0].arg != "self":
        return ParsedSolve("contract_violation", ["solve must take self as its first parameter"], source)
    try:
        spliced = splice_solve(env_source, source)
    except ValueError as exc:
        return ParsedSolve("contract_violation", [str(exc)], source)
    return ParsedSolve("ok", [], source, spliced)


def splice_solve(env_source: str, solve_source: str) -> str:
    """The env source with its `solve` method replaced by (or extended with) `solve_source`.

    The method is located in the syntax tree and its exact line span (decorators included) is
    replaced; helper functions defined next to `solve` in the candidate go in with it.
    """
    tree = ast.parse(env_source)
    classes = find_env_classes(tree)
    if len(classes) != 1:
        raise ValueError("the env source has no env class to put solve() into")
    cls = classes[0]
    lines = env_source.splitlines(keepends=True)
    method = find_method(cls, "solve")
    if method is not None:
        start, end = method_span(method)
        indent = re.match(r"\s*", lines[method.lineno - 1]).group(0)  # type: ignore[union-attr]
    else:
        last = cls.body[-1]
        start = end = last.end_lineno or last.lineno
        indent = re.match(r"\s*", lines[last.lineno - 1]).group(0)  # type: ignore[union-attr]
    block = "".join(indent + ln if ln.strip() else ln for ln in solve_source.splitlines(keepends=True))
    if method is None:
        block = "\n" + block
    result = "".join(lines[:start]) + block + "".join(lines[end:])
    try:
        ast.parse(result)
    except SyntaxError as exc:
        raise ValueError(
            f"env source with this solve() does not parse: line {exc.lineno}: {exc.msg}"
        ) from None
    return result
