"""The shape of course_lib (DESIGN.md: "no import cycle, no private name imported from another
file"), read from the source with ast, not by importing.

* No cycle among course_lib's modules through their **module-level** imports: those that run
  when the module is imported (a class body's and an ``if``'s included). A function-local
  import is left out on purpose: it runs at call time, after every module has loaded, and it
  is how the library breaks a cycle deliberately. (tests/test_imports.py holds the layers
  between packages, function-local imports included.)
* No private name (one leading underscore, not a dunder) of course_lib imported from another
  file: ``from course_lib.x import _name`` in course_lib/ or tests/, and in course_lib/ also
  ``x._name`` through a name bound to a course_lib module. A test's cheating answer imports a
  grader's private reference on purpose, as a learner could (CHEATS).

ALLOWED lists the exceptions left in files that other work is reshaping; it can only shrink:
an entry that no longer occurs fails too, so a fix must remove its entry.

* Three wings (STYLE.md): only ``lab/`` (the chapters' experiments), ``grading/`` (the
  graders), ``launch.py`` itself and ``examples/`` (scripts for torchrun) start ranks; the
  library a learner reads builds what they run. A call of ``launch`` imported from
  ``course_lib.launch`` (by name or through the module) anywhere else fails.
"""
from __future__ import annotations

import ast
import pathlib

from test_imports import find_cycle

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (the file that imports it, "the module it comes from:the private name"): to be made public
# or moved by whoever owns the pair of files (named after each group)
ALLOWED = {
    # checkpoint/ (layout and placement work)
    ("course_lib/checkpoint/async_save.py", "course_lib.checkpoint.store:_world"),
    ("course_lib/checkpoint/load.py", "course_lib.checkpoint.store:_all_gather"),
    ("course_lib/checkpoint/load.py", "course_lib.checkpoint.store:_dtype_name"),
    ("course_lib/checkpoint/load.py", "course_lib.checkpoint.store:_refused"),
    ("course_lib/checkpoint/load.py", "course_lib.checkpoint.store:_world"),
    # collectives/ (on main)
    ("course_lib/collectives/checks.py", "course_lib.collectives.core:_DTYPE_CODE"),
    ("course_lib/collectives/checks.py", "course_lib.collectives.core:_OP_CODE"),
    # virtual/ (on main) reads the planner's kernel costs
    ("course_lib/virtual/compute.py", "course_lib.planner.kernel_cost:_add_bytes"),
    # tests of files other work is reshaping
    ("tests/test_grading_nd.py", "course_lib.grading.nd_parallel:_expected_group"),
    ("tests/test_grading_nd.py", "course_lib.grading.nd_parallel:_valid_layouts"),
    ("tests/test_virtual_compute.py", "course_lib.virtual.compute:_cuda_path"),
}
# A learner's answer, written in a test, that calls the grader's (or library's) private
# reference: the test checks the guard refuses it ("write this yourself"). These stay.
CHEATS = {
    ("tests/test_grading_checkpointing.py", "course_lib.grading.checkpoint_data:_counters"),
    ("tests/test_grading_checkpointing.py", "course_lib.grading.checkpointing:_owned_box"),
    ("tests/test_grading_zero_fsdp.py", "course_lib.parallel.fsdp:_UnshardFn"),
    ("tests/test_grading_single_device.py", "course_lib.grading.single_device:_training_bytes"),
}


def _module_name(path, root):
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name, root):
    rel = root.parent.joinpath(*name.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def imports(path, root):
    """(module it names, imported name or None, module-level?) for each import of a
    ``root`` module in ``path``; "from a import b" names a.b when that is a module."""
    me = _module_name(path, root) if root in path.parents else ""
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []

    def visit(node, top):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top = False
        if isinstance(node, ast.Import):
            found.extend((a.name, None, top) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                    # relative: from its package
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, None, top) if _is_module(sub, root) else (base, a.name, top))
        for child in ast.iter_child_nodes(node):
            visit(child, top)

    visit(ast.parse(path.read_text(), str(path)), True)
    return [(m, n, top) for m, n, top in found if m == root.name or m.startswith(root.name + ".")]


def module_graph(root=ROOT / "course_lib"):
    """{module: {course_lib modules it imports at module level}}."""
    edges = {}
    for path in sorted(root.rglob("*.py")):
        me = _module_name(path, root)
        edges[me] = {m for m, _, top in imports(path, root) if top and m != me}
    return edges


