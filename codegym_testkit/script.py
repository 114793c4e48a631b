"""The scripted turns a scripted model writes (codegym_testkit/scripted_lm.py): one `Script`, read
by TRL's one-step run (tests/helpers/trl_run.py) and the TRL soak (bench/soak_trl.py).

A script is a list of assistant turns (token ids). `Script.next_tokens` gives the next token after
each position of a sequence: the k-th assistant turn is turn k of the script chosen for that
sequence, then the end of turn; past the script, the end of turn at once (which ends TRL's tool
loop). What differs between the runs is only how a sequence's script is chosen: `Tagged` reads
`[trajectory K]` from the prompt, `Marked` looks for a tool only one environment has. Needs a
tokenizer (codegym_testkit.trainer_script.chatml_tokenizer), not torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from codegym_testkit.trainer_script import hermes

Turns = list[list[int]]  # a script: each assistant turn's token ids, its end of turn included
TAG = "[trajectory {}]"


def keyed(ids: Sequence[int]) -> str:
    """Token ids as a string, one character per id, to search id sequences with `str.find`."""
    return "".join(map(chr, ids))


def turns(tokenizer: Any, actions: Iterable[str]) -> Turns:
    """Recorded actions as assistant turns: each a hermes tool call, then the end of turn."""
    return [tokenizer.encode(hermes(a) + "<|im_end|>", add_special_tokens=False) for a in actions]


class Script:
    """The next token after each position of a sequence, from the turns `choose(ids)` gives it."""

    def __init__(self, tokenizer: Any, choose: Callable[[list[int]], Turns]) -> None:
        self.choose = choose
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.start = keyed(tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))

    def next_tokens(self, ids: list[int], first: int = 0) -> list[int]:
        """The scripted next token at positions `first`.. of `ids`."""
        key = keyed(ids)
        script = self.choose(ids)
        starts = []  # the position of the last token of each `<|im_start|>assistant\n`
        at = key.find(self.start)
        while at >= 0:
            starts.append(at + len(self.start) - 1)
            at = key.find(self.start, at + 1)
        out = []
        for t in range(max(0, first), len(ids)):
            turn = bisect.bisect_right(starts, t)
            tokens = script[turn - 1] if 0 < turn <= len(script) else []
            j = t - starts[turn - 1] if turn else 0
            out.append(tokens[j] if j < len(tokens) else self.end)
        return out


class Tagged:
    """A sequence tagged `[trajectory K]` (`TAG`) plays recording K's actions; untagged, none."""

    def __init__(self, tokenizer: Any, lines: Sequence[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.lines = lines
        prefix, _, suffix = TAG.partition("{}")
        self.tag = keyed(tokenizer.encode(prefix, add_special_tokens=False))
        self.tag_end = keyed(tokenizer.encode(suffix, add_special_tokens=False))
        self.turns: dict[int, Turns] = {}

    def __call__(self, ids: list[int]) -> Turns:
        key = keyed(ids)
        at = key.find(self.tag)
        if at < 0:
            return []
        stop = key.find(self.tag_end, at + len(self.tag))
        number = self.tokenizer.decode([ord(c) for c in key[at + len(self.tag) : stop]])
        k = int(number) if number.isdigit() else -1
        if not 0 <= k < len(self.lines):
            return []
        if k not in self.turns:
            self.turns[k] = turns(self.tokenizer, (action for action, _ in self.lines[k]["steps"]))
        return self.turns[k]


class Marked:
    """The script of the first marker (text, e.g. a tool only one environment has) the sequence
    holds, else `default`. Reads the byte tokens only (ids 0-255 of a byte-level tokenizer, in
    its own order): special tokens are dropped."""

    def __init__(self, tokenizer: Any, default: Turns, marked: Sequence[tuple[str, Turns]]) -> None:
        self.default = default
        self.marked = [(bytes(tokenizer.encode(m, add_special_tokens=False)), t) for m, t in marked]

    def __call__(self, ids: list[int]) -> Turns:
        text = bytes(t for t in ids if t < 256)
        return next((script for marker, script in self.marked if marker in text), self.default)
