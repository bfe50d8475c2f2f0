"""The package's layers: each module imports only modules of its own layer or lower ones (the README's
Layout section draws them). Read from the source with `ast`, so a violation fails here, naming the file
and the import, before it becomes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import scalerl

PACKAGE = Path(scalerl.__file__).parent

# Top-level module or package of scalerl -> layer. Every module of the package must be listed.
LAYERS = {
    "__init__": 0, "core": 0,
    "models": 1, "algorithms": 1, "perf": 1, "tracking": 1,
    "parallel": 2, "comm": 2, "checkpoint": 2, "health": 2,
    "rollout": 3, "data": 3,
    "trainer": 4,
    "cli": 5, "__main__": 5, "demo": 5, "verify": 5, "launch": 5, "doctor": 5, "bench": 5, "report": 5,
    "plan": 5,
}
APPS = {name for name, layer in LAYERS.items() if layer == 5} - {"launch"}


def _top(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `scalerl...` import in the file, at any depth (lazy imports count too)."""
    module = "scalerl." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "scalerl"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module.rsplit(".", node.level)[0]
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            if name.split(".")[0] == "scalerl":
                if name == "scalerl":  # `from scalerl import x`: the submodule x, or a name of __init__
                    found += [(node.lineno, f"scalerl.{a.name}" if _is_submodule(a.name) else "scalerl")
                              for a in node.names]
                else:
                    found.append((node.lineno, name))
    return found


def _is_submodule(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def _source_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    missing = sorted({_top("scalerl." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
                      for p in _source_files()} - set(LAYERS))
    assert not missing, f"add these top-level modules/packages to LAYERS in {__file__}: {missing}"


def test_imports_go_down_the_layers():
    problems = []
    for path in _source_files():
        own = _top("scalerl." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for line, target in _imports(path):
            other = _top(target)
            if other == "__init__" and target != "scalerl":
                other = target.split(".")[1]
            if LAYERS.get(other, 99) > LAYERS[own]:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} (layer {LAYERS[own]}) imports "
                                f"{target} (layer {LAYERS.get(other)})")
    assert not problems, "imports that go up a layer:\n" + "\n".join(problems)


def test_applications_are_not_imported_by_the_library():
    """Applications (CLI, demo, verify) sit on top: nothing below imports them (only other apps may)."""
    problems = []
    for path in _source_files():
        own = _top("scalerl." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        for line, target in _imports(path):
            if _top(target) in APPS and LAYERS[own] < 5:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not problems, "\n".join(problems)


def test_no_import_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    for path in _source_files():
        name = "scalerl." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        name = name.removesuffix(".__init__")
        graph[name] = {t for _, t in _imports(path)}
    modules = set(graph)

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges = {m: {r for t in ts if (r := resolve(t)) and r != m} for m, ts in graph.items()}
    # A package's __init__ importing its own submodules is not a cycle to worry about; drop those edges.
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))
