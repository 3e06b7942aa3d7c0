"""The guide: no class over 400 lines and no function over 80, counted without
docstrings (Python) or JSDoc blocks (JavaScript), in ``mesh/`` and
``clients/node/src``.

Python is counted with :mod:`ast`; JavaScript with a small scanner that blanks
out comments, strings, template literal text and regular expressions, then
matches braces and names what opened each block (a class, a function, a method
or an arrow function)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLASS_LIMIT = 400
FUNCTION_LIMIT = 80

# Items allowed over the guide, each with why; none today. An entry that is
# no longer over the guide fails the test, so the list cannot go stale.
ALLOWED: set[str] = set()


@dataclass(frozen=True)
class Item:
    """One class or function: its dotted name, kind and counted lines."""

    name: str
    kind: str  # "class" or "function"
    lines: int

    @property
    def limit(self) -> int:
        return CLASS_LIMIT if self.kind == "class" else FUNCTION_LIMIT


# --- Python ------------------------------------------------------------------

_Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _docstring_lines(node: ast.AST) -> set[int]:
    """The line numbers of every docstring inside ``node`` (its own included)."""
    lines: set[int] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Module | _Scope):
            body = sub.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                first = body[0]
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def python_items(source: str) -> Iterator[Item]:
    """Every class and function of a Python module, from its ``def``/``class``
    line to its last line, docstrings excluded."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Item]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _Scope):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                docs = _docstring_lines(child)
                lines = sum(1 for n in range(child.lineno, end + 1) if n not in docs)
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                yield Item(name, kind, lines)
                yield from walk(child, f"{name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


# --- JavaScript --------------------------------------------------------------

# After one of these, a "/" starts a regular expression, not a division.
_REGEX_AFTER_WORDS = {
    "return", "typeof", "instanceof", "in", "of", "new", "delete", "void", "throw",
    "case", "do", "else", "yield", "await",
}  # fmt: skip
_CONTROL = {"if", "for", "while", "switch", "catch", "with", "function", "return"}
_IDENT = re.compile(r"[A-Za-z_$][\w$]*")


def _blank(chars: list[str], start: int, end: int) -> None:
    for i in range(start, end):
        if chars[i] != "\n":
            chars[i] = " "


def _skip_quoted(text: str, i: int, quote: str) -> int:
    """The index just past the string or regex that starts at ``i``."""
    i += 1
    in_class = False
    while i < len(text) and (text[i] != quote or in_class):
        if text[i] == "\\":
            i += 1
        elif quote == "/" and text[i] in "[]":
            in_class = text[i] == "["
        i += 1
    return i + 1


def _regex_allowed(code: list[str], i: int) -> bool:
    """Whether a "/" at ``i`` starts a regex, judged by the code before it."""
    j = i - 1
    while j >= 0 and code[j].isspace():
        j -= 1
    if j < 0:
        return True
    if code[j] in ")]}" or code[j].isalnum() or code[j] in "_$":
        word = re.search(r"[\w$]+$", "".join(code[max(0, j - 20) : j + 1]))
        return bool(word) and word.group(0) in _REGEX_AFTER_WORDS  # type: ignore[union-attr]
    return True


def js_mask(text: str) -> tuple[str, set[int]]:
    """The code with comments, strings, template text and regexes blanked
    (newlines kept, so positions and lines stay), and the line numbers
    (1-based) that hold nothing but JSDoc (``/** ... */``)."""
    code = list(text)
    jsdoc: set[int] = set()
    templates: list[int] = []  # brace depth at each open `${`
    depth = 0
    i = 0
    while i < len(text):
        c = text[i]
        if c == "`" or (c == "}" and templates and templates[-1] == depth):
            if c == "}":
                templates.pop()
            j = i + 1
            while j < len(text) and text[j] != "`" and not text.startswith("${", j):
                j += 2 if text[j] == "\\" else 1
            _blank(code, i + 1, j)
            if text.startswith("${", j):
                templates.append(depth)
                i = j + 2
            else:
                i = j + 1
            continue
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            _blank(code, i, end)
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2) + 2
            if text.startswith("/**", i):
                first = text.count("\n", 0, i) + 1
                jsdoc.update(range(first, first + text.count("\n", i, end) + 1))
            _blank(code, i, end)
            i = end
        elif c in "'\"" or (c == "/" and _regex_allowed(code, i)):
            end = _skip_quoted(text, i, c)
            _blank(code, i + 1, end - 1)
            i = end
        else:
            depth += {"{": 1, "}": -1}.get(c, 0)
            i += 1
    masked = "".join(code)
    lines = masked.split("\n")
    return masked, {n for n in jsdoc if not lines[n - 1].strip()}


def _matching(code: str, i: int, open_: str, close: str, step: int) -> int:
    """The index of the bracket that matches the one at ``i``."""
    depth = 0
    while True:
        depth += {open_: 1, close: -1}.get(code[i], 0) * step
        if depth == 0:
            return i
        i += step


