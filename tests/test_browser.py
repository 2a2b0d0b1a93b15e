"""The web app in a real browser (Playwright driving Debian's Chromium, which .ci/run installs): a decode turns
into coloured tokens under the legend, an uploaded trace replays, a race fills every lane and the memory tab
draws the block map. Screenshots go to bench_results/ui/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

from playground.ui import build_app, launch_options
from playground.viz import STATES

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parent.parent / "bench_results" / "ui"
WIDE, PHONE = {"width": 1440, "height": 900}, {"width": 390, "height": 844}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def page(target, tmp_path_factory):
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium), as .ci/run does")
    app = build_app()
    app.launch(prevent_thread_lock=True, quiet=True, **launch_options())
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, args=FLAGS,
                                                        viewport=WIDE)
        tab = browser.new_page()
        tab.requested = []  # every URL the page asked for
        tab.on("request", lambda request: tab.requested.append(request.url))
        tab.goto(app.local_url)
        yield tab
        browser.close()
    app.close()


def settled(page, slider) -> int:
    """The slider's value once it has stopped moving (the same on two reads a second apart)."""
    before = int(slider.input_value())
    for _ in range(20):
        page.wait_for_timeout(1000)
        now = int(slider.input_value())
        if now == before:
            return now
        before = now
    raise AssertionError("the slider kept moving after Pause")


def replayed(page, slider) -> int:
    """The last step, once the replay that follows a run has played to it: the slider stands at the last step when
    the run ends, then the replay rewinds it to step 0 (missed here if it was over within 5 s) and plays on."""
    last = slider.get_attribute("max")
    try:
        expect(slider).not_to_have_value(last, timeout=5_000)
    except AssertionError:
        pass  # the replay was over before the check (or a frame went unseen): it ends on the last step either way
    expect(slider).to_have_value(last, timeout=120_000)
    assert settled(page, slider) == int(last)
    return int(last)


