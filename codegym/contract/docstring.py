"""Google-style docstring sections of environment tools.

CodeGym tools document themselves with `Args:`, `Returns:` and `Example Output:` sections. The
agent sees the docstring without its example (examples leak answers and cost tokens), so the
sections must be located exactly, not guessed at.
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

    lines: list[str]
    summary: str
    sections: dict[str, list[str]] = field(default_factory=dict)
    args: list[ArgDoc] = field(default_factory=list)

    def missing_sections(self) -> list[str]:
        return [s for s in REQUIRED_SECTIONS if s not in self.sections]

    def without_section(self, name: str) -> list[str]:
        """The docstring lines with one section (header and body) removed."""
        out: list[str] = []
        skipping = False
        for line in self.lines:
            match = _SECTION_RE.match(line)
            if match:
                skipping = match.group(1) == name
            if not skipping:
                out.append(line)
        while out and not out[-1].strip():
            out.pop()
        return out


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
    return Docstring(
        lines=lines, summary=summary, sections=sections, args=_parse_args(sections.get("Args", []))
    )


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
