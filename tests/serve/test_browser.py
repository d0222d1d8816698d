"""The playground and the self-contained HTML view in a real browser (headless Chromium + Selenium):
change a setting and see the picture update, run and cancel a search, upload a cost table and get a
plan, download a schedule and check it with ``pipeloom simulate``; the HTML file opens offline."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipeloom.cli import main
from pipeloom.schedules import build_schedule
from pipeloom.sim import simulate
from pipeloom.viz.html import write_html

README_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"
"""Where the README's picture of the playground comes from: PIPELOOM_SCREENSHOT=1 writes it there."""


def wait(driver, script: str, seconds: float = 20):
    """The value of ``script`` once truthy."""
    deadline = time.monotonic() + seconds
    while True:
        value = driver.execute_script(script)
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for: {script}; page error: {driver.find_element('id', 'error').text!r}"
            return value
        time.sleep(0.05)


def test_playground(browser, server, costs_file, capsys, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server + "/")
    wait(browser, "return window.pipeloomPlayground && window.pipeloomPlayground.updates >= 1")
    summary = browser.find_element(By.CSS_SELECTOR, "#view .pl-summary").text
    assert summary.startswith("1f1b: makespan 33,")  # p=4, m=8: (p + m - 1)(f + b + w) on unit costs
    # change a setting: 8 micro-batches -> 12, the picture and the comparison follow
    field = browser.find_element(By.ID, "microbatches")
    field.clear()
    field.send_keys("12")
    wait(browser, "return window.pipeloomPlayground.updates >= 2")
    expected = simulate(build_schedule("1f1b", 4, 12)).makespan
    wait(browser, "return document.querySelector('#view .pl-summary').textContent"
                  f".indexOf('makespan {expected:,g}') >= 0")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#compare-table tr")) >= 4
    # hover: the tooltip names the action, its times and the memory after it
    view = browser.find_element(By.CSS_SELECTOR, "#view .pl-timeline")
    from selenium.webdriver.common.action_chains import ActionChains

    left, top = -view.size["width"] // 2 + 62, -view.size["height"] // 2 + 10
    ActionChains(browser).move_to_element_with_offset(view, left, top).perform()
    tip = wait(browser, "var t = document.querySelector('#view .pl-tip'); "
                        "return t.style.display == 'block' && t.textContent")
    assert "0F0 on rank 0" in tip and "start 0" in tip and "memory after 1" in tip
    # zoom with the wheel: the range narrows
    browser.execute_script("arguments[0].dispatchEvent(new WheelEvent('wheel', {deltaY: -100, clientX: 300, "
                           "clientY: 20, bubbles: true, cancelable: true}))", view)
    shown = wait(browser, "return document.querySelector('#view .pl-view').getAttribute('data-range')")
    low, high = map(float, shown.split(","))
    assert high - low < expected
    shot = README_SCREENSHOT if os.environ.get("PIPELOOM_SCREENSHOT") == "1" else tmp_path / "playground.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
    # download the schedule and check it with `pipeloom simulate`
    browser.find_element(By.ID, "download-json").click()
    path = browser.download_dir / "1f1b.json"
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert main(["simulate", str(path), "--json"]) == 0
    assert f'"makespan": {expected}' in capsys.readouterr().out
    # a refusal shows the server's one line (a JSON parse error before): a memory limit below one micro-batch
    from selenium.webdriver.common.keys import Keys

    limit = browser.find_element(By.ID, "memory-limit")
    limit.send_keys("0.5")
    shown = wait(browser, "var e = document.getElementById('error').textContent; "
                          "return e.indexOf('above the limit 0.5') >= 0 && e")
    assert "JSON" not in shown and "HTTP" not in shown
    wait(browser, "return document.getElementById('compare-table').textContent.indexOf('memory_limit 0.5') >= 0")
    limit.send_keys(Keys.BACKSPACE * 3)
    wait(browser, "return document.getElementById('error').textContent == '' && "
                  "document.querySelector('#view .pl-summary') !== null")
    # a search: run one that takes long, see progress, cancel it; run a short one to the end
    browser.find_element(By.ID, "placement").send_keys("nnshape")  # its bound is not met: it runs its time
    for name, value in (("search-ranks", "8"), ("search-microbatches", "48"), ("search-time", "60")):
        box = browser.find_element(By.ID, name)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "search-run").click()
    wait(browser, "return document.getElementById('search-status').textContent.indexOf('running') == 0")
    browser.find_element(By.ID, "search-cancel").click()
    wait(browser, "return document.getElementById('search-status').textContent.indexOf('cancelled') == 0")
    # upload a cost table and get a plan
    browser.find_element(By.ID, "costs-file").send_keys(str(costs_file))
    browser.find_element(By.ID, "plan-run").click()
    wait(browser, "return window.pipeloomPlayground.plans >= 1", seconds=30)
    assert browser.find_element(By.ID, "plan-url").text.startswith(server + "/plans/")
    assert browser.find_element(By.CSS_SELECTOR, "#plan-view .pl-summary").text.startswith(
        browser.find_element(By.CSS_SELECTOR, "#plan-result").text.split(",")[0])


def test_the_html_file_opens_with_no_network(browser, tmp_path):
    timeline = simulate(build_schedule("zbv", 4, 8, memory_limit=6))
    path = tmp_path / "timeline.html"
    write_html(timeline, path)
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0, "downloadThroughput": 0,
                                                                 "uploadThroughput": 0})
    browser.get_log("browser")  # drop what earlier pages logged
    try:
        browser.get(path.as_uri())
        drawn = wait(browser, "var v = document.querySelector('.pl-view'); return v && v.getAttribute('data-drawn')")
        assert int(drawn) >= 1
        hit = browser.execute_script("var v = document.querySelector('.pl-view').pipeloomView; "
                                     "return v.hit(v.canvas, 60, 10)")
        assert hit.startswith("0F0 on rank 0") and f"memory after {timeline.memory[0][0]:g}" in hit
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
    finally:
        browser.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                                     "downloadThroughput": -1, "uploadThroughput": -1})
