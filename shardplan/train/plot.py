"""The demo's loss plot, drawn with matplotlib (the ``demo`` install extra).

``loss_figure`` builds the figure (both curves, the verdict in the legend's
corner) so it can be inspected before ``save_png`` writes it; the Agg backend
needs no display.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError

#: figure size in pixels at ``DPI``
SIZE = (960, 560)
DPI = 100


@dataclass(frozen=True)
class Curve:
    """One line of the plot: ``values[i]`` is step ``i + 1``."""

    label: str
    values: list[float]
    color: str
    width: float


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (``ConfigurationError`` without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError("the loss plot needs matplotlib, which is not installed",
                                 fix="pip install -e '.[demo]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def loss_figure(curves: list[Curve], *, title: str, verdict: str, size=SIZE):
    """A matplotlib ``Figure``: loss against step for each curve, ``verdict`` beneath
    the legend. Thick curves first, so a thin one drawn over a thick one shows both."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)
    for c in sorted(curves, key=lambda c: -c.width):
        ax.plot(range(1, len(c.values) + 1), c.values, color=c.color, linewidth=c.width,
                label=c.label)
    ax.set(title=title, xlabel="step", ylabel="loss")
    ax.grid(True, color="#e5e5e5")
    ax.legend(loc="upper right", title=verdict, title_fontsize="medium")
    fig.tight_layout()
    return fig


def save_png(fig, path: str) -> None:
    """Write ``fig`` as a PNG of its pixel size and release it."""
    plt = pyplot()
    try:
        fig.savefig(path, format="png", dpi=DPI)
    finally:
        plt.close(fig)
