"""The exercise pipeline: exercises/ is exactly what scripts/generate_exercises.py makes
from solutions/, every untouched exercise fails grading and every solution passes it, and
scripts/grade.py scores a notebook the way `pytest --nbval-lax` judges it."""
from __future__ import annotations

import os

import nbformat
import pytest

import generate_exercises as gen
import grade
from conftest import ROOT, nbval_strict, notebooks_in, run_nbval, untouched_grade

SOLUTIONS = notebooks_in("solutions")


# ----------------------------------------------------------------------------- the generator

def _nb(*cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for count, cell in enumerate(cells, 1):
        if cell.cell_type == "code" and cell.execution_count is None and cell.outputs:
            cell.execution_count = count
        nb.cells.append(cell)
    return nb


def _code(source, stdout=None):
    cell = nbformat.v4.new_code_cell(source)
    if stdout is not None:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stdout)]
    return cell


SOLVED_FUNCTION = '''import math

def hypot(a, b):
    """Length of the hypotenuse."""
    ### BEGIN SOLUTION
    s = a * a + b * b
    return math.sqrt(s)
    ### END SOLUTION

class Ring:
    def step(self, x):
        if x:
            ### BEGIN SOLUTION send to the right neighbour
            return x + 1
            ### END SOLUTION
        return 0'''

CHECK = ('# NBVAL_CHECK_OUTPUT\nfrom course_lib.grading import Case, check\n'
         'ok = check("hypot", [Case()], lambda case: hypot(3, 4) == 5)')


def test_regions_become_stubs_at_their_indentation():
    out = gen.strip_code(SOLVED_FUNCTION, "t")
    assert '    raise NotImplementedError("Exercise: implement hypot")\n' in out
    assert '            raise NotImplementedError("Exercise: send to the right neighbour")\n        return 0' in out
    assert "math.sqrt" not in out and "x + 1" not in out and "SOLUTION" not in out
    compile(out, "stub", "exec")  # the stubbed cell still runs


@pytest.mark.parametrize("source, problem", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "not inside a function"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1", "has no"),
    ("def f():\n    return 1\n    ### END SOLUTION", "without"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION", "nested"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n### END SOLUTION", "not indented"),
])
def test_malformed_regions_are_named(source, problem):
    with pytest.raises(gen.SolutionFormatError, match=problem):
        gen.strip_code(source, "t")


def test_exercise_hides_pass_lines_and_markers():
    """A learner sees no pass line before passing and no NBVAL marker; the setup cell is hidden."""
    from colab_cell import COLAB_CELL

    ignored = _code("# NBVAL_IGNORE_OUTPUT\nprint(1)", stdout="1\n")
    solution = _nb(_code(COLAB_CELL), _code(SOLVED_FUNCTION, stdout="side output\n"),
                   _code(CHECK, stdout="hypot: 1/1 cases passed\n"),
                   nbformat.v4.new_markdown_cell("Why?\n\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION\n"), ignored)
    exercise = gen.make_exercise(solution)
    setup, work, check, answer, plain, session = exercise.cells
    assert 'all_checks_passed(["hypot"])' in session.source    # a deleted check fails nbval-lax
    assert setup.metadata["tags"] == ["remove-cell"]
    assert work.outputs == [] and work.execution_count is None
    assert check.outputs == [] and check.execution_count is None
    assert check.source == CHECK.split("\n", 1)[1] and "NBVAL" not in check.source
    assert grade.normalized(check.source) == grade.normalized(CHECK)  # grade.py still knows the question
    assert plain.source == "print(1)" and plain.metadata["tags"] == ["nbval-ignore-output"]
    assert "Because" not in answer.source and gen.MARKDOWN_STUB in answer.source
    assert solution.cells[1].outputs, "the solution notebook itself is left untouched"
    assert gen.render(exercise) == gen.render(gen.make_exercise(solution)), "not deterministic"


def test_a_check_cell_without_stored_output_is_an_error():
    with pytest.raises(gen.SolutionFormatError, match="no stored output"):
        gen.make_exercise(_nb(_code(CHECK)))