def _opener(code: str, brace: int) -> tuple[str, str, int] | None:
    """What opens the block at ``brace``: (kind, name, index where it starts),
    or None for a block that is neither a class nor a function."""
    head = code[:brace].rstrip()
    statement = re.split(r"[;{}]", head)[-1]
    found = re.search(r"\bclass\b(\s+([\w$]+))?(\s+extends\s+[\w$.]+)?\s*$", statement)
    if found:
        start = len(head) - len(statement) + found.start()
        return "class", found.group(2) or "<class>", start
    if head.endswith("=>"):
        params = head[:-2].rstrip()
        if params.endswith(")"):
            start = _matching(code, len(params) - 1, "(", ")", -1)
        else:
            start = len(params) - len(re.search(r"[\w$]*$", params).group(0))  # type: ignore[union-attr]
        named = re.search(r"([\w$]+)\s*[=:]\s*(async\s*)?$", code[:start])
        return "function", named.group(1) if named else "<arrow>", start
    if head.endswith(")"):
        start = _matching(code, len(head) - 1, "(", ")", -1)
        before = code[:start].rstrip()
        word = re.search(r"([\w$]+)\s*\*?\s*$", before)
        if word is None:
            return None
        if word.group(1) == "function":
            return "function", "<function>", word.start()
        if word.group(1) in _CONTROL:
            return None
        return "function", word.group(1), word.start()
    return None


def js_items(text: str) -> Iterator[Item]:
    """Every class, function, method and arrow function with a block body,
    from the line it starts on to its closing brace, JSDoc blocks excluded."""
    code, jsdoc = js_mask(text)
    stack: list[tuple[int, str, str] | None] = []  # per open brace
    for i, c in enumerate(code):
        if c == "{":
            opener = _opener(code, i)
            if opener is None:
                stack.append(None)
            else:
                outer = [s[1] for s in stack if s is not None][-1:]
                kind, name, start = opener
                stack.append((start, ".".join([*outer, name]), kind))
        elif c == "}" and stack:
            top = stack.pop()
            if top is not None:
                start, name, kind = top
                first = code.count("\n", 0, start) + 1
                last = code.count("\n", 0, i) + 1
                lines = sum(1 for n in range(first, last + 1) if n not in jsdoc)
                yield Item(name, kind, lines)
    if stack:
        raise ValueError(f"{len(stack)} braces left open: the scanner misread the file")


# --- The tree ----------------------------------------------------------------


def tree_items() -> Iterator[tuple[str, Item]]:
    for path in sorted((ROOT / "mesh").rglob("*.py")):
        for item in python_items(path.read_text()):
            yield f"{path.relative_to(ROOT)}:{item.name}", item
    for path in sorted((ROOT / "clients" / "node" / "src").rglob("*.js")):
        for item in js_items(path.read_text()):
            yield f"{path.relative_to(ROOT)}:{item.name}", item


def test_no_class_or_function_over_the_guide() -> None:
    over = {key: item for key, item in tree_items() if item.lines > item.limit}
    named = [f"{key}: {item.kind} of {item.lines} lines" for key, item in over.items()]
    unexpected = [line for key, line in zip(over, named, strict=True) if key not in ALLOWED]
    assert not unexpected, f"over the guide ({CLASS_LIMIT}/{FUNCTION_LIMIT}): {unexpected}"
    stale = sorted(ALLOWED - set(over))
    assert not stale, f"allowed but no longer over the guide (take them off ALLOWED): {stale}"


# --- The counters themselves -------------------------------------------------

PY_SAMPLE = '''
class A:
    """A docstring
    of two lines."""

    def f(self) -> int:
        """One line."""
        x = 1
        return x

    async def g(self) -> None:
        pass


def h() -> None:
    def inner() -> None:
        """Inner."""

    return None
'''


def test_python_counter() -> None:
    counts = {item.name: (item.kind, item.lines) for item in python_items(PY_SAMPLE)}
    assert counts == {
        "A": ("class", 8),
        "A.f": ("function", 3),
        "A.g": ("function", 2),
        "h": ("function", 4),
        "h.inner": ("function", 1),
    }


JS_SAMPLE = r"""'use strict';
/**
 * A JSDoc block with a brace { that is not code.
 */
class Box extends Base {
  /** @param {number} n */
  constructor(n) {
    /** @type {number} */ this.n = 0;
    super();
    this.n = n; // a comment with }
  }

  async get(key) {
    const s = `a ${key.map((k) => { return k; })} } b`;
    const r = /[}{]\/x/g;
    if (key) {
      return s + '}' + "{";
    }
    return r.source / 2;
  }
}

const add = (a, b) => {
  return a + b;
};

function outer() {
  const obj = { inner() { return 1; } };
  return obj;
}
"""


def test_js_counter() -> None:
    counts = {item.name: (item.kind, item.lines) for item in js_items(JS_SAMPLE)}
    assert counts == {
        "Box": ("class", 16),
        "Box.constructor": ("function", 5),
        "Box.get": ("function", 8),
        "Box.get.<arrow>": ("function", 1),
        "add": ("function", 3),
        "outer": ("function", 4),
        "outer.inner": ("function", 1),
    }
