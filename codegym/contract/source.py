"""Static reading of an environment source with `ast`.

The trusted side of the system must know an environment's class and tools without running its
code (it is LLM-generated and untrusted), so everything here comes from the syntax tree.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass, field

from codegym.contract.docstring import Docstring, parse_docstring
from codegym.contract.errors import ContractError, Violation

REQUIRED_METHODS = ("reset", "step", "get_ref_answer")
REQUIRED_TOOLS = ("Done",)
RECOMMENDED_TOOLS = ("Observe",)
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
"""Line breaks as the parser counts lines (`str.splitlines` also splits at form feeds and others)."""


@dataclass
class ToolDef:
    """One tool: a key of `func_mapping` and the method implementing it."""

    name: str
    params: list[ast.arg]
    defaults: dict[str, ast.expr]
    signature: str
    docstring: Docstring
    line: int
    returns: str = ""
    """Return annotation as written (`ast.unparse`), or "" when the method has none."""
    header: str = ""
    """The `def` line the agent sees, without `self` (see `_shown_header`)."""
    raw_docstring: str = ""
    """The docstring as written, whitespace included (`ast.get_docstring(clean=False)`)."""
    indent: str = "    "
    """Indentation of the method's `def` line, which the agent's view of the docstring drops."""


@dataclass
class EnvSpec:
    """What the contract checker learned about a source."""

    class_name: str
    tools: list[ToolDef]
    methods: dict[str, int]
    sha256: str
    violations: list[Violation] = field(default_factory=list)
    warnings: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def tool(self, name: str) -> ToolDef | None:
        return next((t for t in self.tools if t.name == name), None)


def sha256_text(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def _is_env_base(base: ast.expr) -> bool:
    if isinstance(base, ast.Attribute):
        return base.attr == "Env"
    return isinstance(base, ast.Name) and base.id == "Env"


def find_env_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """Top-level classes deriving from `gymnasium.Env` (or `gym.Env`, or an imported `Env`)."""
    return [n for n in tree.body if isinstance(n, ast.ClassDef) and any(_is_env_base(b) for b in n.bases)]


def _find_func_mapping(cls: ast.ClassDef) -> tuple[ast.expr | None, int | None]:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for sub in ast.walk(node):
                targets: list[ast.expr] = []
                value: ast.expr | None = None
                if isinstance(sub, ast.Assign):
                    targets, value = list(sub.targets), sub.value
                elif isinstance(sub, ast.AnnAssign) and sub.value is not None:
                    targets, value = [sub.target], sub.value
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and target.attr == "func_mapping"
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                    ):
                        return value, target.lineno
    return None, None


def _signature(fn: ast.FunctionDef) -> tuple[list[ast.arg], dict[str, ast.expr], str]:
    args = fn.args
    positional = list(args.posonlyargs) + list(args.args)
    if positional and positional[0].arg == "self":
        positional = positional[1:]
    defaults = list(args.defaults)
    default_map: dict[str, ast.expr] = {}
    for arg, default in zip(positional[len(positional) - len(defaults) :], defaults, strict=True):
        default_map[arg.arg] = default
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if kw_default is not None:
            default_map[arg.arg] = kw_default
    shown = ast.arguments(
        posonlyargs=[],
        args=positional,
        vararg=args.vararg,
        kwonlyargs=args.kwonlyargs,
        kw_defaults=args.kw_defaults,
        kwarg=args.kwarg,
        defaults=defaults,
    )
    return positional + list(args.kwonlyargs), default_map, ast.unparse(shown)


def _ends_with_colon(text: str) -> bool:
    """Whether one line of code ends its statement with `:` (a trailing comment allowed)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    ignored = (tokenize.COMMENT, tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)
    code = [t for t in tokens if t.type not in ignored]
    return bool(code) and code[-1].type == tokenize.OP and code[-1].string == ":"


def _shown_header(fn: ast.FunctionDef, line: str, signature: str, returns: str) -> str:
    """The `def` line of a tool as CodeGym shows it: the source line itself without `self`.

    CodeGym copies the method's `def` line from the source (spacing, default values and a trailing
    comment as written), stripped, with `(self, ` made `(` and `(self)` made `()`, so a tool
    declared `value: int = 0` is shown that way, not as `ast.unparse` would spell it. A header that
    CodeGym could not have published (spread over several lines, `self` written another way, the
    body on the same line) is rebuilt from the syntax tree instead.
    """
    rebuilt = f"def {fn.name}({signature}){f' -> {returns}' if returns else ''}:"
    text = line.strip()
    if fn.body[0].lineno == fn.lineno or not _ends_with_colon(text):
        return rebuilt
    for written, shown in (("(self, ", "("), ("(self)", "()")):
        if text.startswith(f"def {fn.name}{written}"):
            return f"def {fn.name}{shown}{text[len(f'def {fn.name}{written}') :]}"
    return rebuilt


