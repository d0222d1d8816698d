"""The Starlette application of ``pipeloom serve``: the playground page and the JSON API.

Every answer is JSON in the project's own formats (``pipeloom.schedule/1``, ``pipeloom.plan/1``, the
CLI's ``--json`` reports); every refusal is a 4xx with ``{"error": "<one line>"}``. Quick work runs in
threads, searches and plans in worker processes (:mod:`pipeloom.serve.jobs`), so no request blocks another.
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
from pipeloom.serve.errors import RequestError
from pipeloom.serve.jobs import Job, Jobs

__all__ = ["PAGE_POLICY", "create_app", "playground_html", "run_server"]

PAGE_POLICY = ("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; "
               "connect-src 'self'")
"""The playground's Content-Security-Policy: its own inline script and style, requests to this server only."""

Handler = Callable[[Request], Awaitable[Response]]
_T = TypeVar("_T")


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _answers(handler: Handler) -> Handler:
    """Turn the library's refusals into one-line 4xx answers (RequestError: its status; any other
    PipeloomError, e.g. a schedule that does not fit its memory limit: 422)."""

    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as error:
            return _error(_first_line(error), error.status)
        except PipeloomError as error:
            return _error(_first_line(error), 422)

    answer.__name__ = handler.__name__
    return answer


async def _body(request: Request, config: ServeConfig, what: str = "request") -> dict:
    """The request's JSON object, refused with 413 past ``max_body_bytes`` (declared or streamed)."""
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
    return api.read_object(b"".join(chunks), what=what)


async def _timed(config: ServeConfig, work: Callable[..., _T], *args: Any) -> _T:
    """``work(*args)`` in a thread, refused with 504 past ``request_seconds``."""
    try:
        return await asyncio.wait_for(run_in_threadpool(work, *args), config.request_seconds)
    except asyncio.TimeoutError:
        raise RequestError(f"the request took more than this server's limit of {config.request_seconds:g} s; "
                           "ask for fewer ranks or micro-batches", 504) from None


def playground_html() -> str:
    """The playground page: its own script and the timeline view's, inline."""
    from pipeloom.viz.html import static_asset

    static = resources.files("pipeloom.serve").joinpath("static")
    page = static.joinpath("playground.html").read_text(encoding="utf-8")
    return (page.replace("/*TIMELINE_CSS*/", static_asset("timeline.css"))
            .replace("/*TIMELINE_JS*/", static_asset("timeline.js"))
            .replace("/*PLAYGROUND_JS*/", static.joinpath("playground.js").read_text(encoding="utf-8")))


def _result(job: Job) -> dict:
    """The result of a job whose status is ``done``."""
    assert job.result is not None, job.id
    return job.result


def _file(text: str, name: str, media: str) -> Response:
    return Response(text, media_type=media, headers={"Content-Disposition": f'attachment; filename="{name}"'})


