"""The measures behind ``test_design.py``: long functions, classes with many instance attributes, and code repeated
in blocks of six or more lines of the same shape. Run as a script it prints them (``python tests/design_rules.py``).

A rule broken on purpose says why in a comment on the line of the ``def`` or ``class`` (or the line above it):
``# design: <why>``; such a place is reported, not counted.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import keyword
import os
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The shipped packages the rules hold for.
PACKAGES = ("rlhfless_sdk", "policies", "adapters")
LONGEST_FUNCTION = 60
MOST_ATTRIBUTES = 20
BLOCK = 6
#: A block of this shape in more places than this is an idiom, not a copy.
TOO_COMMON = 8
MARK = "# design:"


@dataclass(frozen=True)
class Place:
    path: str
    line: int
    name: str
    size: int
    why: str | None  # the ``# design:`` comment, where the rule is broken on purpose

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} ({self.size})" + (f" [{self.why}]" if self.why else "")


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _why(lines: list[str], node: ast.AST) -> str | None:
    """The ``# design:`` comment on the line of the ``def`` or ``class``, or in the comment block just above it (and
    its decorators), its lines joined."""
    if MARK in lines[node.lineno - 1]:
        return lines[node.lineno - 1].split(MARK, 1)[1].strip()
    i = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 2
    block: list[str] = []
    while i >= 0 and lines[i].lstrip().startswith("#"):
        block.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    text = " ".join(block)
    return text.split(MARK.lstrip("# "), 1)[1].strip() if MARK.lstrip("# ") in text else None


def instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Fields declared in the class body (a dataclass's, a pydantic model's) and every ``self.X`` it assigns."""
    names = {b.target.id for b in cls.body if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            continue
        for target in targets:
            for e in ast.walk(target):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def measures() -> tuple[list[Place], list[Place]]:
    """Every function (its lines) and every class (its instance attributes, its project bases' too: a mixin's
    attributes are its host's) of the shipped packages."""
    functions, classes, own, bases = [], [], {}, {}
    for path in sources():
        text = path.read_text(encoding="utf-8")
        lines, rel = text.splitlines(), str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                functions.append(Place(rel, node.lineno, node.name, size, _why(lines, node)))
            elif isinstance(node, ast.ClassDef):
                own[rel, node.name] = instance_attributes(node)
                bases[rel, node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
                classes.append(Place(rel, node.lineno, node.name, 0, _why(lines, node)))
    where = defaultdict(list)  # class name -> the files defining one (two files may each have a class so named)
    for rel, name in own:
        where[name].append(rel)

    def attributes(key: tuple[str, str], seen: frozenset[tuple[str, str]] = frozenset()) -> set[str]:
        out = set(own.get(key, ()))
        for base in bases.get(key, ()):
            # the nearest file defining it: its own, else the one sharing the longest folder path
            found = sorted(where.get(base, ()), key=lambda r: -len(os.path.commonpath([r, key[0]])))
            if found and (found[0], base) not in seen:
                out |= attributes((found[0], base), seen | {key})
        return out

    classes = [dataclasses.replace(c, size=len(attributes((c.path, c.name)))) for c in classes]
    return functions, classes


# -- repeated blocks -------------------------------------------------------------------------------------------
def _skipped_lines(tree: ast.AST) -> set[int]:
    """Declarations, not logic: docstrings (prose), click's option and argument decorators (a command's flags),
    a function's signature and the fields a class declares (a record's ``name: type = default`` lines)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            out.update(range(node.lineno, node.body[0].lineno))
        if isinstance(node, ast.ClassDef):
            for field in node.body:
                if isinstance(field, ast.AnnAssign):
                    out.update(range(field.lineno, field.end_lineno + 1))
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.update(range(body[0].lineno, body[0].end_lineno + 1))
        for deco in getattr(node, "decorator_list", []):
            func = deco.func if isinstance(deco, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in ("option", "argument"):
                out.update(range(deco.lineno, deco.end_lineno + 1))
    return out


def code_lines(text: str) -> list[tuple[int, tuple[str, ...]]]:
    """The code lines of ``text`` as tokens (a string, a number: one token each; an f-string's parts too), without
    blank lines, comments, imports, declarations (``_skipped_lines``) and lines of punctuation alone."""
    skipped = _skipped_lines(ast.parse(text))
    by_line: dict[int, list[str]] = defaultdict(list)
    fstring_start, fstring_end = getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1)
    inside = 0  # an f-string's parts (Python 3.12 tokenizes them), one string like any other
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        line = tok.start[0]
        inside += (tok.type == fstring_start) - (tok.type == fstring_end)
        if line in skipped or (inside and tok.type != fstring_start):
            continue
        if tok.type in (tokenize.STRING, fstring_start):
            by_line[line].append('"s"')
        elif tok.type == tokenize.NUMBER:
            by_line[line].append("0")
        elif tok.type in (tokenize.NAME, tokenize.OP):
            by_line[line].append(tok.string)
    return [(line, tuple(toks)) for line, toks in sorted(by_line.items()) if not _thin(toks)]


def _thin(toks: list[str]) -> bool:
    """Layout, not logic: an import, a bare decorator, a line with at most one name, string or number and only
    brackets, commas or ``...`` besides (an argument of a call laid out a line each, punctuation alone, a protocol's
    stub), or one keyword argument of one value (``name=name,``)."""
    words = [t for t in toks if t[0].isalnum() or t[0] in '"_']
    lone = len(words) <= 1 and all(t in ("(", ")", "[", "]", "{", "}", ",", "...") for t in toks if t not in words)
    keyword_argument = len(toks) in (3, 4) and toks[1] == "=" and tuple(toks[3:]) in ((), (",",))
    return toks[0] in ("import", "from") or (toks[0] == "@" and "(" not in toks) or lone or keyword_argument


def shape(lines: list[tuple[str, ...]]) -> tuple[str, ...]:
    """A block's shape: its names renamed in the order they first appear (``a = f(a)`` and ``b = g(b)`` alike,
    ``a = f(b)`` not), keywords, operators and the placeholders of strings and numbers kept."""
    names: dict[str, str] = {}
    out = []
    for toks in lines:
        out.append(" ".join(
            names.setdefault(t, f"n{len(names)}") if t.isidentifier() and not keyword.iskeyword(t) else t for t in toks
        ))  # fmt: skip
    return tuple(out)


def repeated_blocks() -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Pairs of files (a file with itself too) that share a block of ``BLOCK`` code lines of the same shape, each
    with the lines where the two sides' blocks start (a block in more than ``TOO_COMMON`` places is an idiom)."""
    places: dict[tuple[str, ...], list[tuple[str, int, int]]] = defaultdict(list)
    for path in sources():
        rel, code = str(path.relative_to(ROOT)), code_lines(path.read_text(encoding="utf-8"))
        for i in range(len(code) - BLOCK + 1):
            places[shape([toks for _, toks in code[i : i + BLOCK]])].append((rel, code[i][0], code[i + BLOCK - 1][0]))
    pairs: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for found in places.values():
        if len(found) < 2 or len(found) > TOO_COMMON:
            continue
        for i, (a, fa, la) in enumerate(found):
            for b, fb, lb in found[i + 1 :]:
                if a == b and fa <= lb and fb <= la:
                    continue  # a block overlapping itself (a run of like lines)
                key, starts = ((a, b), (fa, fb)) if (a, fa) <= (b, fb) else ((b, a), (fb, fa))
                pairs[key].append(starts)
    return dict(pairs)


def main() -> None:
    functions, classes = measures()
    long = sorted((f for f in functions if f.size > LONGEST_FUNCTION), key=lambda f: -f.size)
    wide = sorted((c for c in classes if c.size > MOST_ATTRIBUTES), key=lambda c: -c.size)
    print(f"functions over {LONGEST_FUNCTION} lines: {len(long)}; longest {max(f.size for f in functions)}")
    for f in long:
        print(f"  {f}")
    print(f"classes over {MOST_ATTRIBUTES} instance attributes: {len(wide)}; most {max(c.size for c in classes)}")
    for c in wide:
        print(f"  {c}")
    pairs = repeated_blocks()
    print(f"file pairs sharing a block of {BLOCK} lines of the same shape: {len(pairs)}")
    for (a, b), starts in sorted(pairs.items()):
        print(f"  {a}:{starts[0][0]} ~ {b}:{starts[0][1]} ({len(starts)} blocks)")


if __name__ == "__main__":
    main()
