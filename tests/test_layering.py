"""The layers import downward only, at the top of a module or inside a function (where a cycle would hide); no two
modules import each other, directly or around a longer circle; the analysis layer reads rows and never imports the
code that writes them (experiments/), and none of its files grows past ANALYSIS_MAX_LINES.

A downward import inside a function is allowed only in the modules listed in LAZY: their `validate` runs before
any model loads and must refuse bad input in seconds, so they import torch-heavy layers only where they run.

Read from the source with `ast`: nothing is imported, so a violation is found even in code no test runs.
"""

import ast

import pytest

from conftest import ROOT

# bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS = [
    # model access, contract, data, what a run computes
    ("framework", ["infinigen.adapter", "infinigen.models", "infinigen.contract", "infinigen.corpora",
                   "infinigen.semantic", "infinigen.selected", "infinigen.attention", "infinigen.rows", "infinigen.stats",
                   "infinigen.budget", "infinigen.driver", "infinigen.runtime_needs", "infinigen.multihead"]),
    # sim/decode driver, offloading runtime, the Python API (methods built from conf/ by their _target_)
    ("runtimes", ["infinigen.modes", "infinigen.offload", "infinigen.api"]),
    ("methods", ["infinigen.method", "infinigen.shared", "baselines"]),
    ("experiments", ["experiments", "analysis.store"]),  # tasks and the runner, which writes the results store
    ("analysis", ["analysis"]),
    ("entry", ["run"]),
]
PACKAGES = ("infinigen", "baselines", "experiments", "analysis")
# modules that import lower layers inside functions on purpose (fast validation); never upward
LAZY = {"experiments.runner", "experiments.validation", "experiments.identity", "experiments.ppl",
        "experiments.latency", "experiments.lm_eval", "experiments.needle", "experiments.generate", "infinigen.adapter",
        # commands that set their process up first (glibc's allocator is read at start: they re-execute
        # themselves before the stack is imported; bench_memory measures what the import itself costs)
        "experiments.calibrate", "experiments.validate_perf", "experiments.bench_memory",
        # replays a census of another checkout's runtime (--census-from): the model imported once that is set up
        "experiments.validate_gpu"}


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int | None:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    return None if best is None else best[1]


def project_modules() -> list:
    files = [ROOT / "run.py"] + [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return [(module_name(p), p) for p in files]


def imports(path):
    """(imported module, line, inside a function) for every import of a project module (`from pkg import mod`
    counts as importing pkg.mod)."""
    known = {m for m, _ in project_modules()}
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(n) for f in functions for n in ast.walk(f) if n is not f}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES + ("run",) and layer_of(name) is not None:
                yield name, node.lineno, id(node) in nested


def test_every_module_has_a_layer():
    assert [m for m, _ in project_modules() if layer_of(m) is None and m not in PACKAGES] == []


LAYERED = [(m, p) for m, p in project_modules() if m not in PACKAGES]


@pytest.mark.parametrize("module,path", LAYERED, ids=[m for m, _ in LAYERED])
def test_imports_go_downward(module, path):
    own = layer_of(module)
    bad = []
    for name, line, in_function in imports(path):
        other = layer_of(name)
        if other > own:
            bad.append(f"line {line}: {name} ({LAYERS[other][0]}) is above {module} ({LAYERS[own][0]})")
        elif in_function and other != own and LAYERS[own][0] != "entry" and module not in LAZY:
            bad.append(f"line {line}: {name} imported inside a function: import it at the top")
    assert bad == []


def test_the_checker_catches_violations(tmp_path, monkeypatch):
    """An upward import and an in-function cross-layer import in a framework module are both reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import baselines.full\n\ndef f():\n    from infinigen import modes\n")
    found = [(name, in_function) for name, _, in_function in imports(bad)]
    assert ("baselines.full", False) in found and ("infinigen.modes", True) in found
    monkeypatch.setattr("test_layering.module_name", lambda path: "infinigen.adapter")
    with pytest.raises(AssertionError):
        test_imports_go_downward("infinigen.adapter", bad)


# ----------------------------------------------------------------------------------------------- circles


def import_graph(modules) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in it: a lazy import closes a circle as well)."""
    return {m: {name for name, _, _ in imports(p) if name != m} for m, p in modules}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one module (Tarjan's
    algorithm, iterative: a long chain of imports must not hit the recursion limit)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_two_modules_import_each_other():
    assert circles(import_graph(project_modules())) == []


