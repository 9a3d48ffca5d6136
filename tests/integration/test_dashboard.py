"""``atoll dashboard`` in headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which ``make test``
installs): against a live three-daemon private run, with no join token; and against a served state whose peer
record carries markup, which the page must show as text.

The page's screenshot is kept under ``build/test-artifacts/`` (``ATOLL_TEST_ARTIFACTS`` moves it)."""

import json
import os
import shutil
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from scripts.swarm import Dashboard, LocalSwarm, group_alive, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("ATOLL_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts"))
COMMON = ["--model", "nano", "--batch-size", "4", "--algorithm", "diloco", "--sync-every", "20", "--heartbeat", "1",
          "--eval-budget", "1", "--harness", "step_delay=0.05"]


def browser():
    """A headless Chromium driven through chromedriver, logging the page's network requests."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "Chromium is missing: `make system-packages` installs chromium and chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--window-size=1400,1500"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def requested_urls(driver):
    """Every URL the page asked for, from Chromium's DevTools events."""
    urls = []
    for entry in driver.get_log("performance"):
        event = json.loads(entry["message"])["message"]
        if event["method"] == "Network.requestWillBeSent":
            urls.append(event["params"]["request"]["url"])
    return urls


def assert_no_csp_violation(driver):
    """The page's script and style are allowed by their hashes, and it sets no inline style: the browser refused
    nothing (a refused script would leave the page blank; a refused style, unstyled)."""
    refused = [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
    assert not refused, refused


def assert_loopback_only(urls):
    assert urls, "the page made no request"
    outside = [u for u in urls if urlsplit(u).scheme not in ("data", "about")
               and urlsplit(u).hostname not in ("127.0.0.1", "localhost")]
    assert not outside, f"requests outside loopback: {outside}"


def assert_ended_cleanly(dashboard):
    """A service manager's stop (SIGTERM; Ctrl-C takes the same path): exit 0, no traceback, its DHT process and
    p2pd gone with it."""
    pgid = dashboard.proc.pid
    assert dashboard.stop(sig=signal.SIGTERM) == 0 and "Traceback" not in dashboard.text(), dashboard.text()[-3000:]
    wait_for(lambda: not group_alive(pgid), 30, "the dashboard's processes to end")


@pytest.fixture
def swarm(tmp_path):
    s = LocalSwarm(tmp_path / "swarm", COMMON)  # a private run: the dashboard holds no token
    try:
        s.start("a", join=False)
        s.start("b")
        s.start("c")
        yield s
    finally:
        s.stop_all(timeout=30)


# One read of the page's DOM, in the page's own thread: the page redraws itself every poll, so elements found by one
# call could be gone by the next.
SNAPSHOT = """
const count = sel => document.querySelectorAll(sel).length;
const points = sel => Array.from(document.querySelectorAll(sel), p => +p.getAttribute("data-points"));
return {
  rows: Array.from(document.querySelectorAll("#islands tbody tr"),
                   tr => ({peer: tr.dataset.peer, cells: Array.from(tr.cells, td => td.textContent)})),
  raw: points("#loss-chart path.raw"), smooth: count("#loss-chart path.smooth"),
  held_out: count("#loss-chart circle.held-out"), tokens: points("#tokens-chart path.tokens"),
  error: document.getElementById("error").textContent, polls: +(document.body.dataset.polls || 0),
};
"""


@pytest.mark.timeout(600)
def test_dashboard_shows_a_live_private_run_in_chromium(swarm, tmp_path):
    dashboard = Dashboard(swarm.bootstrap, tmp_path / "dashboard.log", interval=1.0)
    driver = None
    try:
        driver = browser()
        driver.get(dashboard.url)

        def ready():
            page = driver.execute_script(SNAPSHOT)
            done = (len(page["rows"]) == 3 and len(page["raw"]) == 3 and min(page["raw"]) >= 5
                    and page["held_out"] >= 3)
            return page if done else None

        page = wait_for(ready, 300, "three islands, their loss curves and held-out points on the page")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        driver.save_screenshot(str(shot))
        print(f"screenshot: {shot}")
        assert shot.stat().st_size > 10_000

        assert sorted(r["peer"] for r in page["rows"]) == sorted(
            d.maddrs[0].rsplit("/", 1)[1] for d in swarm.daemons.values())
        for row in page["rows"]:
            cells = row["cells"]
            assert cells[1] == "training" and cells[2] == "cpu", cells
            assert int(cells[4]) > 0  # its step
        assert page["smooth"] == 3 and page["tokens"] and page["tokens"][0] >= 2
        assert page["error"] == ""
        assert_loopback_only(requested_urls(driver))
        assert_no_csp_violation(driver)
    finally:
        if driver is not None:
            driver.quit()
        assert_ended_cleanly(dashboard)


def test_the_page_shows_what_the_network_sent_as_text(tmp_path):
    """A record's device and peer id are whatever a peer published: the page shows them, and runs none of it."""
    from atoll.node.ops.dashboard import History, serve

    hostile = '<img src=x onerror="document.body.dataset.pwned=1">'
    record = {"peer_id": "Qm" + "x" * 40 + "<b>bold</b>", "status": "training", "device": hostile, "ranks": 1,
              "step": 7, "version": 2, "fragment_versions": [2], "tokens": 100, "tokens_per_s": 10.0, "loss": 3.0,
              "held_out_loss": 3.1, "held_out_step": 7, "rounds": 1, "rounds_skipped": 0, "bytes_sent": 1,
              "bytes_received": 1, "rejected": 0, "forks_healed": 0, "reachable": True}
    history = History()
    doc = {"run_id": "<i>run</i>", "time": time.time(), "config": None, "peers": [record],
           "totals": {"peers": 1, "ranks": 1, "tokens": 100, "tokens_per_s": 10.0, "max_version": 2,
                      "bytes_sent": 1, "bytes_received": 1},
           "summary": {"source": "records", "summarizers": [], "age_s": None}}
    history.add(doc)
    server = serve("127.0.0.1", 0, history, 1.0)
    driver = None
    try:
        driver = browser()
        driver.get(f"http://127.0.0.1:{server.server_port}/")
        page = wait_for(lambda: (lambda p: p if p["rows"] else None)(driver.execute_script(SNAPSHOT)), 60,
                        "the island's row")
        assert page["rows"][0]["cells"][2] == hostile and page["rows"][0]["peer"] == record["peer_id"]
        assert driver.execute_script("return document.getElementById('run-id').textContent") == "<i>run</i>"
        assert driver.execute_script("return document.querySelectorAll('#islands img, #islands b, h1 i').length") == 0
        assert driver.execute_script("return document.body.dataset.pwned") is None
        assert_loopback_only(requested_urls(driver))
        assert_no_csp_violation(driver)
    finally:
        if driver is not None:
            driver.quit()
        server.shutdown()
        server.server_close()
