"""course_lib/widgets.py: a widget only wraps a static figure function."""
import builtins
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib import widgets  # noqa: E402


def figure(n=3, scale=1.0, label="a", log=False):
    fig, ax = plt.subplots()
    ax.plot(range(n), [scale * i for i in range(n)], label=label)
    if log:
        ax.set_yscale("log")
    return fig


def test_controls_described_with_defaults():
    ctrls = {c.name: c for c in widgets.describe_controls(
        figure, n=(1, 10, 1), scale=(0.5, 2.0, 0.1), label=["b", "a"], log=False, extra=7)}
    assert ctrls["n"].kind == "int" and ctrls["n"].value == 3           # the function's default
    assert ctrls["scale"].kind == "float" and ctrls["scale"].value == 1.0
    assert ctrls["label"].kind == "dropdown" and ctrls["label"].value == "a"
    assert ctrls["log"].kind == "bool" and ctrls["log"].value is False
    assert ctrls["extra"].kind == "fixed"


def test_bad_controls_raise():
    with pytest.raises(ValueError, match="choices"):
        widgets.describe_controls(figure, label=[])
    with pytest.raises(ValueError, match="min <= max"):
        widgets.describe_controls(figure, n=(5, 1, 1))


def test_outside_ipython_returns_the_static_figure():
    fig = widgets.interactive_figure(figure, n=(1, 10, 1), label=["a", "b"])
    assert isinstance(fig, matplotlib.figure.Figure)
    assert len(fig.axes[0].lines[0].get_xdata()) == 3
    plt.close(fig)


def test_without_ipywidgets_still_static(monkeypatch):
    real_import = builtins.__import__

    def no_ipywidgets(name, *args, **kwargs):
        if name == "ipywidgets":
            raise ImportError("no ipywidgets here")
        return real_import(name, *args, **kwargs)
    monkeypatch.delitem(sys.modules, "ipywidgets", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_ipywidgets)
    assert widgets._ipywidgets() is None
    fig = widgets.interactive_figure(figure, n=(1, 10, 1))
    assert isinstance(fig, matplotlib.figure.Figure)
    plt.close(fig)


def test_widgets_built_when_available():
    ipywidgets = pytest.importorskip("ipywidgets")
    ctrls = widgets.describe_controls(figure, n=(1, 10, 1), scale=(0.5, 2.0, 0.1), label=["a", "b"], log=True)
    built = [widgets._widget(c, ipywidgets) for c in ctrls]
    assert [type(w).__name__ for w in built] == ["IntSlider", "FloatSlider", "Dropdown", "Checkbox"]
    assert built[2].value == "a"


def test_widget_bundle_carries_a_note_for_pages_without_a_kernel():
    ipywidgets = pytest.importorskip("ipywidgets")
    box = ipywidgets.VBox([ipywidgets.IntSlider()])
    bundle = widgets.with_fallback(box, ["step", "world_size"])
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == box.model_id
    assert "step, world_size" in bundle["text/plain"] and "Colab" in bundle["text/plain"]
    # the book drops the widget's MIME type, so the note is what it renders
    import os

    import yaml
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "_config.yml")) as f:
        overrides = yaml.safe_load(f)["sphinx"]["config"]["nb_mime_priority_overrides"]
    assert ["*", "application/vnd.jupyter.widget-view+json", None] in overrides
