"""The tree keeps the shape docs/architecture.md describes: no import cycles between modules (every
import counted, lazy and `if TYPE_CHECKING:` ones included), the layers of pyproject.toml's
import-linter contracts, and types that mean something (few explicit `Any`, every ignore explained)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("cli", "engine", "kernels")  # the three layers, folders of ubatch/
PKG = ROOT / "ubatch"


def project_modules() -> dict[str, Path]:
    """Every module of the package by its import name."""
    mods: dict[str, Path] = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = ["ubatch", *path.relative_to(PKG).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def imported(mods: dict[str, Path], name: str, tree: ast.AST) -> set[str]:
    """The project modules a module imports anywhere in its body."""
    is_pkg = mods[name].name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_cycles_counting_every_import() -> None:
    mods = project_modules()
    assert "ubatch.engine.serve.scheduler" in mods and "ubatch.llama" in mods
    graph = {m: imported(mods, m, ast.parse(p.read_text())) for m, p in mods.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    """The check above can fail: a lazy import closing a loop is reported."""
    mods = {"ubatch.a": Path("a.py"), "ubatch.b": Path("b.py"), "ubatch.c": Path("c.py")}
    a = ast.parse("from ubatch.b import x\n")
    b = ast.parse("def f():\n    from ubatch import c\n")
    c = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ubatch.a import y\n")
    graph = {m: imported(mods, m, t) for m, t in zip(mods, (a, b, c))}
    assert cycles(graph) == [["ubatch.a", "ubatch.b", "ubatch.c"]]


def test_layers_hold() -> None:
    """pyproject.toml's import-linter contracts: cli > API > engine > kernels, and the order of the
    packages inside engine/ and kernels/."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is a test dependency (pip install -e '.[test]')"
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_types_mean_something() -> None:
    """At most 20 explicit `Any` in engine/ and kernels/ (values that truly are arbitrary), and no
    `type: ignore` without an error code and a reason."""
    bare: list[str] = []
    paths = [*sorted((PKG / "engine").rglob("*.py")), *sorted((PKG / "kernels").rglob("*.py"))]
    n_any = sum(len(re.findall(r"\bAny\b", p.read_text())) for p in paths)
    for path in [*paths, *sorted(PKG.glob("*.py"))]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"#\s*type:\s*ignore(\[[^\]]+\])?(.*)", line)
            if m and (not m.group(1) or not m.group(2).strip().lstrip("#").strip()):
                bare.append(f"{path.relative_to(ROOT)}:{i}")
    assert n_any <= 20
    assert bare == []


def test_architecture_doc_names_files_that_exist() -> None:
    """docs/architecture.md says where each idea lives: every path it names is in the tree."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:cli|engine|kernels|ubatch|scripts|tests)/[\w./]*)`", doc))
    assert len(named) > 40
    # paths of the three layers are written from ubatch/ (`engine/kv/cells.py` is ubatch/engine/kv/cells.py)
    missing = sorted(p for p in named if not (PKG / p if p.split("/")[0] in TOPS else ROOT / p).exists())
    assert missing == []


def test_the_root_shadows_no_third_party_package(tmp_path: Path) -> None:
    """Python started from the repository's root puts the root first on sys.path: the only package
    found there is `ubatch`, so `import kernels` (transformers' kernel hub), `import engine` or
    `import cli` reach whatever is installed under that name, never a folder of ours."""
    shadowing = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert shadowing == ["ubatch"]
    code = (
        "import importlib.util as u, sys\n"
        "for n in ('kernels', 'engine', 'cli'):\n"
        "    s = u.find_spec(n)\n"
        "    print(n, s.origin if s else None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    found = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    # an installed package may live under the root when the virtual environment does (CI's .venv)
    ours = [o for o in found.values() if o.startswith(str(ROOT) + "/") and not o.startswith(sys.prefix + "/")]
    assert len(found) == 3 and not ours, found
