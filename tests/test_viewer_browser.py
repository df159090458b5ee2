"""``rtrees view`` in a real browser (issue 26): headless Chromium driven by Selenium.

Chromium and its driver come from Debian's packages (``make setup`` installs
``chromium chromium-driver``; Playwright's own browser download needs internet we do not
have). Where neither a browser nor Selenium can be found the test skips and says why
(``pytest -ra`` prints the reason). Otherwise, on the store of ``tests/viewer_store.py``:
check the page is refused without the access token, open the tokened URL the CLI
prints (its cookie carries the page's own requests), select a tree, click a node, check
the panel's stored action text and credit values, label the node, switch the token and
node colouring, plot a run's metrics, and take a screenshot into the test's temporary
directory.
``python tests/test_viewer_browser.py --write`` saves the screenshot as ``docs/viewer.png``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import viewer_store  # tests/viewer_store.py
from viewer_store import ACTION_2, CREDIT

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


def _find(names: tuple[str, ...]) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


def browser() -> tuple[str, str] | str:
    """(browser, driver) paths, or the reason there is none."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    found, driver = _find(BROWSERS), _find(DRIVERS)
    if found is None or driver is None:
        return ("no headless Chromium here (make setup installs Debian's chromium and "
                "chromium-driver; needs root and apt)")
    return found, driver


def make_driver(found: tuple[str, str]) -> Any:
    """A headless Chromium (``found``: browser and driver paths) under Selenium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1500,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(found[1]))


def drive(d: Any, url: str, shot: Path) -> dict[str, Any]:
    """The clicks of the test on the page at ``url`` (the server's ``login_url``, with the
    access token); returns what the page showed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(d, 15)

    def css(sel: str) -> Any:
        return wait.until(lambda d: d.find_element(By.CSS_SELECTOR, sel))

    seen: dict[str, Any] = {}
    d.get(url.split("?")[0])  # without the access token: a JSON error, no page
    seen["no_token"] = d.find_element(By.TAG_NAME, "body").text
    d.get_log("browser")  # drop the 403 the browser logged
    d.get(url)
    css("body[data-ready]")
    seen["address"] = d.current_url  # the page took the token out of it
    d.find_element(By.ID, "filter").send_keys("sampler = 'bel'")
    d.find_element(By.ID, "apply-filter").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tree-list tbody tr")) == 1)
    css('tr[data-tree="bel-0"]').click()
    css('g.node[data-node="2"]').click()
    wait.until(lambda d: d.find_element(By.ID, "node-title").text == "node 2")
    seen["action"] = d.find_element(By.ID, "action-text").text
    seen["credit"] = {td.get_attribute("data-method"): td.text
                      for td in d.find_elements(By.CSS_SELECTOR, "#credit-table td[data-method]")}
    seen["critical"] = len(d.find_elements(By.CSS_SELECTOR, 'g.node[data-node="2"] .critical'))
    seen["mc"] = d.find_element(By.ID, "mc-ref").text
    d.find_element(By.ID, "label-key").send_keys("verdict")
    d.find_element(By.ID, "label-value").send_keys("wrong operator")
    d.find_element(By.ID, "label-add").click()
    seen["label"] = css('#label-list li[data-key="verdict"]').text
    toks = d.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    seen["tokens"] = "".join(t.text for t in toks)
    seen["logprob_bg"] = toks[-1].value_of_css_property("background-color")
    Select(d.find_element(By.ID, "token-color")).select_by_value("credit:tree_grpo")
    wait.until(lambda d: "tree_grpo" in d.find_element(By.ID, "token-legend").text)
    seen["credit_bg"] = d.find_elements(By.CSS_SELECTOR, "#tokens .tok")[-1] \
        .value_of_css_property("background-color")
    seen["token_title"] = d.find_elements(By.CSS_SELECTOR, "#tokens .tok")[-1] \
        .get_attribute("title")
    Select(d.find_element(By.ID, "node-color")).select_by_value("credit:grpo")
    seen["credit_labels"] = [e.text for e in d.find_elements(By.CSS_SELECTOR, ".credit-label")]
    seen["compare"] = d.find_element(By.ID, "compare-summary").text
    seen["sign_ring"] = [e.find_element(By.XPATH, "..").get_attribute("data-node")
                         for e in d.find_elements(By.CSS_SELECTOR, ".sign-differs")]
    css(f'tr[data-run="{viewer_store.TRAIN_RUN}"]').click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "svg.plot")) == 2)
    seen["plots"] = sorted(e.get_attribute("data-metric")
                           for e in d.find_elements(By.CSS_SELECTOR, "svg.plot"))
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    seen["console_errors"] = errors
    d.save_screenshot(str(shot))
    return seen


