"""How rank 0's progress bar is shown: whether a stream is a terminal (`is_terminal`) and which bar, if any, a
`logging.progress_bar` setting asks for (`progress_style`). The driver decides it for its launcher; the workers'
logger draws it (`worker/metrics.py`)."""

from __future__ import annotations

import os


def progress_style(setting: str, terminal: bool, via_ray_driver: bool) -> str | None:
    """How rank 0 shows its progress bar (`logging.progress_bar`): `tqdm` on this process's stderr; `ray`
    (`via_ray_driver`: `tqdm_ray`, drawn by the Ray driver, as a Ray worker's stderr is a log file); or None.
    `auto` shows it when the stream it would be drawn on is a `terminal`, so redirected output gets no redraws."""
    if setting == "off" or (setting == "auto" and not terminal):
        return None
    return "ray" if via_ray_driver else "tqdm"


def is_terminal(stream) -> bool:
    """Whether a progress bar drawn on `stream` can be seen: a terminal with a width. A pseudo-terminal without one
    (0 columns: `script` run with no terminal of its own) is a terminal to `isatty`, but tqdm, which sizes its bar to
    the width, draws nothing there."""
    if not stream.isatty():
        return False
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # a stream with no file descriptor (tests' stand-ins)
        return True
