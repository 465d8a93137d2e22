"""The book's text column, which the figures are drawn for.

At 1280 px the rendered book's column shows an image about 7.5 inches wide at the notebooks'
100 dpi at full size; a wider figure is shrunk to fit, and its labels with it (a 1468 px figure
showed at 46%, its 8 pt labels at about 5 px). Figures are drawn at most COLUMN_INCHES wide with
every label at least LABEL_PT, so they read at the size they are drawn.
"""
from __future__ import annotations

COLUMN_INCHES = 7.5   # the widest figure that shows at full size in the book's column
LABEL_PT = 9          # the smallest label (bar labels, ticks, legends)


def text_fits(text: str, width_inches: float, fontsize: float = LABEL_PT) -> bool:
    """Whether ``text`` at ``fontsize`` fits in ``width_inches`` (a character ~0.6 em wide)."""
    return len(text) * 0.6 * fontsize / 72 <= width_inches


__all__ = ["COLUMN_INCHES", "LABEL_PT", "text_fits"]
