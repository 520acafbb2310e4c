"""The package's layout shows the data path: no import cycle (function-level imports count), the
subpackages depend on each other one way only, nothing outside ``cuda/`` reaches into it but the
cache factory, and no issue number is cited anywhere in the tree."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moeflux_mlx"
# lower first: a module may import from its own level and the levels before it
LEVELS = [
    {"errors", "options", "counters", "demo_model"},
    {"format"},
    {"io"},
    {"cache"},
    {"compute"},
    {"cuda"},
    {"model"},
    {"measure"},
    {"commands"},
    {"cli", "__init__", "__main__"},
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path):
    """Every moeflux_mlx module ``path`` imports, at any depth (function-level included)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("moeflux_mlx")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("moeflux_mlx"):
                continue
            for alias in node.names:  # ``from . import x``: x may be a module
                sub = f"{target}.{alias.name}"
                found.add(sub if _exists(sub) else target)
    return found


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _graph():
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _level(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, names in enumerate(LEVELS) if top in names)


def test_no_import_cycle():
    graph = _graph()
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n not in graph:
                continue
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_subpackages_depend_one_way():
    bad = [
        f"{m} imports {n}"
        for m, deps in _graph().items()
        for n in deps
        if n != "moeflux_mlx" and _level(n) > _level(m)
    ]
    assert not bad, "\n".join(bad)


def test_only_the_cache_factory_reaches_into_cuda():
    outside = {
        m: {n for n in deps if n.startswith("moeflux_mlx.cuda")}
        for m, deps in _graph().items()
        if not m.startswith("moeflux_mlx.cuda")
    }
    assert {m for m, deps in outside.items() if deps} == {"moeflux_mlx.model.runtime"}


def test_each_package_says_what_it_owns():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)} has no docstring"


def test_no_issue_numbers_in_the_tree():
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    pattern = re.compile(r"\bissues?\s*#?\s*\d+", re.I)
    hits = []
    for f in files:
        path = ROOT / f
        if not path.is_file() or path.suffix in (".png", ".json", ".bin", ".npy", ".safetensors"):
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{f}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not hits, "\n".join(hits[:20])


def test_every_module_is_the_products():
    """The wheel holds only the product: every module is reached from the public API, the
    command line, or a process the product starts (``python -m moeflux_mlx...``), never only
    from the tests or the benchmarks; and the wheel's package list is the package's folders."""
    graph = _graph()
    started = {
        m
        for p in PACKAGE.rglob("*.py")
        for m in re.findall(r'"-m",\s*"(moeflux_mlx[\w.]*)"', p.read_text())
    }
    # the package, its command line and ``python -m moeflux_mlx``
    seen, todo = set(), ["moeflux_mlx", "moeflux_mlx.cli", "moeflux_mlx.__main__", *started]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages run first
        todo += [n for n in graph.get(m, ()) if n in graph]
    assert sorted(set(graph) - seen) == []
    listed = re.search(r"packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S)
    folders = {
        _module_name(init.parent / "__init__.py") for init in PACKAGE.rglob("__init__.py")
    } | {"moeflux_mlx.metal_kernels", "moeflux_mlx.demo_model.checkpoint"}
    assert set(re.findall(r'"([\w.]+)"', listed.group(1))) == folders
