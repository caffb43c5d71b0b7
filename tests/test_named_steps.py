"""Functions read as named steps: none in ``fxpipe/`` or ``solvers/`` is over 100 lines of code.

A function's lines are its body's, its docstring, blank lines and comment-only lines aside (the house rule).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOST = 100


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    body = node.body
    first = body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
        isinstance(first.value.value, str)
    start = first.end_lineno + 1 if docstring else first.lineno
    return sum(1 for line in lines[start - 1:node.end_lineno] if line.strip() and not line.strip().startswith("#"))


def _long_functions(path: Path, shown: str) -> list[str]:
    """``shown:line name (count lines)`` for each function of the file at ``path`` over :data:`MOST`."""
    text = path.read_text()
    lines = text.splitlines()
    return [f"{shown}:{n.lineno} {n.name} ({_code_lines(n, lines)} lines)"
            for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _code_lines(n, lines) > MOST]


def test_no_function_is_over_100_lines():
    found = [f for package in ("fxpipe", "solvers") for p in sorted((ROOT / package).rglob("*.py"))
             for f in _long_functions(p, str(p.relative_to(ROOT)))]
    assert not found, "split these into named steps:\n" + "\n".join(found)


def test_the_count_leaves_out_the_docstring_and_comments(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MOST))
    scratch = tmp_path / "f.py"
    scratch.write_text(f'def ok():\n    """doc\n\n    more doc"""\n    # a comment\n\n{body}\n\n'
                       f'def long():\n{body}\n    return x0\n')
    found = [line.split(" ", 1)[1] for line in _long_functions(scratch, "f.py")]
    assert found == [f"long ({MOST + 1} lines)"], found
