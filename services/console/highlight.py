"""Environment code, highlighted on the server with Pygments (already installed with the server
extra, through rich), as tokens the template wraps in spans: the code stays text that the
template escapes; no highlighter's HTML is ever marked safe."""

from __future__ import annotations

from dataclasses import dataclass

from pygments.lexers.python import PythonLexer
from pygments.token import Comment, Keyword, Name, Number, Operator, String, _TokenType

# Token families and the CSS class the console's stylesheet colours them with.
FAMILIES: tuple[tuple[_TokenType, str], ...] = (
    (Comment, "c"),
    (String, "s"),
    (Number, "n"),
    (Keyword, "k"),
    (Name.Function, "f"),
    (Name.Class, "f"),
    (Name.Builtin, "b"),
    (Name.Decorator, "b"),
    (Operator, "o"),
)


@dataclass(frozen=True)
class Piece:
    css: str  # "" = plain
    text: str


def family(token: _TokenType) -> str:
    for parent, css in FAMILIES:
        if token in parent:
            return css
    return ""


def highlight(code: str) -> list[Piece]:
    """`code` as (class, text) pieces, adjacent pieces of one class merged."""
    pieces: list[Piece] = []
    for token, text in PythonLexer().get_tokens(code):
        css = family(token)
        if pieces and pieces[-1].css == css:
            pieces[-1] = Piece(css, pieces[-1].text + text)
        else:
            pieces.append(Piece(css, text))
    return pieces