def shoot(page, name: str) -> None:
    """Full-page screenshots at both viewports; no element may be wider than a phone's screen."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
    page.set_viewport_size(PHONE)
    page.wait_for_timeout(500)
    page.screenshot(path=str(SHOTS / f"{name}-phone.png"), full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"] + 1
    page.set_viewport_size(WIDE)


def test_the_page_fetches_nothing_from_elsewhere(page):
    """Fonts and scripts come from the app itself: offline (or on a Space) nothing fails to load."""
    expect(page.get_by_role("button", name="Decode")).to_be_visible(timeout=60_000)
    page.wait_for_timeout(3000)  # fonts and late scripts
    local = page.url.split("/?")[0].rstrip("/")
    away = [url for url in page.requested if not url.startswith((local, "data:", "blob:"))]
    assert not away, away[:5]


def test_parameters_follow_the_chosen_algorithm(page):
    page.get_by_text("Algorithm parameters").click()
    page.get_by_label("lookahead").first.check()
    expect(page.get_by_label("window W (1..16)")).to_be_visible()
    expect(page.get_by_label("gamma (most draft tokens, 1..16)")).to_be_hidden()
    page.get_by_label("Medusa (tree)").first.check()
    expect(page.get_by_label("Medusa tree")).to_be_visible()
    expect(page.get_by_label("window W (1..16)")).to_be_hidden()
    page.get_by_label("prompt lookup").first.check()  # the other tests' algorithm
    page.get_by_text("Algorithm parameters").click()


def test_stop_ends_a_run_and_frees_the_queue(page):
    page.get_by_text("Sampling").first.click()
    page.get_by_label("max new tokens (1..4096)").fill("2000")
    page.get_by_label("Prompt", exact=True).fill("Count from 1 to 2000, one number per line.")  # a long answer
    decode = page.get_by_role("button", name="Decode")
    decode.click()
    expect(page.locator("#pg-stats")).to_contain_text("measuring run", timeout=120_000)
    expect(decode).to_be_disabled()  # a second click cannot be silently ignored: there is none to make
    stop = page.get_by_role("button", name="Stop").first
    stop.click()
    expect(decode).to_be_enabled(timeout=10_000)
    expect(page.locator("#pg-stats")).to_contain_text("stopped: nothing measured is shown")
    expect(stop).to_have_text("Stop")  # "Stopping…" while the run ended, then idle again
    expect(stop).to_be_enabled()
    status = page.locator("#pg-stats").inner_text()
    page.wait_for_timeout(3000)
    assert page.locator("#pg-stats").inner_text() == status and stop.inner_text() == "Stop"  # nothing more arrives
    page.get_by_label("max new tokens (1..4096)").fill("64")
    page.get_by_text("Sampling").first.click()


def test_one_bad_field_is_one_message(page):
    page.get_by_text("Sampling").first.click()
    page.get_by_label("max new tokens (1..4096)").fill("0")
    page.get_by_role("button", name="Decode").click()
    # in the words the form uses, not the code's field name
    expect(page.get_by_text("max new tokens must be").first).to_be_visible(timeout=30_000)
    # the error is told once, in a toast and the stats line's own text: no "Error" badge over that text (it once
    # covered the message's middle), and none on any other output
    expect(page.locator("#pg-stats p")).to_contain_text("not run: max new tokens must be an integer in [1, 4096]")
    expect(page.locator("#pg-stats .error")).to_be_hidden()
    assert page.locator(".error:not([class*=toast]):visible").count() == 0
    expect(page.get_by_role("button", name="Decode")).to_be_enabled()
    page.locator(".toast-close").first.click()
    page.get_by_label("max new tokens (1..4096)").fill("64")
    page.get_by_text("Sampling").first.click()


def test_on_a_phone_the_legend_tells_its_meanings_without_hover(page):
    page.set_viewport_size(PHONE)
    meanings = page.locator("#pg-legend .pg-legend-meanings")
    expect(meanings.locator("li").first).to_be_hidden()
    meanings.locator("summary").click()
    for state in STATES.values():
        expect(meanings).to_contain_text(f"{state.label}: {state.meaning}")
    expect(meanings.locator("li").first).to_be_visible()
    meanings.locator("summary").click()
    page.set_viewport_size(WIDE)


def test_a_trace_over_the_cap_is_refused_at_once(page, tmp_path):
    """A file over the upload cap never reaches the app's queue: the browser is told at once."""
    from playground.trace import MAX_TRACE_BYTES

    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (MAX_TRACE_BYTES + 1))
    page.locator("#pg-upload input[type=file]").set_input_files(str(huge))
    expect(page.get_by_text("exceed the maximum allowed size").first).to_be_visible(timeout=10_000)
    page.locator(".toast-close").first.click()
    expect(page.get_by_role("button", name="Decode")).to_be_enabled()


