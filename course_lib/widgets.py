"""Interactive versions of static figures: a widget only wraps a figure function.

    interactive_figure(fig_fn, tp=[1, 2, 4, 8], layers=(1, 96, 1), sp=True)

shows ``fig_fn(**values)`` for the initial values as a plain static figure (so the
rendered book, nbval and a machine without ipywidgets always have the picture),
then, when ipywidgets is installed and a kernel front-end is live, controls that
redraw it. A control is given as:

- a list or tuple of choices (strings, numbers, layouts...) -> a dropdown;
- ``(min, max, step)`` of ints or floats                     -> a slider;
- a bool                                                      -> a checkbox;
- a single other value                                        -> fixed, no control;
- an ipywidgets widget                                        -> used as is.

The initial value is ``fig_fn``'s default for that parameter when it has one (and
it is a valid choice), else the first choice / the slider's minimum.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass


@dataclass
class Control:
    """A control, described without ipywidgets: ``kind`` dropdown / int / float / bool / fixed."""

    name: str
    kind: str
    value: object
    options: tuple = ()
    low: float = 0
    high: float = 0
    step: float = 1


def _is_range(spec) -> bool:
    return (isinstance(spec, tuple) and len(spec) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                              for x in spec))


def describe_controls(fig_fn, **controls) -> list[Control]:
    """The controls ``interactive_figure`` would build, with their initial values."""
    try:
        defaults = {k: p.default for k, p in inspect.signature(fig_fn).parameters.items()
                    if p.default is not inspect.Parameter.empty}
    except (TypeError, ValueError):
        defaults = {}
    out = []
    for name, spec in controls.items():
        if hasattr(spec, "observe") and hasattr(spec, "value"):       # an ipywidgets widget
            out.append(Control(name, "widget", spec.value, options=(spec,)))
        elif isinstance(spec, bool):
            out.append(Control(name, "bool", spec))
        elif _is_range(spec):
            low, high, step = spec
            if high < low or step <= 0:
                raise ValueError(f"control {name!r}: need min <= max and step > 0, got {spec}")
            kind = "int" if all(isinstance(x, int) for x in spec) else "float"
            value = defaults.get(name, low)
            value = value if isinstance(value, (int, float)) and low <= value <= high else low
            out.append(Control(name, kind, value, low=low, high=high, step=step))
        elif isinstance(spec, (list, tuple)):
            if not spec:
                raise ValueError(f"control {name!r}: no choices")
            options = tuple(spec)
            value = defaults.get(name, options[0])
            out.append(Control(name, "dropdown", value if _member(value, options) else options[0], options=options))
        else:
            out.append(Control(name, "fixed", spec))
    return out


def _member(value, options) -> bool:
    try:
        return any(value == o for o in options)
    except Exception:  # noqa: BLE001 - incomparable values are simply not members
        return False


def _label(option) -> str:
    text = getattr(option, "name", None) if not isinstance(option, (str, int, float)) else None
    return str(text if isinstance(text, str) else option)


def _widget(ctrl, widgets):
    style = {"description_width": "initial"}
    if ctrl.kind == "widget":
        return ctrl.options[0]
    if ctrl.kind == "bool":
        return widgets.Checkbox(value=ctrl.value, description=ctrl.name, style=style)
    if ctrl.kind == "int":
        return widgets.IntSlider(value=ctrl.value, min=ctrl.low, max=ctrl.high, step=ctrl.step,
                                 description=ctrl.name, continuous_update=False, style=style)
    if ctrl.kind == "float":
        return widgets.FloatSlider(value=ctrl.value, min=ctrl.low, max=ctrl.high, step=ctrl.step,
                                   description=ctrl.name, continuous_update=False, style=style)
    return widgets.Dropdown(options=[(_label(o), o) for o in ctrl.options], value=ctrl.value,
                            description=ctrl.name, style=style)


def _ipywidgets():
    try:
        import ipywidgets
    except ImportError:
        return None
    return ipywidgets


def interactive_figure(fig_fn, *, show_static: bool = True, **controls):
    """Show ``fig_fn(**initial values)`` as a static figure, then controls that redraw it.

    Degrades gracefully: without ipywidgets (or outside IPython) only the static
    figure is shown (outside IPython it is returned). Returns None in a notebook, so
    the cell prints nothing after the figure.
    """
    import matplotlib.pyplot as plt

    ctrls = describe_controls(fig_fn, **controls)
    values = {c.name: c.value for c in ctrls}
    try:
        from IPython import get_ipython
        from IPython.display import display
        live = get_ipython() is not None
    except ImportError:
        live = False
    if not live:
        return fig_fn(**values)
    if show_static:
        fig = fig_fn(**values)
        display(fig)
        plt.close(fig)
    widgets = _ipywidgets()
    adjustable = [c for c in ctrls if c.kind != "fixed"]
    if widgets is None or not adjustable:
        return None
    fixed = {c.name: c.value for c in ctrls if c.kind == "fixed"}
    boxes = {c.name: _widget(c, widgets) for c in adjustable}
    out = widgets.Output()

    def redraw(_change=None):
        with out:
            out.clear_output(wait=True)
            fig = fig_fn(**fixed, **{k: w.value for k, w in boxes.items()})
            display(fig)
            plt.close(fig)
    for w in boxes.values():
        w.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox(list(boxes.values())[i:i + 3]) for i in range(0, len(boxes), 3)] + [out])
    display(with_fallback(box, list(boxes)), raw=True)
    return None


def fallback_note(names) -> str:
    """What a page without a kernel (the rendered book, nbviewer, a text front-end) shows instead,
    wrapped to the book's text column."""
    from course_lib.notebook import wrap_lines

    return wrap_lines(f"[interactive: in a running notebook, controls for {', '.join(names)} redraw the figure "
                      f"above; open this page in Colab or JupyterLab to use them]", indent=" ")


def with_fallback(widget, names) -> dict:
    """The widget's display bundle, its text/plain saying what it does.

    Front-ends with a live kernel render the widget (its MIME type ranks first); the
    book drops that type (_config.yml: nb_mime_priority_overrides), since a widget
    needs a kernel, and shows the note in its place instead of an empty box.
    """
    get_bundle = getattr(widget, "_repr_mimebundle_", None)       # ipywidgets >= 8
    bundle = dict(get_bundle() or {}) if get_bundle else {
        "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                     "model_id": widget.model_id}}
    bundle["text/plain"] = fallback_note(names)
    return bundle
