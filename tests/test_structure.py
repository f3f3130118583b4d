"""The package's shape: no import cycles, no module reaching into another's private names, every module importable
on its own, and the package docstring a map of every module (issue 16)."""
import ast
import subprocess
import sys
from pathlib import Path

import labutils

PKG = Path(labutils.__file__).parent
MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__"))


def _tree(name: str) -> ast.Module:
    return ast.parse((PKG / f"{name}.py").read_text(encoding="utf-8"))


def _imports(tree: ast.Module) -> list[tuple[str, str]]:
    """(module, name) for every import of a labutils module anywhere in the file, lazy ones inside functions too:
    ``from .x import y`` -> (x, y); ``from . import x`` -> (x, ""); ``import labutils.x`` -> (x, "")."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found += [(node.module.split(".")[0], a.name) for a in node.names]
            elif node.level == 1:
                found += [(a.name, "") for a in node.names]
            elif node.module and node.module.startswith("labutils."):
                found += [(node.module.split(".")[1], a.name) for a in node.names]
            elif node.module == "labutils":
                found += [(a.name, "") for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".")[1], "") for a in node.names if a.name.startswith("labutils.")]
    return found


def import_graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(_tree(m)) if t in MODULES and t != m} for m in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search with colours)."""
    colour, stack = {m: 0 for m in graph}, []

    def visit(m):
        colour[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if colour[t] == 1:
                return stack[stack.index(t):] + [t]
            if colour[t] == 0 and (cycle := visit(t)):
                return cycle
        colour[m] = 2
        stack.pop()
        return None

    for m in graph:
        if colour[m] == 0 and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    """Every import counts, the lazy ones inside functions too: a lazy import hides a cycle, it does not remove it."""
    assert find_cycle(import_graph()) is None


def test_no_module_uses_another_modules_private_names():
    offences = []
    for m in MODULES:
        tree = _tree(m)
        offences += [f"{m}: from {t} import {n}" for t, n in _imports(tree)
                     if n.startswith("_") and not n.startswith("__") and t != m]
        aliases = {}  # local name -> labutils module, for `from . import x as y` / `import labutils.x as y`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and not node.module:
                aliases.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name.split(".")[1] for a in node.names
                                if a.name.startswith("labutils.") and a.asname})
        offences += [f"{m}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")]
    assert offences == []


def test_every_module_imports_on_its_own():
    """Each module with no other labutils module loaded before it (torch stays loaded, so this takes seconds): an
    import that only works after another module happened to be imported first fails here. ``labutils/__init__``
    always runs first and loads the core modules it exports; the cycle test above covers those."""
    code = ("import importlib, sys, torch\n"
            f"for m in {MODULES!r}:\n"
            "    for k in [k for k in sys.modules if k == 'labutils' or k.startswith('labutils.')]:\n"
            "        del sys.modules[k]\n"
            "    importlib.import_module('labutils.' + m)\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PKG.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_import_labutils_does_not_load_the_compiler():
    """`import labutils` (each notebook kernel, each CLI command, each subprocess of the tests) leaves torch._dynamo
    unloaded: it cost about 2 s of every such process (CI time, issue 29 §5). Breaks if a module applies
    ``torch.compiler.disable`` or imports torch._dynamo / torch._inductor at import time; compiling code imports
    them when it compiles (labutils.compiling, models.guard_causal_mask)."""
    code = "import sys, labutils\nprint(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-3000:]


def test_package_docstring_maps_every_module():
    """``labutils.__doc__`` names each module once, at the start of a line, under core / labs / tools."""
    doc = labutils.__doc__
    named = [line.split()[0] for line in doc.splitlines() if line.startswith("  ") and line.strip()]
    assert sorted(named) == MODULES, f"the docstring maps {sorted(named)}"
    headings = [line.split()[0].lower() for line in doc.splitlines() if line.endswith(":") and line[:1].isalpha()]
    assert headings == ["core", "labs", "tools"]
