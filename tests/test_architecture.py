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
    upstairs = (
        "l2l_cli.modes",
        "l2l_cli.parallel",
        "l2l_cli.session",
        "l2l_cli.loop",
        "l2l_cli.train",
        "l2l_cli.config.validate",
        "l2l_cli.cli",
        "l2l_cli.plan",
        "l2l_cli.report",
    )
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


# ---- the step path: a newcomer's walk from Trainer.run to the optimizer (ARCHITECTURE.md, "follow one step")

STEP_PATH = ("engine", "modes", "checkpoint")  # the packages the step path runs through
MAX_LINES = 450


def test_no_module_on_the_step_path_is_over_450_lines() -> None:
    """Each module of the step path's packages reads in one sitting (``engine/`` itself, ``modes/``, the
    checkpoint package); a bigger one is split by concern."""
    paths = [p for name in STEP_PATH for p in (PACKAGE / name).glob("*.py")]
    paths += [PACKAGE / f"{name}.py" for name in STEP_PATH if (PACKAGE / f"{name}.py").exists()]
    assert len(paths) > 30  # the walk saw the packages
    big = {
        str(p.relative_to(PACKAGE)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}, f"modules over {MAX_LINES} lines: {big}"


def test_no_module_of_the_package_is_over_450_lines() -> None:
    """Every module of ``l2l_cli/`` reads in one sitting (issue 41): a bigger one is split by concern."""
    paths = list(PACKAGE.rglob("*.py"))
    assert len(paths) > 150  # the walk saw the package
    big = {
        str(p.relative_to(PACKAGE)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}, f"modules over {MAX_LINES} lines: {big}"


def test_no_module_re_exports_a_name_it_does_not_use() -> None:
    """A split module leaves no re-export behind (``from x import name as name``): callers import a name
    from the module that defines it, so a reader finds it in one hop."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                found += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {a.name}"
                    for a in node.names
                    if a.asname == a.name
                ]
    assert found == [], "\n".join(found)


RETIRED_NAMES = {  # the house's old verbs -> the field's words (issue 41, item 5; ARCHITECTURE.md "Names")
    "settle": "finish_updates",
    "turn": "head_forward_backward",
    "head_turn": "run_head",
    "landed": "on_grads_ready",
    "land_grad": "receive_grad",
    "let_go": "release_graph",
    "homes": "graph_slots",
    "adopt": "load_committed",
    "adopted": "resumed",
    "must": "bound_slot",
    "_grant": "_serve_pin",
}


def test_the_retired_verbs_name_nothing_in_the_package() -> None:
    """No function, method, attribute or variable of ``l2l_cli/`` is named by a retired verb."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            found += [
                f"{path.relative_to(PACKAGE)}:{node.lineno}: {n} -> {RETIRED_NAMES[n]}"
                for n in names
                if n in RETIRED_NAMES
            ]
    assert found == [], "\n".join(found)


def forwarding_methods(source: str, cls: str) -> list[str]:
    """Methods (and properties) of class ``cls`` whose body, past a docstring, only hands the call to a
    part's member of the same name: ``return self.part.name(...)``, ``self.part.name(...)`` or ``return
    self.part.name``: a shim that hides which part does the work."""
    tree = ast.parse(source)
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ClassDef) and node.name == cls):
            continue
        for fn in node.body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            body = fn.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if len(body) != 1 or not isinstance(body[0], ast.Return | ast.Expr) or body[0].value is None:
                continue
            value = body[0].value
            target = value.func if isinstance(value, ast.Call) else value
            if (
                isinstance(target, ast.Attribute)
                and target.attr == fn.name
                and isinstance(target.value, ast.Attribute)
                and isinstance(target.value.value, ast.Name)
                and target.value.value.id == "self"
            ):
                out.append(fn.name)
    return out


def test_the_forwarding_check_finds_a_shim() -> None:
    probe = (
        "class E:\n"
        "    def step(self, x):\n        return self.update.step(x)\n"
        "    @property\n    def rollbacks(self):\n        '''doc'''\n        return self.spec.rollbacks\n"
        "    def finish_updates(self):\n        self.worker.wait_all()\n"
        "    def own(self, x):\n        return self.part.other(x)\n"
    )
    assert forwarding_methods(probe, "E") == ["step", "rollbacks"]


def test_the_eps_composes_its_parts_without_forwarding_shims() -> None:
    """The EPS's parts are its public attributes (``worker``, ``tier``, ``files``), called by whoever needs
    them; no method of the EPS, the relay or the schedules beside it only forwards to a part's namesake."""
    engine = PACKAGE / "engine"
    for module, cls in (
        ("eps", "EagerParamServer"),
        ("speculative", "Speculation"),
        ("trailing", "TrailingUpdate"),
        ("relay", "Relay"),
    ):
        assert forwarding_methods((engine / f"{module}.py").read_text(), cls) == [], f"{module}.{cls}"


def test_the_eps_does_not_know_the_schedules_built_beside_it() -> None:
    """The speculative and the trailing update take the EPS as their layer store at construction; the EPS
    imports neither (no part reaches back into the object that owns it)."""
    graph = module_graph(PACKAGE)
    eps = "l2l_cli.engine.eps"
    assert not graph[eps] & {"l2l_cli.engine.speculative", "l2l_cli.engine.trailing"}
    assert eps in graph["l2l_cli.engine.speculative"] and eps in graph["l2l_cli.engine.trailing"]
    source = (PACKAGE / "engine" / "eps.py").read_text()
    assert "speculation" not in source and "self.trailing" not in source


