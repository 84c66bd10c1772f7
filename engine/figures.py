"""One way to start a figure: a matplotlib `Figure` on the Agg canvas, matplotlib imported with stop signals held.

The object API (no pyplot) never changes the calling program's global backend and needs no display, and a
figure is freed when its last reference goes (no `plt.close`). A Ctrl-C or a scheduler's SIGTERM that lands
inside the initialisation of matplotlib's C extensions can abort the interpreter with a C-level error instead of
raising KeyboardInterrupt; held during the import, it is delivered (and handled as any stop) right after it.
"""
from __future__ import annotations

from engine.preemption import stop_signals_blocked


def new_figure(width: float, height: float):
    """An empty `matplotlib.figure.Figure` of width x height inches, drawable with `savefig`."""
    with stop_signals_blocked():
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def colour_rgb(colour: str) -> tuple[float, float, float]:
    """A matplotlib colour ("tab:gray", "#1f77b4", "C3") as an (r, g, b) tuple in [0, 1], for plots that shade one."""
    with stop_signals_blocked():
        from matplotlib.colors import to_rgb
    return to_rgb(colour)