def test_check_mode_reports_stale_and_orphaned_exercises(tmp_path, capsys):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    nbformat.write(_nb(_code(SOLVED_FUNCTION), _code(CHECK, stdout="hypot: 1/1 cases passed\n")), sol / "a.ipynb")
    args = ["--solutions", str(sol), "--exercises", str(ex)]
    assert gen.main(args + ["--check"]) == 1  # missing
    assert gen.main(args) == 0
    assert gen.main(args + ["--check"]) == 0
    (ex / "orphan.ipynb").write_text((ex / "a.ipynb").read_text())
    with open(ex / "a.ipynb", "a") as f:
        f.write(" ")
    assert gen.main(args + ["--check"]) == 1
    out = capsys.readouterr().out
    assert "a.ipynb: differs" in out and "orphan.ipynb: has no solution notebook" in out
    assert gen.main(args) == 0 and not (ex / "orphan.ipynb").exists()
    assert gen.main(args + ["--check"]) == 0


# ----------------------------------------------------------------------------- the repository

def test_exercises_are_generated_from_solutions():
    assert gen.main(["--check"]) == 0, "exercises/ is stale: run python scripts/generate_exercises.py"


def check_cells(path):
    return [c for c in nbformat.read(os.path.join(ROOT, path), as_version=4).cells if grade.is_check_cell(c)]


@pytest.mark.notebook_run("untouched")
@pytest.mark.parametrize("path", SOLUTIONS)
def test_untouched_exercise_fails_every_question(path):
    exercise = os.path.join(ROOT, "exercises", os.path.basename(path))
    result = untouched_grade(path)  # grade.grade_notebook(exercise), run with the session's other notebooks
    assert result.total == len(check_cells(path)) > 0, result
    passed = [q.name for q in result.questions if q.passed]
    assert not passed, f"{exercise}: these questions pass before the learner wrote anything: {passed}"


