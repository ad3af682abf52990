"""The package's module import graph, its layering rules, and the size of one step's hot path.

    python tools/import_graph.py [--root PATH] [--quiet]

Reads the source with `ast` (nothing is imported), prints which subpackages each subpackage imports
and checks the walls the architecture keeps (docs/architecture in STYLE.md's words):

- no import cycle among engine/, worker/, spec_decode/ and kv_cache/ modules;
- nothing under worker/ or models/ imports engine/ (the worker sees wire types, never the engine);
- only planner/, benchmarks/ and the command-line entry points import planner/ or benchmarks/.

Imports under `if TYPE_CHECKING:` count as well: a type the runtime may not import is still a
dependency a reader has to follow. It exits 1 on a violation, listing each one.

It also prints the line count of the step's hot path: the functions reachable from the roots below
(Scheduler.schedule and update, the worker's and model runner's execute methods) through calls it can
resolve statically (self.method(), module functions, and methods of attributes whose class __init__
names), within the step's own packages. Code lines only: no blanks, comments or docstrings.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "pagedllm"
# Subpackages whose modules must not import each other in a cycle.
ACYCLIC = ("engine", "worker", "spec_decode", "kv_cache")
# (importer subpackage, imported subpackage): forbidden edges.
FORBIDDEN = [("worker", "engine"), ("models", "engine")]
# Only these may import the planner and the benchmarks (they sit on top of the runtime).
OFFLINE = ("planner", "benchmarks")
OFFLINE_IMPORTERS = ("planner", "benchmarks", "entrypoints.cli", "entrypoints.bench_cmd")

HOT_ROOTS = [
    ("engine.scheduler", "Scheduler.schedule"),
    ("engine.scheduler", "Scheduler.update"),
    ("worker.worker", "Worker.execute_model"),
    ("worker.model_runner", "ModelRunner.execute"),
    ("worker.model_runner", "ModelRunner.execute_model"),
    # the executors encode each plan as deltas for the worker, the in-process one included
    ("executor.uniproc", "UniProcExecutor.execute_model"),
    ("executor.multiproc", "MultiprocExecutor.execute_model_async"),
    ("executor.multiproc", "MultiprocExecutor.get_model_output"),
]
# The step's bookkeeping lives here; the model's forward (models/, layers/, attention/) does not count.
HOT_PACKAGES = ("engine", "kv_cache", "worker", "spec_decode", "executor", "core_types", "layers.sampler")


@dataclass
class Module:
    name: str  # dotted, without the package prefix ("engine.scheduler")
    path: Path
    tree: ast.Module
    imports: dict[str, list[int]] = field(default_factory=dict)  # module -> lines
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local name -> (module, name)


def subpackage(module: str) -> str:
    return module.split(".")[0]


def load(root: Path) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root / PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts) or "__init__"
        modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    for module in modules.values():
        for node in ast.walk(module.tree):
            targets: list[tuple[str, str | None, str | None]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = module.name.split(".")
                    if not module.path.name == "__init__.py":
                        anchor = anchor[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([PACKAGE, *anchor, *([base] if base else [])])
                targets = [(base, a.name, a.asname or a.name) for a in node.names]
            for target, imported, local in targets:
                if target != PACKAGE and not target.startswith(PACKAGE + "."):
                    continue
                dotted = target[len(PACKAGE) + 1:] if target != PACKAGE else "__init__"
                # `from pagedllm.x import y` where y is a module is an import of x.y
                if imported is not None:
                    sub = imported if dotted == "__init__" else f"{dotted}.{imported}"
                    if sub in modules:
                        module.imports.setdefault(sub, []).append(node.lineno)
                        continue
                if dotted in modules:
                    module.imports.setdefault(dotted, []).append(node.lineno)
                    if imported is not None and local is not None:
                        module.names[local] = (dotted, imported)
    return modules


def find_cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), among the ACYCLIC subpackages."""
    nodes = [m for m in modules if subpackage(m) in ACYCLIC]
    edges = {m: [t for t in modules[m].imports if subpackage(t) in ACYCLIC and t != m] for m in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return components


def violations(modules: dict[str, Module]) -> list[str]:
    found = []
    for component in find_cycles(modules):
        found.append("import cycle: " + " <-> ".join(component))
    for module in modules.values():
        importer = subpackage(module.name)
        for target, lines in sorted(module.imports.items()):
            where = f"{module.path.as_posix()}:{lines[0]}"
            for src, dst in FORBIDDEN:
                if importer == src and subpackage(target) == dst:
                    found.append(f"{src}/ imports {dst}/: {module.name} -> {target} ({where})")
            if subpackage(target) in OFFLINE and not any(
                    module.name == p or module.name.startswith(p + ".") for p in OFFLINE_IMPORTERS):
                found.append(f"runtime imports {subpackage(target)}/: {module.name} -> {target} ({where})")
    return found


def print_graph(modules: dict[str, Module]) -> None:
    by_package: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module in modules.values():
        for target in module.imports:
            if subpackage(target) != subpackage(module.name):
                by_package[subpackage(module.name)][subpackage(target)].add(f"{module.name} -> {target}")
    for package in sorted(by_package):
        targets = by_package[package]
        print(f"{package}/ imports: {', '.join(sorted(targets))}")
        for target in sorted(targets):
            for edge in sorted(targets[target]):
                print(f"    {edge}")


# ---- the hot path ----

def _is_stub(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Protocol's or an abstract method's `...` body: an interface, not code that runs."""
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                         and isinstance(n.value.value, str))]
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and n.value.value is ... for n in body)


def _functions(module: Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    found: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_stub(node):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_stub(item):
                    found[f"{node.name}.{item.name}"] = item
    return found


def _class_of(modules: dict[str, Module], module: Module, name: str) -> tuple[str, str] | None:
    """Where the class called `name` in `module` is defined, as (module, class name)."""
    if name in module.names:
        target, imported = module.names[name]
        return _class_of(modules, modules[target], imported) if target != module.name else None
    for node in module.tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module.name, name
    return None


def _attribute_classes(modules: dict[str, Module], module: Module, cls: ast.ClassDef) -> dict[str, tuple[str, str]]:
    """self.<attr> -> class, from `self.attr = Class(...)` or `self.attr: Class | None = ...` in __init__."""
    found: dict[str, tuple[str, str]] = {}
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return found
    for node in ast.walk(init):
        candidates: list[str] = []
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                candidates.append(node.value.func.id)
        elif isinstance(node, ast.AnnAssign):
            target = node.target
            candidates += [n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)]
            if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
                candidates.append(node.value.func.id)
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
            continue
        for candidate in candidates:
            where = _class_of(modules, module, candidate)
            if where is not None:
                found[target.attr] = where
                break
    # parameters annotated with a class and stored as-is (self.kv = kv_cache_manager)
    params = {a.arg: a.annotation for a in init.args.args + init.args.kwonlyargs if a.annotation is not None}
    for node in ast.walk(init):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id in params):
            for name in (n.id for n in ast.walk(params[node.value.id]) if isinstance(n, ast.Name)):
                where = _class_of(modules, module, name)
                if where is not None:
                    found.setdefault(node.targets[0].attr, where)
                    break
    return found


def _in_hot_packages(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in HOT_PACKAGES)


def code_lines(module: Module, node: ast.AST) -> int:
    lines = module.path.read_text().splitlines()[node.lineno - 1:node.end_lineno]  # type: ignore[attr-defined]
    docstrings: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and inner.body:
            first = inner.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))  # type: ignore[operator]
    count = 0
    for offset, line in enumerate(lines):
        text = line.strip()
        if text and not text.startswith("#") and node.lineno + offset not in docstrings:  # type: ignore[attr-defined]
            count += 1
    return count


def hot_path(modules: dict[str, Module]) -> dict[tuple[str, str], int]:
    """(module, qualified function) -> code lines, for every function the roots reach."""
    functions = {name: _functions(m) for name, m in modules.items()}
    classes = {(name, n.name): n for name, m in modules.items() for n in m.tree.body if isinstance(n, ast.ClassDef)}
    attributes: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}
    reached: dict[tuple[str, str], int] = {}
    todo = [root for root in HOT_ROOTS if root[0] in functions and root[1] in functions[root[0]]]
    while todo:
        module_name, qualname = todo.pop()
        if (module_name, qualname) in reached or not _in_hot_packages(module_name):
            continue
        module = modules[module_name]
        node = functions[module_name][qualname]
        reached[(module_name, qualname)] = code_lines(module, node)
        owner = qualname.split(".")[0] if "." in qualname else None
        if owner is not None and (module_name, owner) not in attributes:
            attributes[(module_name, owner)] = _attribute_classes(modules, module, classes[(module_name, owner)])
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            target: tuple[str, str] | None = None
            if isinstance(func, ast.Name):
                if func.id in functions[module_name]:
                    target = (module_name, func.id)
                elif func.id in module.names:
                    target = module.names[func.id]
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                if owner is not None:
                    target = (module_name, f"{owner}.{func.attr}")
            elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
                  and isinstance(func.value.value, ast.Name) and func.value.value.id == "self" and owner is not None):
                where = attributes[(module_name, owner)].get(func.value.attr)
                if where is not None:
                    target = (where[0], f"{where[1]}.{func.attr}")
            if target is not None and target[0] in functions and target[1] in functions[target[0]]:
                todo.append(target)
    return reached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository root (default: this tool's)")
    parser.add_argument("--quiet", action="store_true", help="print only the checks and the hot-path total")
    parser.add_argument("--hot-path", action="store_true", help="list every hot-path function with its lines")
    args = parser.parse_args(argv)
    modules = load(args.root)
    if not args.quiet:
        print_graph(modules)
        print()
    reached = hot_path(modules)
    if args.hot_path:
        for (module_name, qualname), count in sorted(reached.items()):
            print(f"{count:5d}  {module_name}:{qualname}")
    print(f"hot path: {sum(reached.values())} code lines in {len(reached)} functions "
          f"(from {', '.join(q for _, q in HOT_ROOTS)})")
    found = violations(modules)
    for line in found:
        print(f"VIOLATION {line}")
    print(f"{len(found)} violations" if found else "layering: ok (no cycles, no upward or offline imports)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
