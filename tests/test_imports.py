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