def test_the_circle_finder_finds_pairs_and_longer_circles():
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set(), "g": {"a"}}
    assert sorted(circles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


# ----------------------------------------------------------------------------------------------- analysis

ANALYSIS_MAX_LINES = 300  # one module per claim (analysis/report/sections/) keeps every file readable at once
ANALYSIS = sorted((ROOT / "analysis").rglob("*.py"))


def test_no_analysis_file_is_over_the_line_limit():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ANALYSIS}
    long = {path: n for path, n in lines.items() if n > ANALYSIS_MAX_LINES}
    assert long == {}, f"split these by claim or concern (<= {ANALYSIS_MAX_LINES} lines each)"


def test_analysis_imports_nothing_from_experiments():
    """The rows' writers (experiments/) sit above what the analysis may import: what both need lives lower
    (infinigen/semantic.py: what a run computes; analysis/store: the store's files)."""
    found = [f"{p.relative_to(ROOT)}: {name}" for p in ANALYSIS for name, _, _ in imports(p)
             if name == "experiments" or name.startswith("experiments.")]
    text = [f"{p.relative_to(ROOT)}:{i}" for p in ANALYSIS for i, line in enumerate(p.read_text().splitlines(), 1)
            if line.lstrip().startswith(("from experiments", "import experiments"))]
    assert found == [] and text == []


# what a method author reads (infinigen/contract.py): the names its classes define, at most this many (17: the
# optional `prefix_resumable`, issue 70, is one a method author declares)
AUTHOR_NAMES = 17
METHOD_FILES = sorted((ROOT / "baselines").glob("*.py")) + sorted((ROOT / "infinigen" / "method").glob("*.py"))


def class_names(path) -> dict[str, list[str]]:
    """{class: the names its body defines (methods, attributes), dunders left out}."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names = []
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.append(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.append(item.target.id)
                elif isinstance(item, ast.Assign):
                    names += [t.id for t in item.targets if isinstance(t, ast.Name)]
            out[node.name] = [n for n in names if not n.startswith("__")]
    return out


def test_the_contract_shows_only_what_a_method_writes():
    """infinigen/contract.py is the page a method author reads (issue 57): the driver (infinigen/driver.py) and what
    the runtimes ask (infinigen/runtime_needs.py) live elsewhere."""
    names = class_names(ROOT / "infinigen" / "contract.py")
    assert set(names) == {"KVMethod", "GatheringMethod"}
    total = sum(len(v) for v in names.values())
    assert total <= AUTHOR_NAMES, names


def test_one_budget_check():
    """One function checks every method's budget (infinigen/budget.py), under one name."""
    defined = [f"{p.relative_to(ROOT)}" for _, p in project_modules()
               for node in ast.walk(ast.parse(p.read_text()))
               if isinstance(node, ast.FunctionDef) and "budget" in node.name and node.name.startswith("check")]
    assert defined == ["infinigen/budget.py"]


@pytest.mark.parametrize("path", METHOD_FILES, ids=[p.stem for p in METHOD_FILES])
def test_no_method_imports_a_helper_of_another(path):
    """What several methods share lives in infinigen/shared/ (or below): a method file imports from another method's
    file only a method class it builds on (RocketKV runs SnapKV's prompt compression); InfiniGen's own files
    (infinigen/method/) are one method."""
    mine = module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[:2] != mine.split(".")[:2] and any(
                node.module == module_name(p) for p in METHOD_FILES):
            helpers = [a.name for a in node.names if not a.name[:1].isupper() or a.name.isupper()]
            assert helpers == [], f"{mine} imports {helpers} from {node.module}: move them to infinigen/shared/"


# a module is one idea a newcomer can name (issue 57); these are longer and still one idea each
MODULE_MAX_LINES = 420
ONE_CONCEPT = {
    # counting what code dispatches, by one sync rule: the census's counter and bench_ops' share their tables
    "infinigen/offload/op_counter.py",
    # one command each, from its CLI to its rows: measuring a hardware profile; modelling the GPU rows again
    "experiments/calibrate.py", "experiments/validate_gpu.py",
}


def test_no_module_is_over_the_line_limit_unless_it_is_one_concept():
    files = [p for pkg in ("infinigen", "baselines", "experiments") for p in sorted((ROOT / pkg).rglob("*.py"))]
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    long = {path: n for path, n in lines.items() if n > MODULE_MAX_LINES and path not in ONE_CONCEPT}
    assert long == {}, f"split these by concept (<= {MODULE_MAX_LINES} lines each), or say why one is one concept"
    assert all(lines[path] > MODULE_MAX_LINES for path in ONE_CONCEPT), "no longer long: drop it from ONE_CONCEPT"