def private_imports(root=ROOT / "course_lib", files=None):
    """{(file, "module:_name")}: each private name of ``root`` a file takes from another file."""
    files = sorted(root.rglob("*.py")) if files is None else files
    found = set()
    for path in files:
        me = _module_name(path, root) if root in path.parents else ""
        rel = path.relative_to(root.parent).as_posix()
        for module, name, _ in imports(path, root):
            if name is not None and _private(name) and module != me:
                found.add((rel, f"{module}:{name}"))
        if root not in path.parents:
            continue
        # x._name where x is bound to a course_lib module (import a.b as x / from a import b)
        tree = ast.parse(path.read_text(), str(path))
        bound = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and (a.name + ".").startswith(root.name + "."):
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if _is_module(f"{node.module}.{a.name}", root):
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and bound[node.value.id] != me):
                found.add((rel, f"{bound[node.value.id]}:{node.attr}"))
    return found


def test_no_import_cycle_between_modules():
    cycle = find_cycle(module_graph())
    assert cycle is None, "import cycle through module-level imports: " + " -> ".join(cycle)


def test_no_private_name_imported_across_files():
    found = private_imports() | private_imports(files=sorted((ROOT / "tests").glob("*.py")))
    new = sorted(found - ALLOWED - CHEATS)
    assert not new, ("a private name imported from another file: make it public (a name without the "
                     "underscore, a docstring) or move it to where it is used:\n"
                     + "\n".join(f"  {f}: {what}" for f, what in new))
    gone = sorted((ALLOWED | CHEATS) - found)
    assert not gone, "fixed, so remove from ALLOWED / CHEATS:\n" + "\n".join(f"  {f}: {w}" for f, w in gone)


def test_the_checks_find_what_they_look_for(tmp_path):
    """A cycle through module-level imports is found and one through a function is not; a
    private name is found whether imported or reached through its module."""
    pkg = tmp_path / "course_lib"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from course_lib.sub import b\n_x = 1\n")
    (pkg / "sub" / "b.py").write_text("import course_lib.c as c\n\ndef f():\n    from course_lib import a\n"
                                      "    return a._x + c._y\n")
    (pkg / "c.py").write_text("from course_lib.a import _x\n_y = 2\n")
    graph = module_graph(pkg)
    assert graph["course_lib.sub.b"] == {"course_lib.c"}            # the function's import left out
    assert find_cycle(graph) == ["course_lib.a", "course_lib.sub.b", "course_lib.c", "course_lib.a"]
    assert private_imports(pkg) == {("course_lib/c.py", "course_lib.a:_x"),
                                    ("course_lib/sub/b.py", "course_lib.a:_x"),
                                    ("course_lib/sub/b.py", "course_lib.c:_y")}


# ------------------------------------------------------------- only lab/ and grading/ start ranks
STARTS_RANKS = ("course_lib/lab/", "course_lib/grading/", "course_lib/examples/", "course_lib/launch.py")


def launch_calls(path):
    """Line numbers where ``path`` calls ``course_lib.launch.launch``: ``launch(...)`` after
    ``from course_lib.launch import launch [as x]``, or ``m.launch(...)`` where ``m`` is bound
    to the module ``course_lib.launch`` (docstrings and comments are not code: ast skips them)."""
    tree = ast.parse(path.read_text(), str(path))
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "course_lib.launch":
            names |= {a.asname or a.name for a in node.names if a.name == "launch"}
        elif isinstance(node, ast.ImportFrom) and node.module == "course_lib":
            modules |= {a.asname or a.name for a in node.names if a.name == "launch"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "course_lib.launch" and a.asname}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in names:
            lines.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr == "launch" and (
                (isinstance(f.value, ast.Name) and f.value.id in modules)
                or ast.unparse(f.value) == "course_lib.launch"):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_lab_and_grading_start_ranks():
    found = [f"  {rel}:{line}" for path in sorted((ROOT / "course_lib").rglob("*.py"))
             if not (rel := path.relative_to(ROOT).as_posix()).startswith(STARTS_RANKS)
             for line in launch_calls(path)]
    assert not found, ("a library module starts ranks: move what calls launch to course_lib/lab/ "
                       "(the library builds what the run calls):\n" + "\n".join(found))


def test_launch_calls_are_found_by_name_and_through_the_module(tmp_path):
    (tmp_path / "a.py").write_text(
        '"""launch(f, 2) in a docstring is not a call."""\n'
        "from course_lib.launch import launch as run\nfrom course_lib import launch as L\n"
        "import course_lib.launch\n\ndef f(buckets):\n    buckets.launch()  # a method of its own\n"
        "    run(f, 2)\n    L.launch(f, 2)\n    course_lib.launch.launch(f, 2)\n")
    assert launch_calls(tmp_path / "a.py") == [8, 9, 10]
