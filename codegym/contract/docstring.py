"""Google-style docstring sections of environment tools, and the lines of one the agent sees.

CodeGym tools document themselves with `Args:`, `Returns:` and `Example Output:` sections. The
sections are parsed from the cleaned docstring (`Args:` feeds the JSON schemas). The text the agent
sees is not built from the cleaned docstring: CodeGym shows the docstring's raw lines, whitespace
included, so `shown_lines` works on the raw text (see its docstring).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SECTION_NAMES = ("Args", "Returns", "Example Output", "Raises", "Note", "Notes", "Example", "Examples")
REQUIRED_SECTIONS = ("Args", "Returns", "Example Output")
_SECTION_RE = re.compile(r"^({}):\s*$".format("|".join(re.escape(s) for s in SECTION_NAMES)))
_ARG_RE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


@dataclass(frozen=True)
class ArgDoc:
    """One documented parameter: `name (type): description`."""

    name: str
    type_text: str
    description: str


@dataclass
class Docstring:
    """A cleaned docstring split into its summary and named sections."""

    summary: str
    sections: dict[str, list[str]] = field(default_factory=dict)
    args: list[ArgDoc] = field(default_factory=list)

    def missing_sections(self) -> list[str]:
        return [s for s in REQUIRED_SECTIONS if s not in self.sections]


def parse_docstring(cleaned: str) -> Docstring:
    """Split a docstring already cleaned by `inspect.cleandoc` (as `ast.get_docstring` does)."""
    lines = cleaned.splitlines()
    sections: dict[str, list[str]] = {}
    summary_lines: list[str] = []
    current: str | None = None
    for line in lines:
        match = _SECTION_RE.match(line)
        if match:
            current = match.group(1)
            sections[current] = []
        elif current is None:
            summary_lines.append(line)
        else:
            sections[current].append(line)
    paragraphs = "\n".join(summary_lines).strip().split("\n\n")
    summary = " ".join(paragraphs[0].split()) if paragraphs and paragraphs[0] else ""
    return Docstring(summary=summary, sections=sections, args=_parse_args(sections.get("Args", [])))


def _parse_args(body: list[str]) -> list[ArgDoc]:
    args: list[ArgDoc] = []
    base_indent: int | None = None
    for line in body:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if base_indent is None:
            base_indent = indent
        if indent > base_indent and args:
            last = args[-1]
            args[-1] = ArgDoc(last.name, last.type_text, f"{last.description} {line.strip()}".strip())
            continue
        match = _ARG_RE.match(line)
        if match and match.group(1).lower() != "none":
            args.append(ArgDoc(match.group(1), (match.group(2) or "").strip(), match.group(3).strip()))
    return args


EXAMPLE_MARKER = "Example Output"
CLOSING_QUOTES = '"""'


def shown_lines(raw: str, indent: str) -> list[str]:
    """The docstring lines of a tool as CodeGym's published prompts show them.

    `raw` is the docstring exactly as written (`ast.get_docstring(clean=False)`), `indent` the
    indentation of the method's `def` line. CodeGym's tool text is the method's docstring moved
    one level left: every line that starts with the method's indentation loses it and keeps
    everything else, so a whitespace-only line of 8 spaces inside a method shows as 4 spaces and one
    of 4 spaces as an empty line (`inspect.cleandoc` would empty both, which is why the cleaned
    docstring cannot be used here; agents trained on CodeGym's prompts saw these bytes). The first
    line is what follows the opening quotes on their own line, so it is never dedented.

    The example is left out (it leaks answers and costs tokens), cut the way CodeGym cuts it: from
    the first line containing "Example Output" (anywhere in the line, not only as a section header)
    up to a line containing three double quotes, which is kept. Hardly any docstring holds
    such a line, so everything from the example on is dropped, a section written after it and the
    whitespace before the closing quotes included; a docstring without an example keeps that last
    line. The first line shares its line with the opening quotes, so it is never dropped.
    """
    lines = raw.split("\n")
    dedented = [lines[0]] + [line[len(indent) :] if line.startswith(indent) else line for line in lines[1:]]
    shown: list[str] = []
    in_example = False
    for number, line in enumerate(dedented):
        if EXAMPLE_MARKER in line:
            in_example = True
        if CLOSING_QUOTES in line or number == 0:
            in_example = False
        if not in_example:
            shown.append(line)
    return shown
