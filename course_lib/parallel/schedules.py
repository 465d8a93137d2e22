"""The schedules moved to :mod:`course_lib.schedules` (below both ``parallel/`` and
``planner/``); this name stays for the code written against it."""
from course_lib.schedules import *  # noqa: F401,F403
from course_lib.schedules import __all__, _dependency  # noqa: F401
