"""Writing the reports' figures: one place for layout, folder creation, resolution and closing."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, path: str | Path) -> Path:
    """Lay out `fig` (a pyplot figure), write it as a PNG at `path` (creating its folder) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
