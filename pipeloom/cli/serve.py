"""``pipeloom serve``: the web playground and JSON API on this machine (needs ``pip install
'pipeloom[serve]'``)."""

from __future__ import annotations

import argparse

from pipeloom.cli.argtypes import count, number
from pipeloom.cli.errors import UsageError

__all__ = ["add_serve_parser", "cmd_serve"]


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``pipeloom serve``."""

    serve = commands.add_parser(
        "serve", help="run the web playground and JSON API (pip install 'pipeloom[serve]')",
        description="Serve the playground (pick schedules, costs and limits; search; plan from a cost table) and "
                    "its JSON API, on 127.0.0.1 unless --host says otherwise (see docs/playground.md).")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1, this machine only; 0.0.0.0 serves every network)")
    serve.add_argument("--port", type=number(int, "a port number 0..65535", 0, 65535), default=8765,
                       help="TCP port (default 8765)")
    serve.add_argument("--workers", type=count, default=2, help="searches and plans run at once (default 2)")
    serve.add_argument("--max-body", type=count, default=4 * 2**20, metavar="BYTES",
                       help="largest request body in bytes (default 4 MiB)")
    serve.add_argument("--request-seconds", type=number(float, "a number of seconds > 0", 0.01), default=30.0,
                       metavar="S", help="time limit of a simulate, compare or plan request (default 30)")
    serve.add_argument("--max-actions", type=count, default=100_000, metavar="N",
                       help="most work one request may ask for, in actions (default 100,000; docs/playground.md)")
    serve.add_argument("--worker-memory", default="1GiB", metavar="SIZE",
                       help="memory a worker process may add to what it starts with (default 1GiB)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="a host name the server answers to besides the address it binds (repeatable; '*': any, "
                            "which lets a DNS-rebinding page read the API)")
    serve.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """``pipeloom serve``: run until interrupted."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError("pipeloom serve needs Starlette and uvicorn; install them with "
                         "pip install 'pipeloom[serve]'") from None
    from pipeloom.errors import PipeloomError
    from pipeloom.plan.costs.parts import parse_bytes
    from pipeloom.serve import ServeConfig, run_server

    try:
        memory = int(parse_bytes(args.worker_memory))
    except PipeloomError as error:
        raise UsageError(f"--worker-memory: {error}") from None
    try:
        config = ServeConfig(host=args.host, port=int(args.port), workers=args.workers, max_body_bytes=args.max_body,
                             request_seconds=args.request_seconds, max_actions=args.max_actions,
                             worker_memory_bytes=memory, allowed_hosts=tuple(args.allow_host))
    except ValueError as error:
        raise UsageError(str(error)) from None
    def listening(port: int) -> None:  # the port bound (the system's pick for --port 0)
        host = f"[{args.host}]" if ":" in args.host else args.host or "0.0.0.0"
        print(f"pipeloom playground on http://{host}:{port}/ (Ctrl-C stops it)", flush=True)

    try:
        run_server(config, listening=listening)
    except KeyboardInterrupt:
        pass
    except PipeloomError as error:  # a host or port it cannot have
        raise UsageError(str(error)) from None
    return 0
