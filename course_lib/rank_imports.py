"""Imported once by launch's forkserver (``launch.FORKSERVER_PRELOAD``), never by the course's code:
the course_lib modules that ranks use, so that every rank, a fork of the server, has them already
instead of importing them again (~0.1 s of CPU per rank per launch; a grader's case, a test or a
notebook cell is often a launch of a few ranks that run for less than that).

Best effort: a module that fails to import here is left to the rank that needs it, which then
raises the real error where it is used (multiprocessing's forkserver would die on any error other
than ImportError, and with it every launch). None of these modules runs a torch op at import.
"""
import importlib

MODULES = ("course_lib.tolerance", "course_lib.models", "course_lib.gpt", "course_lib.moe",
           "course_lib.collectives", "course_lib.parallel", "course_lib.reference", "course_lib.grading",
           "course_lib.virtual")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - see the docstring
        pass