def test_tests_use_only_public_names_of_the_eps() -> None:
    """No test reaches into the EPS by an underscore name (its held trailing update, its thread's pool):
    the tests use the parts' public names, and the product carries no property only a test uses."""
    import re

    uses = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\beps\._[a-z]", line):
                uses.append(f"{path.name}:{n}: {line.strip()}")
    assert not uses, "private EPS names in tests:\n" + "\n".join(uses)
    tree = ast.parse((PACKAGE / "engine" / "eps.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "EagerParamServer")
    private_props = [
        fn.name
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef)
        and fn.name.startswith("_")
        and any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
    ]
    assert private_props == []


# ---- the session builds; the pipeline's parts each have a module; its summary only reports -------------

PIPELINE = PACKAGE / "parallel" / "pipeline"


def test_the_session_and_the_pipeline_modules_are_at_most_450_lines() -> None:
    """The builder, what left it (the dev split's evaluation, the memory report) and each module of the
    pipeline (runners, groups, p2p, checkpoint shards, the bubble model) read in one sitting."""
    paths = [PACKAGE / f"{m}.py" for m in ("session", "dev_eval", "memory_report", "run_header")]
    paths += sorted(PIPELINE.glob("*.py"))
    assert len(paths) > 12  # the walk saw the pipeline package
    big = {
        str(p.relative_to(PACKAGE)): n for p in paths if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}, f"modules over {MAX_LINES} lines: {big}"


def _defined(tree: ast.AST) -> dict[str, list[ast.FunctionDef]]:
    out: dict[str, list[ast.FunctionDef]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            out.setdefault(node.name, []).append(node)
    return out


def test_the_session_defines_no_evaluation_or_report() -> None:
    """``session.py`` builds a run's parts and nothing else: evaluating the dev split lives in
    ``dev_eval.py``, memory.json in ``memory_report.py``, train.log's header and the progress title in
    ``run_header.py``; the session imports none of the report's types nor calls a model's evaluation."""
    tree = ast.parse((PACKAGE / "session.py").read_text())
    names = set(_defined(tree))
    words = ("evaluat", "report", "header", "title")  # what a run reports; building one is ``_make_*``
    assert not {n for n in names if any(w in n for w in words) and not n.startswith("_make_")}
    calls = {
        n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    }
    assert not calls & {"evaluate", "predict", "getrusage", "memory_stats"}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not imported & {"MemoryReport", "DeviceMemory", "HostMemory", "Transfer", "EvalStopped"}
    graph = module_graph(PACKAGE)
    assert "l2l_cli.dev_eval" in graph["l2l_cli.session"]
    assert "l2l_cli.memory_report" in graph["l2l_cli.train"]


# torch.distributed's collectives and point-to-point calls
COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "barrier",
    "gather_object",
    "all_gather_object",
    "all_gather",
    "gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
    "new_group",
    "broadcast_object_list",
    "scatter",
}


def reached_calls(sources: dict[str, str], roots: list[tuple[str, str]]) -> set[str]:
    """Every name called from methods ``roots`` ((class, method)) and, transitively, from the functions
    and methods of ``sources`` (module name -> source) those calls name: a call graph by bare name (a
    call ``x.f()`` or ``f()`` reaches every ``def f`` in the sources)."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    defs: dict[str, list[ast.FunctionDef]] = {}
    for tree in trees.values():
        for name, fns in _defined(tree).items():
            defs.setdefault(name, []).extend(fns)
    todo: list[ast.FunctionDef] = []
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                todo += [
                    f for f in node.body if isinstance(f, ast.FunctionDef) and (node.name, f.name) in roots
                ]
    assert todo, f"none of {roots} found"
    seen: set[int] = set()
    called: set[str] = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for node in ast.walk(fn):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name is not None:
                    called.add(name)
                    todo += defs.get(name, [])
    return called


def test_the_reached_calls_walk_follows_helpers_into_other_modules() -> None:
    sources = {
        "a": "class R:\n    def sections(self):\n        return helper(self.x)\n",
        "b": "import torch.distributed as dist\ndef helper(x):\n    dist.barrier()\n    return probe(x)\n"
        "def probe(x):\n    return time_exchange(x)\n",
    }
    assert {"helper", "barrier", "probe", "time_exchange"} <= reached_calls(sources, [("R", "sections")])


def test_the_pipelines_summary_runs_no_calibration_and_no_collective_but_the_ranks_gather() -> None:
    """``sections()`` reports: the costs of a message and a schedule action are measured where a runner
    is built (``calibrate.link_costs``), never while the summary is written; the only collective the
    summary runs is the gather of every rank's times, and the bubble model (``bubble.py``) talks to no
    other rank."""
    sources = {p.stem: p.read_text() for p in sorted(PIPELINE.glob("*.py"))}
    calibration = set(_defined(ast.parse(sources["calibrate"])))
    assert {"time_exchange", "action_seconds", "wake_seconds"} <= calibration
    roots = [("PipelineRunner", "sections"), ("L2LStagesRunner", "sections")]
    called = reached_calls(sources, roots)
    assert called & calibration == set(), sorted(called & calibration)
    assert called & COLLECTIVES == {"all_gather_object"}, sorted(called & COLLECTIVES)
    bubble = ast.parse(sources["bubble"])
    imports = {a.name for n in ast.walk(bubble) if isinstance(n, ast.Import) for a in n.names}
    imports |= {n.module or "" for n in ast.walk(bubble) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("torch") or m.endswith("calibrate") for m in imports), sorted(imports)
    # and the runners measure once, as they are built
    for module, cls in (("runner", "PipelineRunner"), ("l2l_stages", "L2LStagesRunner")):
        assert "link_costs" in reached_calls({module: sources[module]}, [(cls, "__init__")]), cls
