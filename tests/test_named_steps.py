"""Functions read as named steps: none in ``fxpipe/`` or ``solvers/`` is over 100 lines of code.

A function's lines are its body's, its docstring, blank lines and comment-only lines aside (the house rule).
"""

from __future__ import annotations

import ast
import dataclasses
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


def test_the_entry_points_take_few_words_their_rare_settings_in_records():
    """``compile``, ``plan`` and ``PipelineRank`` take at most 12 parameters each (the house rule): the tracing
    settings are ``CompileOptions`` fields, the loss a measurement runs through ``ProfileOptions``'."""
    import inspect

    import fxpipe
    from fxpipe.distributed import PipelineRank

    counts = {f.__qualname__: len([p for p in inspect.signature(f).parameters if p != "self"])
              for f in (fxpipe.compile, fxpipe.plan, PipelineRank.__init__)}
    assert max(counts.values()) <= 12, counts
    assert {"leaf_modules", "frontend", "time_limit_s"} <= {f.name for f in dataclasses.fields(fxpipe.CompileOptions)}
    assert {"loss_fn", "example_target"} <= {f.name for f in dataclasses.fields(fxpipe.ProfileOptions)}
