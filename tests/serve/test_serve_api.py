"""The JSON API of ``pipeloom serve`` against a live local server. Oracles: the library run here
(simulate, plan_mesh), the project's strict readers on every answer, and one-line 4xx refusals."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeloom.cli import main
from pipeloom.ir import schedule_from_json
from pipeloom.plan import load_costs, load_plan
from pipeloom.plan.mesh import plan_mesh
from pipeloom.plan.plan import plan_from_json
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate
from pipeloom.stages import Costs
from pipeloom.validate import validate


def call(url: str, document=None, *, method: str | None = None, data: bytes | None = None) -> tuple[int, dict]:
    body = data if data is not None else (None if document is None else json.dumps(document).encode())
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def finished_search(server: str, document: dict, seconds: float = 30) -> dict:
    status, job = call(f"{server}/api/searches", document)
    assert status == 202, job
    deadline = time.monotonic() + seconds
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
        job = call(f"{server}/api/searches/{job['id']}")[1]
    return job


@pytest.mark.parametrize(("path", "document", "data", "status", "words"), [
    ("/api/simulate", None, b"{not json", 400, "malformed JSON"),
    ("/api/simulate", None, b"[1, 2]", 400, "must be a JSON object"),
    ("/api/simulate", None, b'{"ranks": ' + b"1" * 5000 + b"}", 400, "a number of more than 4,300 digits"),
    ("/api/simulate", {"schedule": "nope", "ranks": 2, "microbatches": 2}, None, 404, "unknown schedule 'nope'"),
    ("/api/simulate", {"schedule": "1f1b", "ranks": 2, "microbatches": 2, "gpus": 1}, None, 400,
     "unknown key(s) ['gpus']"),
    ("/api/simulate", {"schedule": "1f1b", "ranks": 0, "microbatches": 2}, None, 400,
     "ranks: expected an integer >= 1"),
    ("/api/simulate", {"schedule": "1f1b", "ranks": 64, "microbatches": 4096}, None, 413, "above this server's limit"),
    # a cost's own fault is the request's, said once (it had read "simulate: simulate.f: ...", a 422)
    ("/api/simulate", {"schedule": "1f1b", "ranks": 2, "microbatches": 2, "f": -1}, None, 400,
     "simulate.f: must be >= 0"),
    ("/api/simulate", {"schedule": {"format": "other"}}, None, 422, "format"),
    ("/api/searches", {"placement": "linear", "ranks": 2, "microbatches": 2, "time_limit": 1e6}, None, 400,
     "time_limit"),
    ("/api/plans", {"costs": {"format": "pipeloom.costs/1", "microbatch_size": 1, "pieces": [], "gpu": 1}, "ranks": 2,
                    "global_batch": 4}, None, 400, "unknown key(s) ['gpu']"),
    # an empty list of tables (a 500 "internal error: IndexError" had answered it)
    ("/api/plans", {"costs": [], "ranks": 2, "global_batch": 4}, None, 400, "plan.costs: an empty list"),
    ("/api/nothing", None, None, 404, "Not Found"),
])
def test_bad_requests_get_a_4xx_with_one_clear_line(server, path, document, data, status, words):
    code, answer = call(server + path, document, data=data)
    assert code == status, answer
    assert list(answer) == ["error"] and "\n" not in answer["error"] and words in answer["error"], answer


@pytest.mark.parametrize("declared", [True, False])
def test_an_oversized_body_gets_413_before_it_is_read(server, declared):
    """Declared (Content-Length) or streamed (chunked), past the 1 MiB limit: 413 and one line. The server
    answers as soon as it knows, so the client sends only what it must (a real client may not finish)."""
    import http.client
    from urllib.parse import urlsplit

    connection = http.client.HTTPConnection(urlsplit(server).netloc, timeout=30)
    connection.putrequest("POST", "/api/simulate")
    connection.putheader("Content-Type", "application/json")
    if declared:
        connection.putheader("Content-Length", str(2**20 + 1))
        connection.endheaders()
        connection.send(b" " * 1024)
    else:
        connection.putheader("Transfer-Encoding", "chunked")
        connection.endheaders()
        chunk = b" " * 2**16
        try:
            for _ in range(17):  # 1.06 MiB
                connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            connection.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed first: allowed
            pass
    answer = connection.getresponse()
    assert answer.status == 413
    limit = "the request body is larger than this server's limit of 1,048,576 bytes"
    assert json.loads(answer.read()) == {"error": limit}
    connection.close()


def test_downloads_are_the_projects_formats(server):
    status, answer = call(f"{server}/api/simulate", {"schedule": "zbv", "ranks": 4, "microbatches": 8, "f": 2})
    expected = simulate(build_schedule("zbv", 4, 8, costs=Costs(f=2)))
    assert status == 200 and answer["report"]["makespan"] == expected.makespan
    with urllib.request.urlopen(f"{server}/api/schedules/zbv.json?ranks=4&microbatches=8&f=2", timeout=30) as r:
        assert simulate(schedule_from_json(r.read().decode())).makespan == expected.makespan
    with urllib.request.urlopen(f"{server}/api/schedules/zbv.csv?ranks=4&microbatches=8", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/csv") and r.read().decode().startswith("0F0,")

    # a digit separator is a typo in a query, not 40 ranks
    from pipeloom.serve.errors import RequestError
    from pipeloom.serve.requests import query_document

    with pytest.raises(RequestError, match=r"query ranks='4_0': expected a whole number"):
        query_document([("ranks", "4_0")])
    # a count that is not whole is told so (it had read "expected a number"); a key given twice is refused (the last
    # had won), through the server too
    with pytest.raises(RequestError, match=r"query ranks='4.5': expected a whole number"):
        query_document([("ranks", "4.5")])
    with pytest.raises(RequestError, match=r"query f='x': expected a number$"):
        query_document([("f", "x")])
    with pytest.raises(RequestError, match=r"query ranks is given twice; give it once"):
        query_document([("ranks", "4"), ("microbatches", "8"), ("ranks", "5")])
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{server}/api/schedules/1f1b.json?ranks=4&microbatches=8&ranks=5", timeout=30)
    assert refused.value.code == 400 and b"given twice" in refused.value.read()


def test_simulate_reports_as_show_json_does(server):
    """The report is ``show --json``'s: the costs given and the user's micro-batches (dualpipe pairs them); a
    schedule that takes no stages_per_rank refuses it, as ``show`` does (it was dropped unsaid)."""
    from pipeloom.viz.report import timeline_report

    request = {"schedule": "dualpipe", "ranks": 4, "microbatches": 8, "f": 2, "b": 3, "w": 1}
    status, answer = call(f"{server}/api/simulate", request)
    costs = Costs(f=2, b=3, w=1)
    expected = timeline_report(simulate(build_schedule("dualpipe", 4, 8, costs=costs)), microbatches=8, costs=costs)
    assert status == 200 and answer["report"] == json.loads(json.dumps(expected))
    assert answer["report"]["costs"]["f"] == 2 and answer["report"]["num_microbatches"] == 8
    status, answer = call(f"{server}/api/simulate", {"schedule": "1f1b", "ranks": 4, "microbatches": 8,
                                                      "stages_per_rank": 2})
    assert status == 422 and "schedule '1f1b' does not take stages_per_rank" in answer["error"]
    assert "interleaved-1f1b" in answer["error"]
    status, answer = call(f"{server}/api/simulate", {"schedule": "1f1b", "ranks": 64, "microbatches": 4096,
                                                      "stages_per_rank": 2})  # refused as such, not as too big
    assert status == 422 and "does not take stages_per_rank" in answer["error"]


def test_a_searched_schedule_without_a_csv_form_says_why(server):
    """An M-shape search's schedule has no torch CSV form: the 404 says why (it had said "ask for schedule.json or
    schedule.csv" to a request for schedule.csv); its JSON form is there."""
    job = finished_search(server, {"placement": "mshape", "ranks": 4, "microbatches": 4, "time_limit": 2,
                                   "memory_limit": 6})
    assert job["status"] == "done", job
    code, answer = call(f"{server}/api/searches/{job['id']}/schedule.csv")
    assert code == 404 and answer["error"].startswith("no .csv form of this schedule: schedule "), answer
    assert "cannot be saved as torch CSV because" in answer["error"] and "save it as .json" in answer["error"]
    with urllib.request.urlopen(f"{server}/api/searches/{job['id']}/schedule.json", timeout=30) as r:
        assert schedule_from_json(r.read().decode()).num_ranks == 4


