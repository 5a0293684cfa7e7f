"""The operator console in a real browser (Debian's Chromium, headless,
driven by Playwright). Run by tests/tests/console.rs against a real relay on
PostgreSQL + tansu + NATS, which sets the scene and passes it in the
environment:

  CONSOLE          the relay's base URL (http://127.0.0.1:PORT)
  OPERATOR_TOKEN   an operator token of no team
  VIEWER_TOKEN     a viewer token of no team
  BILLING_TOKEN    an operator token of team `billing`
  POISON_ID        a failed event of route `orders` (owner orders-team) whose
                   cause was fixed: a retry publishes it
  POISON_MARK      a string only in that event's payload
  KEPT_ID          another failed event of `orders`, left failed
  KEPT_MARK        a string only in its payload
  HOSTILE_ID       the failed event that got route `risky` (owner billing)
                   quarantined
  CANDIDATE        a candidate plugin (.wasm) to try on route `orders`
  CANDIDATE_CONFIG its config (JSON)
  SHOTS            where the screenshots go

Every step asserts what a user would see; any failure exits non-zero with
what was expected.
"""

import os
import re
import sys
import time

from playwright.sync_api import sync_playwright, expect

BASE = os.environ["CONSOLE"]
SHOTS = os.environ["SHOTS"]
SOURCE = "default"


def shot(page, name):
    page.screenshot(path=os.path.join(SHOTS, f"console-{name}.png"), full_page=True)


def event_url(event_id):
    return f"{BASE}/console/failed/{SOURCE}/{event_id}"


def sign_in(page, token):
    page.goto(f"{BASE}/console")
    expect(page).to_have_url(re.compile(r"/console/login$"))
    page.get_by_label("Console token").fill(token)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Overview")


def sign_out(page):
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/console/login$"))


def until(what, check, timeout=60.0, every=1.0):
    end = time.time() + timeout
    while time.time() < end:
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for: {what}")


def operator(page):
    # A wrong token: 401, the form again, nothing else.
    page.goto(f"{BASE}/console/login")
    page.get_by_label("Console token").fill("not-a-token-at-all-0000")
    with page.expect_response(f"{BASE}/console/login") as r:
        page.get_by_role("button", name="Sign in").click()
    assert r.value.status == 401, r.value.status
    expect(page.get_by_role("alert")).to_contain_text("not accepted")
    shot(page, "login")

    sign_in(page, os.environ["OPERATOR_TOKEN"])

    # The overview's chart moves while events flow — without a reload.
    rate = page.locator("[data-figure=rate]").first
    line = page.locator("figure.chart polyline").first
    before = line.get_attribute("points")
    until("events/s above 0 on the overview", lambda: float(rate.inner_text()) > 0, timeout=60)
    until("the events/s chart to change", lambda: line.get_attribute("points") != before, timeout=30)
    shot(page, "overview")

    # A failed event found by its owner.
    page.get_by_role("link", name="Failed events").click()
    page.locator("input[name=owner]").fill("orders-team")
    page.get_by_role("button", name="Filter").click()
    table = page.locator("table.events")
    expect(table).to_contain_text(os.environ["POISON_ID"])
    expect(table).to_contain_text(os.environ["KEPT_ID"])
    expect(table).not_to_contain_text(os.environ["HOSTILE_ID"])
    shot(page, "failed")

    # Its payload (an operator sees it), then retry: it is published.
    page.get_by_role("link", name=os.environ["POISON_ID"]).click()
    expect(page.locator("pre.payload")).to_contain_text(os.environ["POISON_MARK"])
    shot(page, "event")
    page.get_by_role("link", name="Retry…").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Retry event?")
    page.get_by_role("button", name="Retry event").click()
    # Back on the event's page once the retry went through.
    expect(page).to_have_url(re.compile(r"done=retry$"))

    def published():
        page.reload(wait_until="load")
        state = page.locator("[data-state]")
        return state.count() == 1 and state.inner_text() == "published"

    until("the retried event to show as published", published, timeout=60)
    expect(page.locator("ul.history")).to_contain_text("retry")

    # The quarantined route: discard the event that broke it, then resume.
    page.get_by_role("link", name="Routes").click()
    risky = page.locator("tr[data-route=risky]")
    expect(risky).to_contain_text("quarantined")
    page.goto(event_url(os.environ["HOSTILE_ID"]))
    page.get_by_role("link", name="Discard…").click()
    page.get_by_role("button", name="Discard event").click()
    expect(page).to_have_url(re.compile(r"done=discard$"))
    expect(page.get_by_role("status")).to_contain_text("Discarded")
    expect(page.locator("[data-state]")).to_have_text("discarded")
    page.get_by_role("link", name="Routes").click()
    risky.get_by_role("link", name="Resume…").click()
    page.get_by_role("button", name="Resume route").click()
    expect(page.get_by_role("status")).to_contain_text("Route resumed")
    expect(page.locator("tr[data-route=risky]")).to_contain_text("flowing")
    shot(page, "routes")

    # A candidate plugin, uploaded, tried on the route's live events: the
    # differences side by side.
    page.get_by_role("link", name="Try a plugin").click()
    page.locator("select[name=route]").select_option("orders")
    page.set_input_files("input[name=wasm]", os.environ["CANDIDATE"])
    page.locator("textarea[name=config]").fill(os.environ["CANDIDATE_CONFIG"])
    page.locator("input[name=last]").fill("10")
    page.get_by_role("button", name="Try", exact=True).click()
    summary = page.locator("#summary")
    expect(summary).to_be_visible()
    tried = int(summary.get_attribute("data-tried"))
    different = int(summary.get_attribute("data-different"))
    assert tried == 10 and different > 0, f"tried {tried}, different {different}"
    first = page.locator("section.diff").first
    expect(first.locator(".sides")).to_contain_text("Active plugin")
    expect(first.locator(".sides")).to_contain_text("Candidate")
    shot(page, "try")

    # The running shadow of plugin p: its differing messages side by side,
    # then promote it.
    page.get_by_role("link", name="Routes").click()
    shadow = page.locator("section.shadow[data-route=orders]")

    def differing():
        page.reload(wait_until="load")
        d = shadow.locator("[data-differing]")
        return d.count() > 0 and int(d.get_attribute("data-differing")) > 0

    until("the shadow to answer some event differently", differing, timeout=60)
    first = shadow.locator("details.diff").first
    first.locator("summary").click()
    expect(first.locator(".sides")).to_contain_text("Candidate")
    shot(page, "shadow")
    shadow.get_by_role("link", name="Promote…").click()
    page.get_by_role("button", name="Promote", exact=True).click()
    expect(page.get_by_role("status")).to_contain_text("Promoted")

    # The configuration shows no secret.
    page.get_by_role("link", name="Configuration").click()
    expect(page.locator("pre.config")).to_contain_text("***")
    content = page.content()
    for t in ("OPERATOR_TOKEN", "VIEWER_TOKEN", "BILLING_TOKEN"):
        assert os.environ[t] not in content, f"{t} shown on the configuration page"
    shot(page, "config")
    sign_out(page)


