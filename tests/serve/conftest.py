"""A local ``pipeloom serve`` (uvicorn in a process of its own, a free port) and a headless Chromium for the
playground tests; the browser tests skip, saying why, where no browser is installed."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="pipeloom serve needs the serve extra: pip install 'pipeloom[serve]'")
pytest.importorskip("uvicorn", reason="pipeloom serve needs the serve extra: pip install 'pipeloom[serve]'")

from servers import SETTINGS, serving  # noqa: E402

from pipeloom.plan import CostTable, Link, Piece, save_costs  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server() -> str:
    """The base URL of a server with small limits (:data:`SETTINGS`)."""
    with serving(SETTINGS) as (url, _):
        yield url


def _cost_table(path: Path, pieces: int = 4) -> Path:
    """A small ``pipeloom.costs/1`` file: ``pieces`` equal blocks (seconds and bytes)."""
    items = tuple(Piece(name=f"blocks.{k}", f=0.01, i=0.01, w=0.008, activation_bytes=2**20, w_activation_bytes=2**18,
                        param_bytes=2**19, output_bytes=2**16) for k in range(pieces))
    save_costs(CostTable(pieces=items, microbatch_size=1, link=Link(latency=1e-4, bandwidth=1e9)), path)
    return path


@pytest.fixture
def costs_file(tmp_path) -> Path:
    return _cost_table(tmp_path / "costs.json")


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium driven by Selenium, downloading into its own folder (``browser.download_dir``)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium (the test extra)")
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(f"no browser: {CHROMIUM} and {CHROMEDRIVER} are missing (`make test` installs Debian's chromium "
                    "and chromium-driver when run as root)")
    from selenium.webdriver.chrome.service import Service

    profile, downloads = tempfile.mkdtemp(prefix="pipeloom-chromium-"), tempfile.mkdtemp(prefix="pipeloom-dl-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.add_experimental_option("prefs", {"download.default_directory": downloads,
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.download_dir = Path(downloads)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": downloads})
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
    shutil.rmtree(downloads, ignore_errors=True)
