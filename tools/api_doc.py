"""Write docs/api.md: every name in ``fxpipe.__all__``, its signature and the first paragraph of its docstring.

    python tools/api_doc.py            # rewrite docs/api.md
    python tools/api_doc.py --check    # exit 1 if docs/api.md is not what this would write

It reads the source with :mod:`ast` and imports nothing (neither fxpipe nor torch), so it runs on any machine:
each name is followed from ``fxpipe/__init__.py`` through the ``from ... import`` lines to the module that defines
it; a function's signature is its ``def`` as written, a class's its ``__init__``'s (a dataclass's: its fields),
annotations and defaults as in the source. ``tests/test_api_doc.py`` checks that the page documents exactly
``fxpipe.__all__`` and that it is up to date.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
WIDTH = 100   # a signature longer than this is written one parameter a line


@dataclass
class Found:
    name: str
    module: str        # dotted name of the module that defines it
    path: Path
    node: ast.AST      # its ClassDef, FunctionDef or assignment
    tree: ast.Module   # the defining module


def module_path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def package_all(package: str = "fxpipe") -> list[str]:
    """``__all__`` of the package, as written in its ``__init__.py``."""
    for node in parse(module_path(package)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise SystemExit(f"{module_path(package)} has no __all__")


def find(module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()) -> Found:
    """Where ``name``, as ``module`` sees it, is defined: followed through ``from X import name`` lines."""
    if (module, name) in seen:
        raise SystemExit(f"an import cycle for {name} through {module}")
    path = module_path(module)
    tree = parse(path)
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return Found(name, module, path, node, tree)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return Found(name, module, path, node, tree)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return Found(name, module, path, node, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return find(node.module, alias.name, seen | {(module, name)})
    raise SystemExit(f"{name} is not defined in {path.relative_to(ROOT)} nor imported there by name")


def arguments(args: ast.arguments, drop_first: bool = False) -> list[str]:
    """The parameters as ``inspect.signature`` writes them: ``name: annotation = default``, ``/``, ``*``."""
    def one(a: ast.arg, default: ast.expr | None) -> str:
        text = a.arg + (f": {ast.unparse(a.annotation)}" if a.annotation is not None else "")
        if default is not None:
            text += (" = " if a.annotation is not None else "=") + ast.unparse(default)
        return text

    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults))
    cut = len(args.posonlyargs)
    if drop_first and pairs:
        pairs, cut = pairs[1:], max(0, cut - 1)
    out = [one(a, d) for a, d in pairs]
    if cut:
        out.insert(cut, "/")
    if args.vararg is not None:
        out.append("*" + one(args.vararg, None))
    elif args.kwonlyargs:
        out.append("*")
    out += [one(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        out.append("**" + one(args.kwarg, None))
    return out


def is_dataclass(node: ast.ClassDef) -> ast.expr | None:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("dataclass", "dataclasses.dataclass"):
            return deco
    return None


def dataclass_fields(node: ast.ClassDef, deco: ast.expr) -> list[str]:
    """A dataclass's ``__init__`` parameters: its annotated fields in order (``ClassVar`` and ``init=False`` left
    out; ``field(default_factory=...)`` shown as ``<factory>``, as ``inspect`` shows it)."""
    kw_only = isinstance(deco, ast.Call) and any(k.arg == "kw_only" and ast.unparse(k.value) == "True"
                                                  for k in deco.keywords)
    out = ["*"] if kw_only else []
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        annotation = ast.unparse(item.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        text, value = f"{item.target.id}: {annotation}", item.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
            keywords = {k.arg: k.value for k in value.keywords}
            if "init" in keywords and ast.unparse(keywords["init"]) == "False":
                continue
            if "default" in keywords:
                text += " = " + ast.unparse(keywords["default"])
            elif "default_factory" in keywords:
                text += " = <factory>"
        elif value is not None:
            text += " = " + ast.unparse(value)
        out.append(text)
    return out


def methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {item.name: item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}


def written(head: str, params: list[str], tail: str = "") -> str:
    """``head(params)tail`` on one line, or one parameter a line where that is longer than :data:`WIDTH`."""
    line = f"{head}({', '.join(params)}){tail}"
    if len(line) <= WIDTH or not params:
        return line
    return f"{head}(\n" + "".join(f"    {p},\n" for p in params) + f"){tail}"


def constructor(found: Found, node: ast.ClassDef) -> str | None:
    """The class called as its ``__init__`` (own, a dataclass's, or a base's defined in the same module)."""
    own = methods(node).get("__init__")
    if own is not None:
        return written(f"fxpipe.{found.name}", arguments(own.args, drop_first=True))
    deco = is_dataclass(node)
    if deco is not None:
        return written(f"fxpipe.{found.name}", dataclass_fields(node, deco))
    classes = {n.name: n for n in found.tree.body if isinstance(n, ast.ClassDef)}
    for base in node.bases:
        parent = classes.get(ast.unparse(base))
        if parent is not None and parent is not node:
            inherited = constructor(Found(found.name, found.module, found.path, parent, found.tree), parent)
            if inherited is not None:
                return inherited
    return None


def first_paragraph(doc: str | None) -> str:
    """The docstring's first paragraph in Markdown: reStructuredText roles and double backticks as code."""
    if not doc:
        return "No docstring."
    text = doc.strip().split("\n\n", 1)[0].strip()
    text = re.sub(r":(?:class|func|mod|meth|data|attr|exc|obj):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(line.strip() for line in text.splitlines())


def entry(found: Found) -> str:
    node = found.node
    where = found.path.relative_to(ROOT).as_posix()
    lines = [f"## `{found.name}`", ""]
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        kind = "dataclass" if is_dataclass(node) is not None else (
            "exception" if found.name.endswith("Error") else "class")
        signature = constructor(found, node) or (f"class {found.name}({bases})" if bases else f"class {found.name}")
        lines += [f"{kind}" + (f", a subclass of {', '.join(f'`{ast.unparse(b)}`' for b in node.bases)}" if bases else "")
                  + f"; defined in [`{where}`](../{where})", "", "<!-- text -->", "```python", signature, "```", "",
                  first_paragraph(ast.get_docstring(node))]
        public = [m for m in methods(node) if not m.startswith("_")]
        if public:
            lines += ["", "Its methods and properties: " + ", ".join(f"`{m}`" for m in public) + "."]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        tail = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
        lines += [f"function; defined in [`{where}`](../{where})", "", "<!-- text -->", "```python",
                  written(f"fxpipe.{found.name}", arguments(node.args), tail), "```", "",
                  first_paragraph(ast.get_docstring(node))]
    else:
        annotation = ast.unparse(node.annotation) if isinstance(node, ast.AnnAssign) else type(
            ast.literal_eval(node.value)).__name__
        lines += [f"constant; defined in [`{where}`](../{where})", "", "<!-- text -->", "```python",
                  f"fxpipe.{found.name}: {annotation}", "```", "",
                  first_paragraph(ast.get_docstring(found.tree))]
    return "\n".join(lines) + "\n"


def render() -> str:
    names = package_all()
    found = [find("fxpipe", n) for n in names]
    index = " · ".join(f"[`{f.name}`](#{a})" for f, a in zip(found, anchors([f.name for f in found])))
    head = (
        "# API reference\n\n"
        "Every name in `fxpipe.__all__`, in its order: its signature as the source writes it and the first paragraph\n"
        "of its docstring (the rest: `help(fxpipe.NAME)`, or the source file named). `fxpipe.distributed` (the\n"
        "rank classes, checkpoints, clipping) is documented on [Multi-process, multi-node and meshes](meshes.md).\n"
        "This page is written by `python tools/api_doc.py` from the source; `tests/test_api_doc.py` checks that it\n"
        "documents exactly the names of `fxpipe.__all__` and is what the tool writes.\n\n"
        + index + "\n"
    )
    return head + "".join("\n" + entry(f) for f in found)


def anchors(headings: list[str]) -> list[str]:
    """GitHub's anchors of these headings, in order: lower case, punctuation dropped, spaces as hyphens, and a
    repeated one numbered (``plan`` after ``Plan`` is ``plan-1``)."""
    seen: dict[str, int] = {}
    out = []
    for heading in headings:
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.append(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python tools/api_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}: {len(package_all())} names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