def test_decode_shows_coloured_tokens_and_the_legend(page):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.get_by_label("Prompt", exact=True).fill("Repeat exactly: red green blue, red green blue, red green blue.")
    page.get_by_role("button", name="Decode").click()
    expect(page.locator("#pg-stats")).to_contain_text("tok/s", timeout=120_000)
    expect(page.locator("#pg-stats h3")).to_contain_text("x plain decoding (median of 3 rounds)")
    # the measured run replays by itself and ends on its last step (a step the replay holds for over a second, on a
    # busy machine, would look settled before its end)
    slider = page.locator("#pg-step input[type=range]")
    last = str(replayed(page, slider))
    tokens = page.locator("#pg-generated .pg-tok")
    assert tokens.count() > 3
    assert page.locator("#pg-generated .pg-accepted").count() > 0
    legend = page.locator("#pg-legend")
    for state in STATES.values():
        expect(legend).to_contain_text(state.label)
    # the accepted colour really reaches the page (the stylesheet is applied, not just the class names)
    colour = page.locator("#pg-generated .pg-accepted").first.evaluate("e => getComputedStyle(e).color")
    assert colour == "rgb(0, 122, 90)"
    # a long answer scrolls inside its panel instead of spilling over the stats line below it, held at its end, where
    # the latest step is
    generated = page.locator("#pg-generated")
    scroller = generated.locator(".pg-scroll")
    assert scroller.evaluate("e => getComputedStyle(e).overflowY") == "auto"
    box = scroller.bounding_box()
    end = generated.locator(".pg-tokens .pg-tok:not(.pg-past)").last.bounding_box()
    assert box["y"] <= end["y"] and end["y"] + end["height"] <= box["y"] + box["height"] + 1, (box, end)
    assert generated.bounding_box()["y"] + generated.bounding_box()["height"] <= page.locator(
        "#pg-stats").bounding_box()["y"]
    # above the fold at 1440x900: the text, the headline and the player (the templated prompt scrolls in its box)
    page.evaluate("window.scrollTo(0, 0)")
    play = page.get_by_role("button", name="▶ Play").bounding_box()
    headline = page.locator("#pg-stats h3").bounding_box()
    assert max(play["y"] + play["height"], headline["y"] + headline["height"]) <= WIDE["height"], (play, headline)
    # the clean view shows the text alone, and switches back
    page.get_by_label("clean text").check()
    expect(page.locator("#pg-generated .pg-clean")).to_be_visible()
    expect(page.locator("#pg-generated .pg-tokens")).to_be_hidden()
    text = page.locator("#pg-generated .pg-clean").inner_text()
    assert text.strip() and "↵" not in text
    page.get_by_label("annotated").check()
    expect(page.locator("#pg-generated .pg-tokens")).to_be_visible()
    expect(page.locator("#pg-generated .pg-clean")).to_be_hidden()
    # the annotated text reads as text: earlier steps' refused guesses are out of the line until asked for
    past = page.locator("#pg-generated .pg-past")
    if past.count():
        expect(past.first).to_be_hidden()
        page.get_by_label("+ refused guesses").check()
        expect(past.first).to_be_visible()
        page.get_by_label("annotated").check()
        expect(past.first).to_be_hidden()
    for plot in ("#pg-steps-plot", "#pg-time-plot"):  # the run's charts are drawn, not left as placeholders
        expect(page.locator(f"{plot} .js-plotly-plot")).to_be_visible(timeout=30_000)
    # the player: play from the start (slowly, so the pause lands mid-run), pause, a step back shows fewer tokens,
    # a step forward more
    page.locator("#pg-speed input").click()
    page.get_by_role("option", name="1/30x").click()
    page.get_by_role("button", name="▶ Play").click()
    expect(slider).not_to_have_value(last, timeout=10_000)
    page.get_by_role("button", name="Pause").click()
    paused = settled(page, slider)  # a frame already on its way may still land
    assert paused < int(last)
    page.wait_for_timeout(1500)
    assert int(slider.input_value()) == paused  # paused means paused
    page.get_by_role("button", name="Step ▶").click()
    expect(slider).to_have_value(str(paused + 1), timeout=10_000)
    more = tokens.count()
    page.get_by_role("button", name="◀ Step").click()
    expect(slider).to_have_value(str(paused), timeout=10_000)
    assert tokens.count() < more
    shoot(page, "decode")


