"""The package's imports point one way (DESIGN.md): kernels, storage <- model <- engine <- sessions <- api
(Engine, Client) <- server, cli; no cycle between modules, no import inside a function to dodge one, and no
module that uses another module's private (``_x``) names.

``python tests/test_import_graph.py`` prints the graph between subpackages.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kda_sessions": ROOT / "kda_sessions", "kda_sessions.kernels": ROOT / "kernels",
           "kda_sessions.storage": ROOT / "storage"}

LAYERS = {
    # torch-free values every layer may use
    "errors": 0, "config": 0, "dtypes": 0, "generation_config": 0,
    "tokenizer": 1, "types": 1, "protocol": 1, "kernels": 1, "storage": 1,
    "model": 2,
    "engine": 3,
    "constrain": 4,
    "sessions": 5,
    "api": 6, "client": 6,
    "server": 7,
    "cli": 8, "bench_cli": 8, "demo": 8, "tools": 8, "builtin": 8,
}
"""Layer of each top-level part of the package: a module may import only from its own layer or lower ones."""

LATE_IMPORTS_ALLOWED = {
    # the command line imports the engine only for the commands that run a model (``sessions ls`` stays fast)
    "kda_sessions.cli", "kda_sessions.bench_cli",
    # the package's lazy ``ks.Engine`` and friends keep ``import kda_sessions.client`` torch-free
    "kda_sessions",
    # backends load when chosen (STYLE.md 9): Triton kernels, store backends, tokenizer libraries
    "kda_sessions.kernels.kda", "kda_sessions.kernels.kda.decode", "kda_sessions.kernels.mla", "kda_sessions.kernels.norm", "kda_sessions.kernels.conv",
    "kda_sessions.kernels.gate",
    "kda_sessions.kernels.linear", "kda_sessions.kernels.moe", "kda_sessions.kernels.feed", "kda_sessions.storage.backends.registry",
    "kda_sessions.tokenizer.loader",
}


def modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if prefix == "kda_sessions" and rel[0] in ("kernels", "storage"):
                continue
            name = ".".join((prefix, *rel)).removesuffix(".__init__")
            out[name] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, Path]) -> list[tuple[str, str, bool, list[str]]]:
    """(importer, imported module, inside a function, names imported) for every import within the package."""
    out = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        late: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                late.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("kda_sessions"):
                        out.append((mod, a.name, id(node) in late, []))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_package, node)
                if not target.startswith("kda_sessions"):
                    continue
                names = [a.name for a in node.names]
                # ``from pkg import submodule`` imports the submodule
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
                for t in subs or [target]:
                    out.append((mod, t, id(node) in late, names))
    return out


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_has_a_layer() -> None:
    assert {part(m) for m in modules()} - {"__init__"} - set(LAYERS) == set()


def test_imports_point_one_way() -> None:
    bad = []
    for src, dst, _, _ in imports(modules()):
        a, b = part(src), part(dst)
        if a == "__init__" or b == "__init__" or a == b:
            continue
        if LAYERS.get(b, 0) > LAYERS.get(a, 0):
            bad.append(f"{src} -> {dst}")
    assert bad == []


def test_no_import_cycle_and_no_late_import() -> None:
    known = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    late = []
    for src, dst, inside, _ in imports(known):
        if inside and src not in LATE_IMPORTS_ALLOWED:
            late.append(f"{src} -> {dst}")
        if not inside and dst in known and dst != src:
            edges[src].add(dst)
    assert late == []
    # a package's __init__ importing its own modules is how packages work, not a cycle
    cycles = []
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            if m.startswith(n + "."):
                continue
            if state.get(n) == 1:
                cycles.append(" -> ".join([*path[path.index(n) :], n]))
            elif n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(known):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_private_names_across_modules() -> None:
    known = modules()
    bad = [f"{src} imports {n} from {dst}" for src, dst, _, names in imports(known) if part(src) in PRIVATE_CHECKED
           for n in names if n.startswith("_") and not n.startswith("__") and dst != src]
    for mod, path in known.items():
        if part(mod) not in PRIVATE_CHECKED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and node.attr not in PRIVATE_OK):
                bad.append(f"{mod}:{node.lineno} uses .{node.attr}")
    assert bad == []


PRIVATE_OK = {"_replace", "_asdict", "_fields"}
"""Public API spelled with an underscore (namedtuples)."""

PRIVATE_CHECKED = {"engine", "constrain", "sessions", "api", "client", "server"}
"""Parts whose attribute uses are checked (elsewhere ``x._y`` is mostly torch's or a class's own instance)."""


def main() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst, _, _ in imports(modules()):
        a, b = part(src), part(dst)
        if a != b and "__init__" not in (a, b):
            graph[a].add(b)
    for a in sorted(graph, key=lambda p: (LAYERS[p], p)):
        print(f"{a:10} (layer {LAYERS[a]}) -> {', '.join(sorted(graph[a], key=lambda p: (LAYERS[p], p)))}")


if __name__ == "__main__":
    main()
