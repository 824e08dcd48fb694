"""The house rules ARCHITECTURE.md states, checked from the code itself: no import circle inside l2l_cli/
(imports inside functions count: a lazy import hides a circle, it does not remove it), and the floors'
arrows point down (engine/ never imports modes/, the ground floor imports nothing of the package)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.util import REPO

PACKAGE = REPO / "l2l_cli"


def module_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports, from every ``import`` / ``from ... import`` in its source
    (at any depth: functions, methods, ``if TYPE_CHECKING`` blocks). ``from pkg import name`` points at
    ``pkg.name`` when that is a module, else at ``pkg``."""
    top = root.name
    modules: dict[str, tuple[Path, bool]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, (path, is_pkg) in modules.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names
                ]
            for t in targets:
                if t == top or t.startswith(top + "."):
                    found = known(t)
                    if found and found != mod:
                        graph[mod].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_in_the_package() -> None:
    graph = module_graph(PACKAGE)
    assert len(graph) > 60 and sum(map(len, graph.values())) > 150  # the walk saw the package
    assert circles(graph) == []


def test_the_circle_check_catches_a_lazy_import_circle(tmp_path) -> None:
    """A probe package: a -> b at the top, b -> c inside a function, c -> a through ``from . import``."""
    pkg = tmp_path / "probe"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from probe.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from probe.sub.c import g\n    return g\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\n\ndef g():\n    return a\n")
    (pkg / "d.py").write_text("import probe.a\n")  # imports into the circle, not part of it
    graph = module_graph(pkg)
    assert graph["probe.sub.b"] == {"probe.sub.c"} and graph["probe.sub.c"] == {"probe.a"}
    assert circles(graph) == [["probe.a", "probe.sub.b", "probe.sub.c"]]
    (pkg / "sub" / "c.py").write_text("def g():\n    return 1\n")
    assert circles(module_graph(pkg)) == []


def _imports(graph: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    return {m: deps for m, deps in graph.items() if m == prefix or m.startswith(prefix + ".")}


def test_floors_point_down() -> None:
    """ARCHITECTURE.md's invariants: the ground floor imports nothing of the package; engine/, models/ and
    data/ never import a mode, a parallel strategy, the session, the loop or the config's checker."""
    graph = module_graph(PACKAGE)
    for ground in ("l2l_cli.problems", "l2l_cli.runfiles", "l2l_cli.config.schema"):
        assert graph[ground] == set(), ground
    upstairs = ("l2l_cli.modes", "l2l_cli.parallel", "l2l_cli.session", "l2l_cli.loop", "l2l_cli.train",
                "l2l_cli.config.validate", "l2l_cli.cli", "l2l_cli.plan", "l2l_cli.report")  # fmt: skip
    for floor in ("l2l_cli.engine", "l2l_cli.models", "l2l_cli.data"):
        for mod, deps in _imports(graph, floor).items():
            bad = sorted(d for d in deps if d.startswith(upstairs))
            assert bad == [], f"{mod} imports {bad}"


def test_torch_cuda_is_used_only_in_the_device_module() -> None:
    """The CPU, sim and CUDA paths differ in one place: ``torch.cuda`` (memory stats, streams, events, RNG,
    synchronize) is called from ``engine/device.py`` only, which tests can replace or fake."""
    import re

    root = PACKAGE
    uses = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "engine" / "device.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\btorch\.cuda\b|from torch import cuda\b|import torch\.cuda\b", code):
                uses.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not uses, "torch.cuda outside engine/device.py:\n" + "\n".join(uses)