def analyze_source(source: str) -> EnvSpec:
    """Read a source and report every contract violation found (an empty list means it complies)."""
    digest = sha256_text(source)
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        msg = f"syntax error: {exc.msg}"
        return EnvSpec("", [], {}, digest, [Violation("syntax_error", msg, exc.lineno)])
    classes = find_env_classes(tree)
    if not classes:
        return EnvSpec(
            "", [], {}, digest, [Violation("no_env_class", "no class deriving from gymnasium.Env")]
        )
    if len(classes) > 1:
        names = ", ".join(f"{c.name} (line {c.lineno})" for c in classes)
        return EnvSpec(
            "",
            [],
            {},
            digest,
            [Violation("several_env_classes", f"several env classes: {names}", classes[1].lineno)],
        )
    cls = classes[0]
    source_lines = _LINE_BREAK.split(source)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    spec = EnvSpec(cls.name, [], {name: fn.lineno for name, fn in methods.items()}, digest)
    for name in REQUIRED_METHODS:
        if name not in methods:
            spec.violations.append(
                Violation("missing_method", f"{cls.name} has no method {name}()", cls.lineno)
            )
    mapping, line = _find_func_mapping(cls)
    if mapping is None:
        spec.violations.append(
            Violation("func_mapping_missing", "__init__ does not assign self.func_mapping", cls.lineno)
        )
        return spec
    if not isinstance(mapping, ast.Dict):
        spec.violations.append(
            Violation(
                "func_mapping_not_dict", 'self.func_mapping must be a dict literal {"Tool": CODE, ...}', line
            )
        )
        return spec
    for key in mapping.keys:
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            spec.violations.append(
                Violation("func_mapping_key", "func_mapping keys must be string literals (tool names)", line)
            )
            continue
        _add_tool(spec, source_lines, key.value, methods.get(key.value), line)
    tool_names = [t.name for t in spec.tools]
    for name in REQUIRED_TOOLS:
        if name not in tool_names:
            spec.violations.append(
                Violation("missing_tool", f"required tool {name} is not in func_mapping", line)
            )
    for name in RECOMMENDED_TOOLS:
        if name not in tool_names:
            spec.warnings.append(Violation("missing_tool", f"tool {name} is not in func_mapping", line))
    if "solve" not in methods:
        spec.warnings.append(Violation("missing_method", f"{cls.name} has no solve()", cls.lineno))
    return spec


def _add_tool(
    spec: EnvSpec, lines: list[str], name: str, fn: ast.FunctionDef | None, mapping_line: int | None
) -> None:
    if fn is None:
        spec.violations.append(
            Violation(
                "tool_without_method",
                f"tool {name} has no method {name}() in {spec.class_name}",
                mapping_line,
            )
        )
        return
    doc_text = ast.get_docstring(fn, clean=True)
    if not doc_text:
        spec.violations.append(
            Violation("tool_without_docstring", f"tool {name} has no docstring", fn.lineno)
        )
        return
    doc = parse_docstring(doc_text)
    missing = doc.missing_sections()
    if missing:
        spec.violations.append(
            Violation(
                "tool_docstring_sections",
                f"docstring of tool {name} lacks section(s): {', '.join(s + ':' for s in missing)}",
                fn.lineno,
            )
        )
    params, defaults, signature = _signature(fn)
    returns = ast.unparse(fn.returns) if fn.returns is not None else ""
    line = lines[fn.lineno - 1]
    spec.tools.append(
        ToolDef(
            name,
            params,
            defaults,
            signature,
            doc,
            fn.lineno,
            returns,
            header=_shown_header(fn, line, signature, returns),
            raw_docstring=ast.get_docstring(fn, clean=False) or "",
            indent=line[: len(line) - len(line.lstrip())],
        )
    )


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def method_span(fn: ast.FunctionDef) -> tuple[int, int]:
    """0-based first line (decorators included) and end line (exclusive) of a function."""
    return min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) - 1, fn.end_lineno or fn.lineno


def method_source(source: str, name: str) -> str:
    """One method of the env class, dedented into a top-level `def` (e.g. an env's own solve())."""
    tree = ast.parse(source)
    classes = find_env_classes(tree)
    fn = find_method(classes[0], name) if len(classes) == 1 else None
    if fn is None:
        raise ValueError(f"the source has no env class with a method {name}()")
    start, end = method_span(fn)
    return textwrap.dedent("".join(source.splitlines(keepends=True)[start:end]))


def parse_env_source(source: str) -> EnvSpec:
    """Like `analyze_source`, but raise `ContractError` naming every violation."""
    spec = analyze_source(source)
    if spec.violations:
        raise ContractError(spec.violations)
    return spec
