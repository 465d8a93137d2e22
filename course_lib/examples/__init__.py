"""Runnable examples: each works from a notebook (course_lib.launch starts the ranks),
as ``python -m course_lib.examples.X`` and under ``torchrun -m course_lib.examples.X``."""