def test_uploaded_trace_replays(page, tmp_path):
    with page.expect_download() as download:
        page.locator("a[download]").first.click()
    trace = tmp_path / "trace.json"
    download.value.save_as(trace)
    page.reload()
    expect(page.locator("#pg-legend")).to_contain_text("accepted", timeout=30_000)
    page.locator("#pg-upload input[type=file]").set_input_files(str(trace))
    expect(page.locator("#pg-stats")).to_contain_text("replayed trace of", timeout=60_000)
    assert page.locator("#pg-generated .pg-tok").count() > 3
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1}')
    page.locator("#pg-upload button[aria-label='Clear']").click()
    page.locator("#pg-upload input[type=file]").set_input_files(str(bad))
    expect(page.get_by_text("trace file is not a valid trace").first).to_be_visible(timeout=30_000)
    page.screenshot(path=str(SHOTS / "replay-error.png"), full_page=True)
    # a step number far beyond the trace's events: refused in one line, where Play once sized a list by it
    far = json.loads(trace.read_text())
    far["events"][-2]["step"] = 10**9
    bad.write_text(json.dumps(far))
    page.locator("#pg-upload button[aria-label='Clear']").click()
    page.locator("#pg-upload input[type=file]").set_input_files(str(bad))
    expect(page.get_by_text("got 1000000000").first).to_be_visible(timeout=30_000)
    page.get_by_role("button", name="▶ Play").click()  # the earlier valid replay still plays
    expect(page.locator("#pg-stats")).to_contain_text("replayed trace of", timeout=10_000)


@pytest.mark.parametrize("algo, structure", [("Medusa (tree)", ".pg-tree"), ("EAGLE (tree)", ".pg-tree"),
                                             ("lookahead", "table")])
def test_as_set_shows_proposals_drafted_and_judged_on_this_machines_costs(page, unpinned, algo, structure):
    """With the forward costs this machine measures (not the tests' fixed curve), the Decode tab's default plan
    ("as-set") verifies what the algorithm proposes, whatever the CPU's price of a wide forward: the replay shows
    drafted tokens kept, and the step detail a proposal in most steps with its structure: Medusa's and EAGLE's
    trees (beyond a chain with runners-up), lookahead's Jacobi window every step and a verified n-gram in some."""
    page.reload()  # no earlier run's stats on the page
    expect(page.locator("#pg-legend")).to_contain_text("accepted", timeout=30_000)
    page.get_by_label(algo, exact=True).first.check()
    page.get_by_label("Prompt", exact=True).fill("List five fruits that are rich in vitamin C.")
    page.get_by_role("button", name="Decode").click()
    expect(page.locator("#pg-stats")).to_contain_text("tok/s", timeout=180_000)
    last = replayed(page, page.locator("#pg-step input[type=range]"))
    assert page.locator("#pg-generated .pg-accepted").count() > 0  # drafted tokens the target kept
    detail = page.locator("#pg-step-detail")
    visited, proposing, shown, verified = 0, 0, 0, 0
    for step in range(last, max(last - 12, 0), -1):  # the last dozen steps, one step back at a time
        expect(detail).to_contain_text(f"step {step}:", timeout=10_000)
        visited += 1
        proposing += "nothing proposed" not in detail.inner_text()
        shown += detail.locator(structure).count() > 0
        verified += detail.locator(".pg-verified").count() > 0
        page.get_by_role("button", name="◀ Step").click()
    if structure == "table":  # lookahead proposes where its pools hold a guess for the text so far
        # every step shows its window, but the last may have one token left to write and so no window
        assert proposing >= visited // 2 and shown >= visited - 1 and verified >= 2, (visited, proposing, verified)
    else:
        assert proposing >= visited - 2 and shown >= 2, (visited, proposing, shown)
    page.reload()  # the other tests' algorithm and state


def test_race_replays_every_lane_and_fills_the_table(page):
    page.reload()
    page.get_by_role("tab", name="Race").click()
    page.get_by_label("max new tokens (1..4096)").last.fill("24")
    page.get_by_role("button", name="Race").click()
    expect(page.locator("#pg-race-status")).to_contain_text("replayed", timeout=180_000)
    assert page.locator("#pg-race .pg-lane-done").count() == 5
    assert page.locator("#pg-race .pg-tok").count() > 10
    expect(page.locator("#pg-race-table")).to_contain_text("same tokens as plain")
    expect(page.locator("#pg-race-plot .js-plotly-plot")).to_be_visible(timeout=30_000)
    expect(page.locator("#pg-race-table")).to_contain_text("check")
    assert page.locator("#pg-race .pg-lane-why").count() == 4
    shoot(page, "race")


