"""``pipeloom serve``: the web playground and its JSON API (optional extra ``pipeloom[serve]``:
Starlette and uvicorn). Nothing here imports them until an app is made, and :mod:`pipeloom.remote`
(what ``pipeloom plan --server`` and ``load_plan("http://...")`` use) needs only the standard library.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeloom.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app", "run_server"]


def create_app(config: ServeConfig | None = None):
    """The Starlette application (see :mod:`pipeloom.serve.app`)."""
    from pipeloom.serve.app import create_app as make

    return make(config or ServeConfig())


def run_server(config: ServeConfig | None = None, *, listening: Callable[[int], None] | None = None) -> None:
    """Serve the playground with uvicorn until interrupted (``listening``: called with the port once its socket is
    bound; a host or port it cannot have is a PipeloomError)."""
    from pipeloom.serve.app import run_server as run

    run(config or ServeConfig(), listening=listening)
