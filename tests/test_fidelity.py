"""The agent-facing tool text is CodeGym's, byte for byte.

Agents trained on CodeGym's published prompts saw CodeGym's exact bytes, whitespace-only lines
included; a prompt that differs in whitespace is a prompt they were not trained on. The published
training instances under tests/fixtures hold CodeGym's own text for the envs whose source we keep
(compared in test_contract.py, and through `codegym env describe` in test_cli_env.py). The rules
behind it (a docstring line loses the method's indentation and nothing else; the example is cut
from its first line to the end of the docstring; the `def` line is the source's, without `self`)
are checked here on hand-made docstrings, since the fixtures do not exercise all of them.

With `CODEGYM_EXAMPLES` pointing at a checkout of CodeGym's `example/` folder
(`training_instance.jsonl` and `example_envs/`), every published instance whose env source is
there is compared as well.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from codegym.contract import analyze_source, parse_ability, parse_env_source, tool_text, tools_text
from codegym.contract.docstring import shown_lines
from tests.conftest import ENV_DIR


def _env_with_observe(header: str, docstring_lines: list[str]) -> str:
    """A sample env whose `Observe` is declared by `header` and documented by `docstring_lines`
    (written as they stand in the file, indentation included)."""
    source = (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()
    start = source.index("    def Observe(self):")
    end = source.index("        return str(len(self.nums))", start)
    method = "\n".join([f"    {header}", '        r"""', *docstring_lines, '        """', ""])
    return source[:start] + method + source[end:]


def _observe_text(source: str) -> str:
    tool = analyze_source(source).tool("Observe")
    assert tool is not None
    return tool_text(tool)


def test_whitespace_only_docstring_lines_keep_their_whitespace_one_level_left() -> None:
    # As in CodeGym's Leetcode_6096_I__KthSmallestInMatrixEnv: a 4-space line after the opening
    # quotes, 8-space lines between sections, 12-space lines closing a section's body.
    source = _env_with_observe(
        "def Observe(self):",
        [
            "    ",
            "        Get the number of elements in the hidden array.",
            "        ",
            "        Args:",
            "            None",
            "            ",
            "        Returns:",
            "            str: The array length.",
            "            ",
            "        Example Output:",
            '            "5"',
        ],
    )
    assert _observe_text(source) == (
        "Function:\n\n"
        "def Observe():\n"
        '    r"""\n'
        "\n"
        "    Get the number of elements in the hidden array.\n"
        "    \n"
        "    Args:\n"
        "        None\n"
        "        \n"
        "    Returns:\n"
        "        str: The array length.\n"
        "        \n"
        '    """\n'
    )


def test_empty_lines_stay_empty_and_the_rest_of_the_env_is_unchanged() -> None:
    plain = (ENV_DIR / "Sample_0001_I__MaxSubarraySumEnv.py").read_text()
    spaced = _env_with_observe(
        "def Observe(self):",
        [
            "",
            "        Get the number of elements in the hidden array.",
            "        ",
            "        Args:",
            "            None",
            "",
            "        Returns:",
            "            str: The array length.",
            "",
            "        Example Output:",
            '            "5"',
        ],
    )
    plain_text, spaced_text = tools_text(parse_env_source(plain)), tools_text(parse_env_source(spaced))
    assert spaced_text == plain_text.replace(
        "hidden array.\n\n    Args:", "hidden array.\n    \n    Args:", 1
    )
    assert spaced_text != plain_text


def test_the_example_is_cut_to_the_end_of_the_docstring_as_codegym_cuts_it() -> None:
    # Whatever follows "Example Output" is gone, a later section included; CodeGym's
    # prompts never show it.
    source = _env_with_observe(
        "def Observe(self):",
        [
            "",
            "        Get the length.",
            "",
            "        Returns:",
            "            str: The array length.",
            "        Example Output:",
            '            "5"',
            "",
            "        Note:",
            "            Costs one step.",
        ],
    )
    text = _observe_text(source)
    assert text.endswith('        str: The array length.\n    """\n')
    assert "Note" not in text and '"5"' not in text


def test_a_docstring_without_example_keeps_its_last_line() -> None:
    raw = "\n        Get the length.\n\n        Returns:\n            str: n.\n        "
    assert shown_lines(raw, "    ") == [
        "",
        "    Get the length.",
        "",
        "    Returns:",
        "        str: n.",
        "    ",
    ]


def test_the_first_line_stays_on_the_opening_quotes_line() -> None:
    raw = "Get the length.\n\n        Returns:\n            str: n.\n\n        Example Output:\n            3\n        "
    assert shown_lines(raw, "    ") == ["Get the length.", "", "    Returns:", "        str: n.", ""]


def test_lines_without_the_methods_indentation_are_left_as_written() -> None:
    raw = "\n  two spaces\n\ta tab\n    four\n"
    assert shown_lines(raw, "    ") == ["", "  two spaces", "\ta tab", "four", ""]
    assert shown_lines("\n\t\tdoc\n\t", "\t") == ["", "\tdoc", ""]


def test_the_def_line_is_the_source_line_without_self() -> None:
    source = _env_with_observe(
        "def Observe(self, limit: int = 0) -> str:  # a comment stays",
        ["", "        Get it.", "", "        Example Output:", "            5"],
    )
    assert _observe_text(source).startswith(
        "Function:\n\ndef Observe(limit: int = 0) -> str:  # a comment stays\n"
    )
    bare = _env_with_observe("def Observe(self) :", ["", "        Get it."])
    assert _observe_text(bare).startswith("Function:\n\ndef Observe() :\n")


@pytest.mark.parametrize(
    "header",
    [
        "def Observe(self,\n                limit: int = 0):",
        "def Observe(\n        self, limit: int = 0\n    ):",
        "def Observe(self,limit: int = 0):",
    ],
)
def test_a_def_line_codegym_could_not_show_is_rebuilt(header: str) -> None:
    source = _env_with_observe(
        header, ["", "        Get it.", "", "        Example Output:", "            5"]
    )
    assert _observe_text(source).startswith("Function:\n\ndef Observe(limit: int=0):\n")


def _published() -> list[tuple[dict, Path]]:
    root = os.environ.get("CODEGYM_EXAMPLES")
    if not root:
        return []
    folder = Path(root)
    lines = (folder / "training_instance.jsonl").read_text().splitlines()
    pairs = []
    for line in filter(str.strip, lines):
        instance = json.loads(line)
        path = folder / "example_envs" / f"{parse_ability(instance['ability']).env_id}.py"
        if path.exists():
            pairs.append((instance, path))
    return pairs


@pytest.mark.skipif(not os.environ.get("CODEGYM_EXAMPLES"), reason="CODEGYM_EXAMPLES is not set")
def test_every_published_instance_with_its_env_source_matches() -> None:
    pairs = _published()
    assert pairs, "no instance of CODEGYM_EXAMPLES has its env in example_envs/"
    differing = [
        path.stem
        for instance, path in pairs
        if tools_text(parse_env_source(path.read_text())) != instance["prompt"][0]["content"]
    ]
    assert differing == [], f"{len(differing)} of {len(pairs)} differ"
