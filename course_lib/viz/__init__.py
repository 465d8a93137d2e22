"""Static figures: every figure of the course is a function returning a matplotlib
Figure. A widget only wraps one of these (``course_lib.widgets``), so the rendered
book always has the picture. One module per chapter's figures; ``timeline`` is
shared by measured traces and the planner's simulator.
"""
from course_lib.viz.timeline import KIND_COLORS, busy_fraction, timeline

__all__ = ["timeline", "busy_fraction", "KIND_COLORS"]