def create_app(config: ServeConfig) -> Starlette:
    """The application serving the playground and the API with ``config``'s limits."""
    jobs = Jobs(config)
    page = playground_html()

    async def home(request: Request) -> Response:
        return HTMLResponse(page, headers={"Content-Security-Policy": PAGE_POLICY})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def schedules(request: Request) -> Response:
        from pipeloom.schedules import REGISTRY
        from pipeloom.search import PLACEMENTS

        return JSONResponse({
            "schedules": [{"name": info.name, "summary": info.summary, "options": list(info.options),
                           "splits_backward": info.splits_backward} for info in REGISTRY.values()],
            "placements": [{"name": info.name, "summary": info.summary} for info in PLACEMENTS.values()]})

    async def simulate(request: Request) -> Response:
        return JSONResponse(await _timed(config, api.simulate, await _body(request, config), config))

    async def compare(request: Request) -> Response:
        return JSONResponse(await _timed(config, api.compare, await _body(request, config), config))

    async def schedule_file(request: Request) -> Response:
        name, _, suffix = request.path_params["file"].rpartition(".")
        if suffix not in ("json", "csv") or not name:
            raise RequestError("ask for NAME.json (pipeloom.schedule/1) or NAME.csv (torch's CSV)", 404)
        document = api.query_document(dict(request.query_params))
        text = await _timed(config, api.schedule_file, name, suffix, document, config)
        return _file(text, f"{name}.{suffix}", "application/json" if suffix == "json" else "text/csv")

    async def start_search(request: Request) -> Response:
        checked = api.search_request(await _body(request, config), config)
        job = jobs.submit("search", checked, checked["time_limit"])
        return JSONResponse(job.public(), status_code=202, headers={"Location": f"/api/searches/{job.id}"})

    async def search_state(request: Request) -> Response:
        job = jobs.get(request.path_params["id"], "search")
        if request.method == "DELETE":
            jobs.cancel(job)
        return JSONResponse(job.public())

    async def search_file(request: Request) -> Response:
        job = jobs.get(request.path_params["id"], "search")
        suffix = request.path_params["suffix"]
        if job.status != "done":
            raise RequestError(f"search {job.id} is {job.status}; its schedule exists once it is done", 409)
        text = _result(job)["files"].get(suffix if suffix in ("json", "csv") else "none")
        if text is None:
            raise RequestError(f"no .{suffix} form of this schedule; ask for schedule.json or schedule.csv", 404)
        return _file(text, f"search-{job.id}.{suffix}", "application/json" if suffix == "json" else "text/csv")

    async def make_plan(request: Request) -> Response:
        checked = api.plan_request(await _body(request, config, "cost table"), config)
        job = jobs.submit("plan", checked, config.request_seconds + checked["search"])
        try:
            await asyncio.wait_for(job.finished.wait(), config.request_seconds + checked["search"])
        except asyncio.TimeoutError:
            jobs.cancel(job)
            raise RequestError(f"planning took more than this server's limit of {config.request_seconds:g} s; "
                               "give fewer schedules or micro-batch counts", 504) from None
        finally:
            if not job.finished.is_set():
                jobs.cancel(job)
        if job.status != "done":
            raise RequestError(f"no plan: {job.error}", 422)
        result = _result(job)
        url = str(request.url_for("plan_file", plan=job.id))
        return JSONResponse({"id": job.id, "url": url, "plan": json.loads(result["plan"]),
                             "seconds": result["seconds"], "tried": result["tried"], "candidates": result["candidates"],
                             "view": result["view"], "schedule": json.loads(result["files"]["json"])},
                            status_code=201, headers={"Location": url})

    async def plan_file(request: Request) -> Response:
        name = request.path_params["plan"]
        companion = name.endswith(".schedule.json")
        plan_id = name[: -len(".schedule.json")] if companion else name
        job = jobs.get(plan_id, "plan")
        if job.status != "done":
            raise RequestError(f"plan {plan_id} is {job.status}", 409)
        result = _result(job)
        text = result["schedule_file"] if companion else result["plan"]
        if text is None:
            raise RequestError(f"plan {plan_id} names no schedule file", 404)
        return Response(text, media_type="application/json")

    async def not_found(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException), error  # registered for HTTPException only
        return _error(f"{request.method} {request.url.path}: {error.detail}", error.status_code)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        warming = asyncio.create_task(jobs.warm())  # in the background: the server answers at once
        yield
        warming.cancel()
        await jobs.close()

    routes = [
        Route("/", home), Route("/api/health", health), Route("/api/schedules", schedules),
        Route("/api/simulate", _answers(simulate), methods=["POST"]),
        Route("/api/compare", _answers(compare), methods=["POST"]),
        Route("/api/schedules/{file}", _answers(schedule_file)),
        Route("/api/searches", _answers(start_search), methods=["POST"]),
        Route("/api/searches/{id}", _answers(search_state), methods=["GET", "DELETE"]),
        Route("/api/searches/{id}/schedule.{suffix}", _answers(search_file)),
        Route("/api/plans", _answers(make_plan), methods=["POST"]),
        Route("/plans/{plan}", _answers(plan_file), name="plan_file"),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)


def run_server(config: ServeConfig) -> None:
    """Serve ``config``'s app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="warning",
                limit_concurrency=256, timeout_keep_alive=5, h11_max_incomplete_event_size=64 * 1024)
