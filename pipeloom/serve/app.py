"""The Starlette application of ``pipeloom serve``: the playground page and the JSON API.

Every answer is JSON in the project's own formats (``pipeloom.schedule/1``, ``pipeloom.plan/1``, the
CLI's ``--json`` reports); every refusal is a 4xx (or 5xx) with ``{"error": "<one line>"}``. All work runs in
killable worker processes with a memory limit and a deadline (:mod:`pipeloom.serve.jobs`), request bodies are
parsed in threads and checked (cost tables read) in those workers, so no request blocks another;
:mod:`pipeloom.serve.guard` checks Host, Origin and Sec-Fetch-Site first, :mod:`pipeloom.serve.connections`
bounds connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from pipeloom.errors import PipeloomError
from pipeloom.serve import requests as api
from pipeloom.serve.config import ServeConfig
from pipeloom.serve.errors import RequestError, WorkError
from pipeloom.serve.guard import Guard, own_url
from pipeloom.serve.jobs import Job, Jobs

__all__ = ["PAGE_POLICY", "create_app", "playground_html", "run_server", "uvicorn_options"]

PAGE_POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; "
               "connect-src 'self'; frame-ancestors 'none'")
"""The playground's Content-Security-Policy: its own inline script and style, requests to this server only,
never shown in another page's frame."""

Handler = Callable[[Request], Awaitable[Response]]
_T = TypeVar("_T")


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)  # the guard closes a connection left unread


def _json(text: str, status: int = 200, headers: dict | None = None) -> Response:
    """An answer whose JSON text is already made (in a worker, or kept)."""
    return Response(text, status_code=status, media_type="application/json", headers=headers)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _answers(handler: Handler) -> Handler:
    """Turn the library's refusals into one-line 4xx answers (RequestError: its status; any other
    PipeloomError, e.g. a schedule that does not fit its memory limit: 422)."""

    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except WorkError as error:  # RequestError among them
            return _error(_first_line(error), error.status)
        except PipeloomError as error:
            return _error(_first_line(error), 422)

    answer.__name__ = handler.__name__
    return answer


async def _body(request: Request, config: ServeConfig, what: str = "request") -> dict:
    """The request's JSON object, refused with 415 unless sent as ``application/json`` and with 413 past
    ``max_body_bytes`` (declared or streamed); parsed in a thread, off the event loop."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise RequestError(f"send the {what} as JSON with Content-Type: application/json, not {media[:60]!r}", 415)
    declared = request.headers.get("content-length")
    limit = config.max_body_bytes
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestError(f"the {what} body is larger than this server's limit of {limit:,} bytes", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the {what} body is larger than this server's limit of {limit:,} bytes", 413)
        chunks.append(chunk)
    return await _checked(config, api.read_object, b"".join(chunks), what=what)


async def _checked(config: ServeConfig, check: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``check(*args, **kwargs)`` (parsing a body) in a thread, so that a large body never stalls the event loop;
    504 past ``request_seconds``."""
    try:
        return await asyncio.wait_for(run_in_threadpool(check, *args, **kwargs), config.request_seconds)
    except asyncio.TimeoutError:
        raise RequestError(f"checking the request took more than this server's limit of "
                           f"{config.request_seconds:g} s", 504) from None


def playground_html() -> str:
    """The playground page: its own script and the timeline view's, inline."""
    from pipeloom.viz.html import static_asset

    static = resources.files("pipeloom.serve").joinpath("static")
    page = static.joinpath("playground.html").read_text(encoding="utf-8")
    return (page.replace("/*TIMELINE_CSS*/", static_asset("timeline.css"))
            .replace("/*TIMELINE_JS*/", static_asset("timeline.js"))
            .replace("/*PLAYGROUND_JS*/", static.joinpath("playground.js").read_text(encoding="utf-8")))


def _result(job: Job) -> str:
    """The answer's JSON text of a job whose status is ``done``."""
    assert job.result is not None, job.id
    return job.result


def _file(text: str, name: str, media: str) -> Response:
    return Response(text, media_type=media, headers={"Content-Disposition": f'attachment; filename="{name}"'})


