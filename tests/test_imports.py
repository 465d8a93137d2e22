"""No import cycle between course_lib's packages, function-local imports included, and the
layers of DESIGN.md: schedules below parallel/ and planner/, planner/ not importing parallel/.

Read from the source (ast), not by importing: a function-local import counts as much as one
at the top of a file. A unit is a subpackage (``course_lib.parallel``) or a top-level module
(``course_lib.launch``); ``course_lib`` itself is the package's ``__init__``.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "course_lib"


def _module_name(path):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(name):
    """course_lib.parallel.mesh -> course_lib.parallel; course_lib.launch -> itself."""
    parts = name.split(".")
    if len(parts) == 1:
        return name
    return ".".join(parts[:2])


def _exists(name):
    rel = pathlib.Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def import_edges():
    """{unit: {unit it imports}} over every import statement in course_lib."""
    edges = {}
    for path in ROOT.rglob("*.py"):
        me = _module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                                    # relative: from its package
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # "from course_lib import launch": the module course_lib.launch, if it is one
                targets = [f"{base}.{a.name}" if _exists(f"{base}.{a.name}") else base for a in node.names]
            for t in targets:
                if t == "course_lib" or t.startswith("course_lib."):
                    a, b = _unit(me), _unit(t)
                    if a != b:
                        edges.setdefault(a, set()).add(b)
    return edges


def find_cycle(edges):
    """One cycle as a list of units (first == last), or None."""
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for w in sorted(edges.get(u, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[u] = "done"
        return None

    for u in sorted(edges):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_finds_a_cycle_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_no_import_cycle_between_packages():
    cycle = find_cycle(import_edges())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers():
    edges = import_edges()
    assert edges.get("course_lib.schedules", set()) <= {"course_lib.trace"}, edges.get("course_lib.schedules")
    assert "course_lib.parallel" not in edges.get("course_lib.planner", set())
    assert "course_lib.planner" not in edges.get("course_lib.parallel", set())
    assert not {"course_lib.grading", "course_lib.viz", "course_lib.notebook"} & edges.get("course_lib.parallel", set())


# ------------------------------------------------------------- the pipeline package points down
PIPELINE = "course_lib.parallel.pipeline"
PIPELINE_ORDER = ("rules", "stages", "runner", "runtime", "pipeline_parallel", "torch_pipelining")   # each imports only
#                                                                                 modules before it


def course_imports(source):
    """[(module, name or None, private attribute used or None)] of every course_lib import in
    ``source`` (absolute imports: the course has no relative ones), and every ``alias._name``
    read through a course_lib module imported whole."""
    tree, out, aliases = ast.parse(source), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("course_lib"):
                    out.append((a.name, None, None))
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("course_lib"):
            for a in node.names:
                out.append((node.module, a.name, None))
                if _exists(f"{node.module}.{a.name}"):             # "from course_lib import schedules as S"
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            out.append((aliases[node.value.id], None, node.attr))
    return out


def pipeline_violations(sources):
    """{module of the pipeline package ("runner"), or "compose": its source} -> what breaks the
    package's direction: a module importing one at or above its place in PIPELINE_ORDER (or the
    package itself: its ``__init__`` brings in the facade), compose importing more than the
    rules, the stages, the runner and the runtime, or a module of the package taking a name
    starting with "_" from another module."""
    out = []
    for me, source in sources.items():
        below = PIPELINE_ORDER[:PIPELINE_ORDER.index("runtime") + 1] if me == "compose" else PIPELINE_ORDER[:PIPELINE_ORDER.index(me)]
        for module, name, attr in course_imports(source):
            private = attr or (name if name and name.startswith("_") and not name.startswith("__") else None)
            if private and me != "compose":
                out.append(f"{me} takes {module}.{private}: private to that module")
            target = f"{module}.{name}" if module == PIPELINE and name in PIPELINE_ORDER else module
            if target == PIPELINE:
                out.append(f"{me} imports {name or PIPELINE} from the package (its __init__ loads the facade)")
            elif target.startswith(PIPELINE + ".") and target.rsplit(".", 1)[1] not in below:
                out.append(f"{me} imports {target}, not below it")
    return out


def test_pipeline_violations_are_found():
    bad = {"stages": "from course_lib.parallel.pipeline import PipelineParallel",
           "runner": "from course_lib.parallel.pipeline.runtime import PipelineRuntime\n"
                     "from course_lib.schedules import _dependency",
           "runtime": "from course_lib import schedules as S\nS._dependency(a, 1, 1)",
           "compose": "from course_lib.parallel.pipeline.pipeline_parallel import PipelineParallel"}
    found = pipeline_violations(bad)
    assert len(found) == 5, found
    good = {"runtime": "from course_lib.parallel.pipeline.runner import ScheduleRunner\n"
                       "from course_lib import schedules as S\nS.validate(s, 1, 1)"}
    assert pipeline_violations(good) == []


def test_pipeline_package_points_down():
    """rules -> stages -> runner -> runtime -> chapter 6's PipelineParallel and torch's side by
    side; compose (chapter 9) takes the rules, the stages and the runtime, never the facade; no private name crosses a file."""
    folder = ROOT / "parallel" / "pipeline"
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted(PIPELINE_ORDER + ("__init__",))
    sources = {m: (folder / f"{m}.py").read_text() for m in PIPELINE_ORDER}
    sources["compose"] = (ROOT / "parallel" / "compose.py").read_text()
    assert pipeline_violations(sources) == []