def other_team(page):
    sign_in(page, os.environ["BILLING_TOKEN"])
    page.goto(f"{BASE}/console/failed")
    expect(page.get_by_role("heading", level=1)).to_have_text("Failed events")
    content = page.content()
    for t in ("KEPT_ID", "POISON_ID"):
        assert os.environ[t] not in content, f"team billing sees orders-team's event {t}"
    # The page and the requests behind it both refuse.
    r = page.goto(event_url(os.environ["KEPT_ID"]))
    assert r.status == 404, f"another team's event page answered {r.status}"
    assert os.environ["KEPT_MARK"] not in page.content()
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    for action in ("retry", "discard"):
        r = page.request.post(f"{event_url(os.environ['KEPT_ID'])}/{action}", form={"csrf": csrf})
        assert r.status == 404, f"another team's {action} answered {r.status}"
    page.goto(f"{BASE}/console/routes")
    expect(page.locator("tr[data-route=risky]")).to_have_count(1)
    expect(page.locator("tr[data-route=orders]")).to_have_count(0)
    sign_out(page)


def viewer(page):
    sign_in(page, os.environ["VIEWER_TOKEN"])
    r = page.goto(event_url(os.environ["KEPT_ID"]))
    assert r.status == 200, r.status
    expect(page.locator(".hidden-payload")).to_contain_text("Hidden")
    content = page.content()
    assert os.environ["KEPT_MARK"] not in content, "a viewer sees payload bytes"
    expect(page.get_by_role("link", name="Retry…")).to_have_count(0)
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    r = page.request.post(f"{event_url(os.environ['KEPT_ID'])}/retry", form={"csrf": csrf})
    assert r.status == 403, f"a viewer's retry answered {r.status}"
    shot(page, "viewer")
    sign_out(page)


def main():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                    args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(20_000)
        expect.set_options(timeout=20_000)
        for step in (operator, other_team, viewer):
            print(f"step: {step.__name__}", flush=True)
            try:
                step(page)
            except Exception:
                # What the browser showed when it failed, for the report.
                shot(page, "failure")
                with open(os.path.join(SHOTS, "failure.html"), "w") as f:
                    f.write(page.content())
                print(f"failed at {page.url}; page saved in {SHOTS}/failure.html", flush=True)
                raise
        # A narrow window: the pages still read (no horizontal scroll on the list).
        page.set_viewport_size({"width": 420, "height": 900})
        sign_in(page, os.environ["OPERATOR_TOKEN"])
        page.goto(f"{BASE}/console/failed")
        wide = page.evaluate("document.documentElement.scrollWidth > window.innerWidth + 4")
        assert not wide, "the failed-events page scrolls sideways at 420 px"
        shot(page, "narrow")
        browser.close()
    print("console browser test: all steps passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