def test_a_cancelled_search_frees_its_worker(server):
    # its bound is not met: it runs its whole time
    document = {"placement": "nnshape", "ranks": 8, "microbatches": 48, "time_limit": 60}
    started = [call(f"{server}/api/searches", document)[1] for _ in range(3)]  # the server's 3 workers
    time.sleep(1.0)
    for job in started:
        code, answer = call(f"{server}/api/searches/{job['id']}", method="DELETE")
        assert code == 200 and answer["status"] == "cancelled", answer
    quick = finished_search(server, {"placement": "linear", "ranks": 2, "microbatches": 4, "time_limit": 5}, seconds=10)
    assert quick["status"] == "done" and quick["result"]["report"]["makespan"] == 15.0


def test_fifty_concurrent_mixed_requests(server, costs_file):
    """Simulate, search (up to 2 s, optimal sooner) and plan at once: every answer right, none refused."""
    costs = costs_file
    table = json.loads(costs.read_text())
    request = {"ranks": 2, "global_batch": 4, "schedules": ["1f1b", "zb-h1"], "microbatches": [4]}
    expected_plan = plan_mesh(load_costs(costs), num_ranks=2, global_batch=4, schedules=["1f1b", "zb-h1"],
                              microbatches=[4]).plan
    names = ("1f1b", "zbv", "interleaved-1f1b", "dualpipe", "zb-h1")

    def one(k: int) -> str:
        if k % 3 == 0:
            name = names[k % len(names)]
            code, answer = call(f"{server}/api/simulate", {"schedule": name, "ranks": 4, "microbatches": 8})
            assert code == 200, answer
            assert answer["report"]["makespan"] == simulate(build_schedule(name, 4, 8)).makespan
            return "simulate"
        if k % 3 == 1:
            job = finished_search(server, {"placement": "linear", "ranks": 4, "microbatches": 8, "time_limit": 2.0},
                                  seconds=120)  # queued behind 16 others on the server's workers: a hang guard
            assert job["status"] == "done", job
            assert job["result"]["report"]["makespan"] == 33.0  # gpipe/1f1b's (p + m - 1)(f + b) on unit costs
            return "search"
        code, answer = call(f"{server}/api/plans", {"costs": table, **request})
        assert code == 201, answer
        plan = plan_from_json(json.dumps(answer["plan"]))
        assert plan.predicted_step_time == pytest.approx(expected_plan.predicted_step_time)
        validate(schedule_from_json(json.dumps(answer["schedule"])))
        return "plan"

    started = time.monotonic()
    with ThreadPoolExecutor(50) as pool:
        kinds = list(pool.map(one, range(50)))
    seconds = time.monotonic() - started
    print(f"50 mixed requests ({kinds.count('simulate')} simulate, {kinds.count('search')} search, "
          f"{kinds.count('plan')} plan) in {seconds:.2f} s")
    assert len(kinds) == 50  # every answer checked; the time is printed, not bounded (pytest's timeout guards a hang)