def test_memory_tab_draws_the_block_map(page):
    page.get_by_role("tab", name="Memory").click()
    page.get_by_label("max new tokens (1..4096; output limits cycle below it)").fill("24")
    page.get_by_role("button", name="Serve").click()
    expect(page.locator("#pg-memory-status")).to_contain_text("Waste over the run", timeout=180_000)
    assert page.locator("#pg-block-map .pg-block").count() == 40
    assert page.locator("#pg-block-map .pg-block-shared").count() > 0  # the chat template's shared prefix
    expect(page.locator("#pg-memory-plot .js-plotly-plot")).to_be_visible(timeout=30_000)
    shoot(page, "memory")
    page.set_viewport_size(PHONE)  # on a phone: the table's columns keep their width (it scrolls sideways) ...
    widths = page.locator("#pg-memory-table th").evaluate_all("cells => cells.map(c => c.offsetWidth)")
    assert len(widths) == 6 and min(widths) >= 70, widths
    page.evaluate("window.scrollTo(0, 0)")  # ... and a run button brings the run's output into view
    status = page.locator("#pg-memory-status")
    before = status.inner_text()
    page.get_by_role("button", name="Serve").click()
    expect(status).to_be_in_viewport(timeout=10_000)
    expect(status).not_to_have_text(before, timeout=10_000)  # the new run's first frame
    expect(page.get_by_role("button", name="Serve")).to_be_enabled(timeout=180_000)  # and its end
    page.set_viewport_size(WIDE)
    page.get_by_role("tab", name="Theory").click()
    expect(page.locator("#pg-theory-plot .js-plotly-plot")).to_be_visible(timeout=30_000)
    shoot(page, "theory")


PAGE = """<!doctype html><title>elsewhere</title><script>
async function attempts(url) {
  const body = '{"prompt": "The capital of France is", "max_tokens": 2}';
  const sent = [];
  for (const init of [{body: new Blob([body])}, {body: body, headers: {"Content-Type": "text/plain"}}]) {
    try { await fetch(url, {method: "POST", mode: "no-cors", ...init}); sent.push("sent"); }
    catch (e) { sent.push("failed"); }
  }
  try {
    const reply = await fetch(url, {method: "POST", body: body, headers: {"Content-Type": "application/json"}});
    sent.push(String(reply.status) + " " + (await reply.json()).object);
  } catch (e) { sent.push("unreadable"); }
  return sent;
}
</script>"""


@pytest.mark.parametrize("allowed", [False, True])
def test_a_web_page_elsewhere_cannot_use_the_server_unless_allowed(page, target, tmp_path, allowed):
    """A page of another origin in Chromium posts to the server as any page may without asking: a body with no
    type, then text/plain (no CORS preflight for either), then JSON (preflighted). Refused, all three (403), and
    nothing generated, unless the server names the page's origin in --allowed-origins: then only JSON is served
    and the page reads the answer."""
    import functools
    import http.server
    import threading

    from .test_server import get, running
    from .test_server_hardening import PARAMS

    (tmp_path / "index.html").write_text(PAGE)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{site.server_address[1]}"
    try:
        with running(target, PARAMS, allowed_origins=(origin,) if allowed else ()) as service:
            tab = page.context.new_page()  # a tab of the module's Chromium, beside the app's
            statuses = []
            tab.on("response", lambda r: statuses.append(r.status) if "/v1/" in r.url else None)
            tab.goto(origin + "/index.html")
            sent = tab.evaluate("url => attempts(url)", service.url + "/v1/completions")
            tab.close()
            finished = get(service, "/v1/engine")[1]["finished"]
    finally:
        site.shutdown()
    if allowed:
        assert sent == ["sent", "sent", "200 text_completion"] and finished == 1, (sent, statuses)
        assert statuses.count(415) == 2 and 200 in statuses, statuses
    else:
        assert sent[2] == "unreadable" and finished == 0, (sent, statuses)
        assert statuses.count(403) >= 2 and 200 not in statuses, statuses