@pytest.mark.notebook_run("strict")
@pytest.mark.parametrize("path", SOLUTIONS)
def test_solution_passes_every_question(path):
    """Every check cell of the solution reproduces its pass line in a fresh kernel.

    Read from the strict nbval run of the solution (shared with test_notebooks.py, so each
    solution runs once): strict mode compares every check cell exactly as `--nbval-lax`
    grades it, and test_grade_agrees_with_nbval_lax shows grade.py judges the same way."""
    nb = nbformat.read(os.path.join(ROOT, path), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    questions = [(k, grade.question_name(c.outputs, k)) for k, c in enumerate(code) if grade.is_check_cell(c)]
    assert questions, f"{path} has no check cell (# NBVAL_CHECK_OUTPUT)"
    run = nbval_strict(path)
    failed = [f"{name} (nbval Cell {k}): {run.outcome(k)}" for k, name in questions if run.outcome(k) != "passed"]
    assert not failed, f"{path}: questions the solution does not pass: {failed}\n" + run.log[-6000:]


# ----------------------------------------------------------------------------- grade.py itself

@pytest.fixture(scope="module")
def tiny_course(tmp_path_factory):
    """A solution, its generated exercise, a solved learner copy and a cheating one."""
    root = tmp_path_factory.mktemp("course")
    for d in ("solutions", "exercises", "learner"):
        (root / d).mkdir()
    second = ('# NBVAL_CHECK_OUTPUT\nfrom course_lib.grading import Case, check\n'
              'ok = check("twice", [Case()], lambda case: Ring().step(1) == 2)')
    solution = _nb(_code(SOLVED_FUNCTION), _code(CHECK, stdout="hypot: 1/1 cases passed\n"),
                   _code(second, stdout="twice: 1/1 cases passed\n"))
    nbformat.write(solution, root / "solutions" / "t.ipynb")
    assert gen.main(["--solutions", str(root / "solutions"), "--exercises", str(root / "exercises")]) == 0
    nbformat.write(solution, root / "learner" / "t.ipynb")
    cheat = nbformat.read(root / "exercises" / "t.ipynb", as_version=4)
    cheat.cells[1].source = '# NBVAL_CHECK_OUTPUT\nprint("hypot: 1/1 cases passed")'
    del cheat.cells[2]  # and drop the second question
    nbformat.write(cheat, root / "learner" / "carol_cheat.ipynb")
    sneaky = nbformat.read(root / "learner" / "t.ipynb", as_version=4)  # solved, but one check faked
    sneaky.cells[0].source = SOLVED_FUNCTION.replace("return math.sqrt(s)", "return 0")
    sneaky.cells.insert(1, _code("import course_lib.grading as g\n"
                                 "def check(name, cases, run):\n    print(name + ': 1/1 cases passed')\n"
                                 "g.check = check"))
    nbformat.write(sneaky, root / "learner" / "renamed_sneaky.ipynb")
    return root


@pytest.fixture(scope="module")
def graded(tiny_course):
    """grade.grade_notebook with each (notebook, reference) of the tiny course graded once for
    the module: a kernel runs it once (~3 s of CPU: the check cells import torch), and the tests
    below read the blank exercise's and the solved copy's grades several times, grade.main too."""
    grades = {}
    grade_notebook = grade.grade_notebook

    def grade_once(path, reference_dir=None, timeout=300, references=None):
        key = (os.path.realpath(path), os.path.realpath(reference_dir) if reference_dir else None, timeout)
        if key not in grades:
            grades[key] = grade_notebook(path, reference_dir, timeout, references)
        return grades[key]

    return grade_once


def kernels_of_this_process() -> set:
    """The ipykernel processes whose parent is this process, alive (Linux /proc; else empty)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                kernel = b"ipykernel" in f.read()
        except OSError:
            continue
        if kernel and int(ppid) == os.getpid() and state != "Z":
            found.add(int(pid))
    return found


def test_grade_scores_questions(tiny_course, graded):
    ref = str(tiny_course / "solutions")
    before = kernels_of_this_process()
    blank = graded(str(tiny_course / "exercises" / "t.ipynb"), ref)
    # the notebook's kernel is shut down when its run ends (not when this process does)
    assert kernels_of_this_process() <= before
    assert (blank.passed, blank.total) == (0, 2)
    assert "NotImplementedError" in blank.questions[0].got
    solved = graded(str(tiny_course / "learner" / "t.ipynb"), ref)
    assert (solved.passed, solved.total) == (2, 2), solved
    assert [q.name for q in solved.questions] == ["hypot", "twice"]


def test_grade_knows_questions_by_their_check_cells(tiny_course, graded, monkeypatch):
    """A renamed notebook is graded against the right solution; a replaced or deleted check
    cell scores 0 and is flagged; a cell that redefines the check function changes nothing."""
    ref = str(tiny_course / "solutions")
    cheat = graded(str(tiny_course / "learner" / "carol_cheat.ipynb"), ref)
    assert (cheat.passed, cheat.total) == (0, 2), cheat
    assert all(q.flagged for q in cheat.questions) and "graded as t.ipynb" in cheat.note
    assert "looks like an edited check cell" in cheat.note
    sneaky = graded(str(tiny_course / "learner" / "renamed_sneaky.ipynb"), ref)
    assert [q.passed for q in sneaky.questions] == [False, True], sneaky
    monkeypatch.setattr(grade, "grade_notebook", graded)   # (main's exit status from the same grades)
    assert grade.main([str(tiny_course / "learner" / "t.ipynb"), "--reference", ref]) == 0
    assert grade.main([str(tiny_course / "exercises"), "--reference", ref]) == 1


def test_grade_agrees_with_nbval_lax(tiny_course):
    """`pytest --nbval-lax` is the one-notebook grader: it fails the untouched exercise and
    passes the solved copy, as grade.py does."""
    exercise = nbformat.read(tiny_course / "exercises" / "t.ipynb", as_version=4)
    assert not any(c.outputs for c in exercise.cells), "an exercise shows no pass line"
    blank = run_nbval(str(tiny_course / "exercises" / "t.ipynb"), "lax")
    assert blank.returncode == 1 and blank.outcome(1) == blank.outcome(2) == "failed", blank.log
    solved = run_nbval(str(tiny_course / "learner" / "t.ipynb"), "lax")
    assert solved.returncode == 0 and solved.outcome(1) == solved.outcome(2) == "passed", solved.log


# ----------------------------------------------------------------------------- attacks on grade.py (issue 34)
_TRANSFORMER = '''def _rewrite(lines):
    if any("check(" in line for line in lines):
        return ["print('hypot: 1/1 cases passed')\\n"]
    return lines
{reach}.append(_rewrite)'''


@pytest.mark.parametrize("reach", ["get_ipython().input_transformers_cleanup",     # named: caught unrun
                                   "getattr(getattr(__import__('IP' + 'ython'), 'get_' + 'ipython')(), "
                                   "'input_' + 'transformers_cleanup')"],          # hidden: the probe
                         ids=["named", "obfuscated"])
def test_grade_scores_0_an_input_transformer_that_fakes_the_pass_line(tiny_course, reach):
    ref = str(tiny_course / "solutions")
    nb = nbformat.read(tiny_course / "exercises" / "t.ipynb", as_version=4)
    nb.cells.insert(1, _code(_TRANSFORMER.format(reach=reach)))
    path = tiny_course / "learner" / f"hooked_{len(reach)}.ipynb"
    nbformat.write(nb, path)
    graded = grade.grade_notebook(str(path), ref)
    assert graded.passed == 0 and all(q.flagged == "IPYTHON" for q in graded.questions), graded
    assert ("reaches IPython's input machinery" in graded.note if reach.startswith("get_")
            else "hooks it did not start with" in graded.note and "input_transformers_cleanup" in graded.note), graded
    assert "IPYTHON" in grade.table([graded], "")


def test_grade_flags_a_copied_solution_and_names_an_edited_check_by_question(tiny_course, graded):
    ref = str(tiny_course / "solutions")
    copied = graded(str(tiny_course / "learner" / "t.ipynb"), ref)
    assert (copied.passed, copied.total) == (2, 2)
    assert copied.copied.startswith("COPY?") and "BEGIN SOLUTION" in copied.copied, copied
    assert "stored pass lines" in copied.copied and "COPY?" in grade.table([copied], "")
    blank = graded(str(tiny_course / "exercises" / "t.ipynb"), ref)
    assert not blank.copied and not blank.note, blank
    nb = nbformat.read(tiny_course / "exercises" / "t.ipynb", as_version=4)
    nb.cells[2].source = nb.cells[2].source.replace("Ring().step(1) == 2", "True")
    nbformat.write(nb, tiny_course / "learner" / "edited_twice.ipynb")
    edited = grade.grade_notebook(str(tiny_course / "learner" / "edited_twice.ipynb"), ref)
    assert "twice: cell 3 looks like an edited check cell" in edited.note, edited.note


def test_a_deleted_check_cell_fails_nbval_lax(tiny_course, tmp_path):
    """Issue 34: the documented self-check (`pytest --nbval-lax`) passed a notebook whose check
    cell was deleted. The generated exercise ends with a cell that fails unless every question
    of the solution passed in this session."""
    exercise = nbformat.read(tiny_course / "exercises" / "t.ipynb", as_version=4)
    assert "all_checks_passed" in exercise.cells[-1].source and '"hypot", "twice"' in exercise.cells[-1].source
    exercise.cells[0].source = SOLVED_FUNCTION                     # solved...
    nbformat.write(exercise, tmp_path / "solved.ipynb")
    solved = run_nbval(str(tmp_path / "solved.ipynb"), "lax")
    assert solved.returncode == 0, solved.log
    del exercise.cells[2]                                          # ...and the second check deleted
    nbformat.write(exercise, tmp_path / "deleted.ipynb")
    deleted = run_nbval(str(tmp_path / "deleted.ipynb"), "lax")
    assert deleted.returncode == 1 and deleted.outcome(2) == "failed", deleted.log
    assert "not passed in this session: twice" in deleted.log, deleted.log[-3000:]