def test_the_page_in_chromium(driver: Any, tmp_path: Path) -> None:
    from analysis.viewer.server import start

    store = viewer_store.build(tmp_path / "store")
    server, thread = start(store)
    try:
        seen = drive(driver, server.login_url, tmp_path / "viewer.png")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert "access token" in seen["no_token"] and "bel-0" not in seen["no_token"]
    assert seen["address"] == server.url  # the token left the address bar
    assert seen["action"] == ACTION_2
    grpo, tree_grpo = CREDIT[("bel-0", 2)]
    assert seen["credit"] == {"grpo": f"{grpo:g}", "tree_grpo": f"{tree_grpo:g}"}
    assert seen["critical"] == 1
    assert seen["label"].startswith("node: verdict = wrong operator")
    assert seen["mc"].startswith("Mean@8 = 0.375 (3/8")
    assert seen["tokens"] == ACTION_2  # decoded by the tree's tokenizer
    assert seen["logprob_bg"] != seen["credit_bg"]  # the colouring switched
    assert seen["token_title"].startswith("token ") and "credit:tree_grpo -0.75" in \
        seen["token_title"]  # the last token carries the node's full ramped value
    assert "-0.5" in seen["credit_labels"] and "0.5" in seen["credit_labels"]
    assert seen["compare"].startswith("1 nodes disagree in sign") and seen["sign_ring"] == ["4"]
    assert seen["plots"] == ["loss", "reward"]
    assert seen["console_errors"] == []
    assert (tmp_path / "viewer.png").stat().st_size > 10_000


def test_the_static_export_in_chromium(driver: Any, tmp_path: Path) -> None:
    """``rtrees view --export``: the same page from one file on disk (file://, no server)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from analysis.viewer.export import export_static

    store = viewer_store.build(tmp_path / "store")
    report = export_static(store, tmp_path / "export", where="sampler IN ('bel', 'caliper')")
    assert report.trees == 2
    wait = WebDriverWait(driver, 15)
    driver.get(report.path.as_uri())
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "body[data-ready]"))
    assert driver.find_element(By.ID, "filter").get_attribute("disabled") is not None
    rows = driver.find_elements(By.CSS_SELECTOR, "#tree-list tbody tr")
    assert [r.get_attribute("data-tree") for r in rows] == ["bel-0", "cal-0"]
    rows[1].click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".local-group"))
    assert driver.find_element(By.CSS_SELECTOR, ".local-group").get_attribute(
        "data-branch") == "1"
    driver.find_element(By.CSS_SELECTOR, 'g.node[data-node="4"]').click()
    wait.until(lambda d: d.find_element(By.ID, "node-title").text == "node 4")
    assert driver.find_element(By.ID, "action-text").text == "<answer>442</answer>"
    Select(driver.find_element(By.ID, "compare-b")).select_by_value("grpo")
    Select(driver.find_element(By.ID, "compare-a")).select_by_value("tree_grpo")
    wait.until(lambda d: "disagree" in d.find_element(By.ID, "compare-summary").text)
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


if __name__ == "__main__":  # python tests/test_viewer_browser.py --write: docs/viewer.png
    import tempfile

    if "--write" not in sys.argv[1:]:
        sys.exit("usage: python tests/test_viewer_browser.py --write")
    found = browser()
    if isinstance(found, str):
        sys.exit(found)
    d = make_driver(found)
    from analysis.viewer.server import start

    with tempfile.TemporaryDirectory() as tmp:
        server, _ = start(viewer_store.build(Path(tmp) / "store"))
        drive(d, server.login_url, ROOT / "docs" / "viewer.png")
        server.shutdown()
    d.quit()
    print(f"wrote {ROOT / 'docs' / 'viewer.png'}")