def test_plans_by_url_and_plan_server(server, costs_file, tmp_path, capsys):
    save = tmp_path / "plan.json"
    code = main(["plan", "--costs", str(costs_file), "--ranks", "4", "--global-batch", "16", "--memory-limit", "16MiB",
                 "--server", server, "--save", str(save), "-o", str(tmp_path / "plan.html")])
    out, err = capsys.readouterr()
    assert code == 0, err
    url = next(word for word in out.split() if word.startswith(server + "/plans/"))
    fetched, saved = load_plan(url), load_plan(save)
    local = plan_mesh(load_costs(costs_file), num_ranks=4, global_batch=16, memory_limit=16 * 2**20).plan
    for plan in (fetched, saved):
        assert plan.predicted_step_time == pytest.approx(local.predicted_step_time)
        assert plan.split_points == local.split_points
    if fetched.schedule.endswith(".json"):  # a cost-aware order: fetched beside the plan, read by the strict reader
        from pipeloom.ir import load_schedule

        assert load_schedule(fetched.schedule).num_ranks == 4 and load_schedule(saved.schedule).num_ranks == 4
    assert "PipeloomTimeline" in (tmp_path / "plan.html").read_text()
    with pytest.raises(Exception, match="answered 404"):
        load_plan(f"{server}/plans/none")
