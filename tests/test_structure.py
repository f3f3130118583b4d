"""The package's shape: no import cycles, no module reaching into another's private names, every module importable
on its own, and the package docstring a map of every module (issue 16)."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import labutils

PKG = Path(labutils.__file__).parent
# every module as its dotted path below labutils ("core.train", "labs.lab03.checkpointing"); packages' __init__ aside
MODULES = sorted(".".join(p.relative_to(PKG).with_suffix("").parts) for p in PKG.rglob("*.py")
                 if p.stem not in ("__init__", "__main__"))
PACKAGES = sorted(".".join(p.parent.relative_to(PKG).parts) for p in PKG.rglob("__init__.py") if p.parent != PKG)


def _tree(name: str) -> ast.Module:
    return ast.parse(PKG.joinpath(*name.split(".")).with_suffix(".py").read_text(encoding="utf-8"))


def _module_of(dotted: str) -> str | None:
    """The module a dotted path below labutils names, or None (a package, or a name inside a module)."""
    return dotted if dotted in MODULES else None


def _imports(tree: ast.Module, here: str) -> list[tuple[str, str]]:
    """(module, name) for every import of a labutils module anywhere in the file of module ``here``, lazy ones
    inside functions too: ``from ..core.train import run`` -> ("core.train", "run"); ``from ..core import device``
    and ``import labutils.core.device`` -> ("core.device", "")."""
    package = here.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "labutils" or node.module.startswith("labutils.")):
                base = node.module.split(".")[1:]
            else:
                continue
            target = ".".join(base)
            if _module_of(target):
                found += [(target, a.name) for a in node.names]
            else:
                found += [(f"{target}.{a.name}".strip("."), "") for a in node.names
                          if _module_of(f"{target}.{a.name}".strip("."))]
        elif isinstance(node, ast.Import):
            found += [(a.name.split(".", 1)[1], "") for a in node.names
                      if a.name.startswith("labutils.") and _module_of(a.name.split(".", 1)[1])]
    return found


def import_graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(_tree(m), m) if t != m} for m in MODULES}


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
        offences += [f"{m}: from {t} import {n}" for t, n in _imports(tree, m)
                     if n.startswith("_") and not n.startswith("__") and t != m]
        aliases = {}  # local name -> labutils module, for `from ..core import x as y` / `import labutils.x.y as z`
        for node in ast.walk(tree):
            if isinstance(node, (ast.ImportFrom, ast.Import)):
                for a in node.names:  # the local name of an imported module, when the import binds one
                    one = ast.Module(body=[type(node)(**{**{f: getattr(node, f) for f in node._fields},
                                                        "names": [a]})], type_ignores=[])
                    if a.asname or isinstance(node, ast.ImportFrom):
                        aliases.update({a.asname or a.name: t for t, n in _imports(one, m) if n == ""})
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
    them when it compiles (labutils.core.compiling, models.guard_causal_mask)."""
    code = "import sys, labutils\nprint(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-3000:]


def test_package_docstring_maps_every_module():
    """``labutils.__doc__`` is the map: a heading per subpackage (``core/``), each of its modules once under it, at
    the start of an indented line."""
    doc, current, named = labutils.__doc__, None, []
    for line in doc.splitlines():
        if re.match(r"[a-z][\w/]*/(\s|$)", line):
            current = line.split()[0].rstrip("/").replace("/", ".")
        elif line.startswith("  ") and line.strip() and current:
            named.append(f"{current}.{line.split()[0]}")
    assert sorted(named) == MODULES, f"the docstring maps {sorted(named)}"