class _Handlers:
    """The routes' handlers over one server's jobs, page and limits."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.jobs = Jobs(config)
        self.page = playground_html()

    async def home(self, request: Request) -> Response:
        return HTMLResponse(self.page, headers={"Content-Security-Policy": PAGE_POLICY})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def schedules(self, request: Request) -> Response:
        from pipeloom.schedules import REGISTRY
        from pipeloom.search import PLACEMENTS

        return JSONResponse({
            "schedules": [{"name": info.name, "summary": info.summary, "options": list(info.options),
                           "splits_backward": info.splits_backward} for info in REGISTRY.values()],
            "placements": [{"name": info.name, "summary": info.summary} for info in PLACEMENTS.values()]})

    async def simulate(self, request: Request) -> Response:
        document = await _body(request, self.config)
        return _json(await self.jobs.quick("simulate", {"document": document, "config": self.config}))

    async def compare(self, request: Request) -> Response:
        document = await _body(request, self.config)
        return _json(await self.jobs.quick("compare", {"document": document, "config": self.config}))

    async def schedule_file(self, request: Request) -> Response:
        name, _, suffix = request.path_params["file"].rpartition(".")
        if suffix not in ("json", "csv") or not name:
            raise RequestError("ask for NAME.json (pipeloom.schedule/1) or NAME.csv (torch's CSV)", 404)
        document = api.query_document(request.query_params.multi_items())
        text = await self.jobs.quick("schedule_file", {"name": name, "format": suffix, "document": document,
                                                  "config": self.config})
        return _file(text, f"{name}.{suffix}", "application/json" if suffix == "json" else "text/csv")

    async def start_search(self, request: Request) -> Response:
        document = await _body(request, self.config)
        checked = json.loads(await self.jobs.quick("check_search", {"document": document, "config": self.config}))
        job = self.jobs.submit("search", checked, checked["time_limit"])
        return _json(job.public(), 202, {"Location": f"/api/searches/{job.id}"})

    async def search_state(self, request: Request) -> Response:
        job = self.jobs.get(request.path_params["id"], "search")
        if request.method == "DELETE":
            self.jobs.cancel(job)
        return _json(job.public())

    async def search_file(self, request: Request) -> Response:
        job = self.jobs.get(request.path_params["id"], "search")
        suffix = request.path_params["suffix"]
        if job.status != "done":
            raise RequestError(f"search {job.id} is {job.status}; its schedule exists once it is done", 409)
        text = job.files.get(suffix if suffix in ("json", "csv") else "none")
        if text is None:
            why = job.files.get("csv_refused") if suffix == "csv" else None
            raise RequestError(f"no .csv form of this schedule: {why}" if why else
                               f"no .{suffix} form of a schedule; ask for schedule.json or schedule.csv", 404)
        return _file(text, f"search-{job.id}.{suffix}", "application/json" if suffix == "json" else "text/csv")

    async def make_plan(self, request: Request) -> Response:
        document = await _body(request, self.config, "cost table")
        # the counts first: 413 at once
        await _checked(self.config, api.plan_request, document, self.config, read_tables=False)
        checked = json.loads(await self.jobs.quick("check_plan", {"document": document, "config": self.config}))
        job = self.jobs.submit("plan", checked, self.config.request_seconds + checked["search"])
        try:
            await asyncio.wait_for(job.finished.wait(), self.config.request_seconds + checked["search"])
        except asyncio.TimeoutError:
            self.jobs.cancel(job)
            raise RequestError(f"planning took more than this server's limit of {self.config.request_seconds:g} s and "
                               "was stopped; give fewer schedules or micro-batch counts", 504) from None
        finally:
            if not job.finished.is_set():
                self.jobs.cancel(job)
        if job.status != "done":
            raise RequestError(f"no plan: {job.error}", job.error_status)
        url = f"{own_url(request.scope)}/plans/{job.id}"
        head = json.dumps({"id": job.id, "url": url})
        return _json(f"{head[:-1]}, {_result(job)[1:]}", 201, {"Location": url})

    async def plan_file(self, request: Request) -> Response:
        name = request.path_params["plan"]
        companion = name.endswith(".schedule.json")
        plan_id = name[: -len(".schedule.json")] if companion else name
        job = self.jobs.get(plan_id, "plan")
        if job.status != "done":
            raise RequestError(f"plan {plan_id} is {job.status}", 409)
        _result(job)
        text = job.files.get("schedule_file" if companion else "plan")
        if text is None:
            raise RequestError(f"plan {plan_id} names no schedule file", 404)
        return Response(text, media_type="application/json")

    async def not_found(self, request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException), error  # registered for HTTPException only
        return _error(f"{request.method} {request.url.path}: {error.detail}", error.status_code)

    async def defect(self, request: Request, error: Exception) -> Response:
        return _error(f"internal error: {type(error).__name__}: {_first_line(error)}", 500)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        warming = asyncio.create_task(self.jobs.warm())  # in the background: the server answers at once
        yield
        warming.cancel()
        await self.jobs.close()


def create_app(config: ServeConfig) -> Guard:
    """The application serving the playground and the API with ``config``'s limits."""
    h = _Handlers(config)
    routes = [
        Route("/", h.home), Route("/api/health", h.health), Route("/api/schedules", h.schedules),
        Route("/api/simulate", _answers(h.simulate), methods=["POST"]),
        Route("/api/compare", _answers(h.compare), methods=["POST"]),
        Route("/api/schedules/{file}", _answers(h.schedule_file)),
        Route("/api/searches", _answers(h.start_search), methods=["POST"]),
        Route("/api/searches/{id}", _answers(h.search_state), methods=["GET", "DELETE"]),
        Route("/api/searches/{id}/schedule.{suffix}", _answers(h.search_file)),
        Route("/api/plans", _answers(h.make_plan), methods=["POST"]),
        Route("/plans/{plan}", _answers(h.plan_file), name="plan_file"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: h.not_found, Exception: h.defect},
                    lifespan=h.lifespan)
    app.state.jobs = h.jobs
    return Guard(app, config)


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """The keywords of ``uvicorn.Config`` that serve ``create_app(config)``: its connection protocol
    (:mod:`pipeloom.serve.connections`; no ``limit_concurrency``, which silent sockets exhaust), no ``server``
    banner, a short keep-alive and a 64 KiB cap on a request head."""
    from pipeloom.serve.connections import guarded_protocol

    return {"host": config.host, "port": config.port, "log_level": "warning", "http": guarded_protocol(config),
            "server_header": False, "timeout_keep_alive": 5, "h11_max_incomplete_event_size": 64 * 1024}


def run_server(config: ServeConfig, *, listening: Callable[[int], None] | None = None) -> None:
    """Serve ``config``'s app with uvicorn until interrupted, on a socket bound here first: a host or port it cannot
    have is one PipeloomError (uvicorn's own had come after the playground's address was printed, with exit 3);
    ``listening`` gets the port once the socket is bound (the one the system picked for port 0)."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)  # as uvicorn binds: "" is any
    with sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((config.host, config.port))
        except OSError as error:
            raise PipeloomError(f"cannot listen on {config.host}:{config.port}: {error.strerror or error}; pick "
                                "another --port, or a --host of this machine") from None
        if listening is not None:
            listening(sock.getsockname()[1])
        uvicorn.Server(uvicorn.Config(create_app(config), **uvicorn_options(config))).run(sockets=[sock])
