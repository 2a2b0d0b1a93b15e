"""Record what a visitor sees, on this machine's own forward costs: a still of every tab after a run at 1440x900 and
at 390x844 (assets/screens/TAB-wide.png, TAB-phone.png, shown in docs/app.md), and the README's animation
(assets/playground.gif): the Decode tab replaying a Medusa run as set, each step's tree drafted, then judged.

Usage: python scripts/record_app.py [--only gif|screens]
(needs the dev setup's Playwright and /usr/bin/chromium; about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright

from playground.ui import build_app, launch_options

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SCREENS = ASSETS / "screens"
CHROMIUM = "/usr/bin/chromium"
VIEWPORTS = {"wide": {"width": 1440, "height": 900}, "phone": {"width": 390, "height": 844}}
GIF_VIEWPORT = {"width": 1440, "height": 1400}  # tall enough for the text, the player and the step's tree at once
GIF_SPEED = "1/10x"  # slow enough that every step's two beats (the tree drafted, then judged) are captured
TREE_PX = 260  # of the step detail shown under the stats: a tree of the dynamic size
GIF_TOKENS = 40
GIF_WIDTH = 720  # of the GIF, in pixels
GIF_COLOURS = 64  # text on flat colours: few are needed
HOLD_MS = 3000  # the finished run stays this long before the GIF loops
# the GIF's parts of the Decode output column, in viewport pixels: the legend; the generated text with the player;
# the top TREE_PX of the step detail (the tree)
BANDS_JS = f"""() => {{
  const box = (id) => document.getElementById(id).getBoundingClientRect();
  const legend = box('pg-legend'), text = box('pg-generated'), player = box('pg-player'), tree = box('pg-step-detail');
  return {{columns: [legend.left - 8, tree.right + 8],
           rows: [[legend.top - 8, legend.bottom], [text.top - 8, player.bottom + 8],
                  [tree.top - 8, tree.top + {TREE_PX}]]}};
}}"""
MEDUSA_EXAMPLE = "Give three tips for staying focused while studying."
TIMEOUT_MS = 300_000


def small_png(path: Path) -> None:
    """Rewrite a screenshot with a 256-colour palette: a quarter of the bytes, the same to the eye."""
    Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def wait_for_replay(page: Page) -> None:
    """Until the replay that follows a Decode run has played to the last step: the slider stands at the last step
    when the run ends, the replay rewinds it to step 0, then plays it back to the end."""
    slider = page.locator("#pg-step input[type=range]")
    expect(page.locator("#pg-stats h3")).to_contain_text("x plain decoding", timeout=TIMEOUT_MS)
    last = slider.get_attribute("max")
    expect(slider).not_to_have_value(last, timeout=10_000)
    expect(slider).to_have_value(last, timeout=TIMEOUT_MS)


def screens(app_url: str, browser) -> None:
    """Every tab after its run, as a visitor's screen shows it (a phone scrolls itself to the run's output)."""
    SCREENS.mkdir(exist_ok=True)
    for size, viewport in VIEWPORTS.items():
        page = browser.new_page(viewport=viewport)
        page.goto(app_url, wait_until="domcontentloaded")
        expect(page.get_by_role("button", name="Decode")).to_be_visible(timeout=60_000)
        shots = []

        def shot(tab: str, top: bool) -> None:
            if top:
                page.evaluate("window.scrollTo(0, 0)")
            page.wait_for_timeout(500)
            path = SCREENS / f"{tab}-{size}.png"
            page.screenshot(path=str(path))
            shots.append(path)

        page.get_by_text(MEDUSA_EXAMPLE).click()
        page.get_by_role("button", name="Decode").click()
        wait_for_replay(page)
        shot("decode", size == "wide")
        page.get_by_role("tab", name="Race").click()
        page.get_by_label("max new tokens (1..4096)").last.fill("32")
        page.get_by_role("button", name="Race").click()
        expect(page.locator("#pg-race-status")).to_contain_text("replayed", timeout=TIMEOUT_MS)
        shot("race", size == "wide")
        page.get_by_role("tab", name="Memory").click()
        page.get_by_role("button", name="Serve").click()
        expect(page.locator("#pg-memory-status")).to_contain_text("Waste over the run", timeout=TIMEOUT_MS)
        shot("memory", size == "wide")
        page.get_by_role("tab", name="Theory").click()
        plot = page.locator("#pg-theory-plot")
        expect(plot.locator(".js-plotly-plot")).to_be_visible(timeout=30_000)
        if size == "phone":
            plot.scroll_into_view_if_needed()
        shot("theory", size == "wide")
        page.close()
        for path in shots:
            small_png(path)
            print(f"{path.relative_to(ASSETS.parent)} ({path.stat().st_size / 1e3:.0f} kB)")


def gif(app_url: str, browser) -> None:
    """The Decode tab while a Medusa run as set replays, each frame three parts of its output column stacked: the
    legend, the generated text with the player, and the step's tree (drafted, then judged), at the pace it played."""
    page = browser.new_page(viewport=GIF_VIEWPORT)
    page.goto(app_url, wait_until="domcontentloaded")
    expect(page.get_by_role("button", name="Decode")).to_be_visible(timeout=60_000)
    page.get_by_text(MEDUSA_EXAMPLE).click()
    page.get_by_text("Sampling", exact=True).first.click()
    page.get_by_label("max new tokens (1..4096)").first.fill(str(GIF_TOKENS))
    page.get_by_role("button", name="Decode").click()
    wait_for_replay(page)
    page.locator("#pg-speed input").click()
    page.get_by_role("option", name=GIF_SPEED).click()
    page.evaluate("window.scrollBy(0, document.getElementById('pg-legend').getBoundingClientRect().top - 8)")
    slider = page.locator("#pg-step input[type=range]")
    last = slider.get_attribute("max")
    page.get_by_role("button", name="▶ Play").click()  # from the first step
    expect(slider).not_to_have_value(last, timeout=10_000)
    shots, times = [], []
    while True:  # as fast as the browser draws, so that every step's two beats are caught
        bands = page.evaluate(BANDS_JS)  # where the parts are now: the text grows, the stats above the tree change
        shots.append((page.screenshot(), bands))
        times.append(time.monotonic())
        if slider.input_value() == last:
            break
    page.close()
    frames = [stacked(Image.open(io.BytesIO(shot)).convert("RGB"), bands) for shot, bands in shots]
    height = max(f.height for f in frames)
    frames = [padded(f, height) for f in frames]
    durations = [round(1000 * (b - a)) for a, b in zip(times, times[1:])] + [HOLD_MS]  # as it played
    small = [f.resize((GIF_WIDTH, round(f.height * GIF_WIDTH / f.width)), Image.Resampling.LANCZOS) for f in frames]
    palette = [f.quantize(colors=GIF_COLOURS, method=Image.Quantize.MEDIANCUT) for f in small]
    out = ASSETS / "playground.gif"
    palette[0].save(out, save_all=True, append_images=palette[1:], loop=0, duration=durations, optimize=True)
    print(f"{len(frames)} frames -> {out.relative_to(ASSETS.parent)} ({out.stat().st_size / 1e6:.1f} MB)")


def stacked(shot: Image.Image, bands: dict[str, list[float]]) -> Image.Image:
    """The bands of a screenshot (`BANDS_JS`), one under the other."""
    left, right = bands["columns"]
    parts = [shot.crop((round(left), round(top), round(right), round(bottom))) for top, bottom in bands["rows"]]
    out = Image.new("RGB", (parts[0].width, sum(p.height for p in parts)), "white")
    y = 0
    for band in parts:
        out.paste(band, (0, y))
        y += band.height
    return out


def padded(frame: Image.Image, height: int) -> Image.Image:
    """The frame on a white canvas `height` tall: frames differ in height as the text grows."""
    out = Image.new("RGB", (frame.width, height), "white")
    out.paste(frame, (0, 0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["gif", "screens"], help="record one of the two (default: both)")
    args = parser.parse_args()
    app = build_app()
    app.launch(prevent_thread_lock=True, quiet=True, **launch_options())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless=new", "--no-sandbox", "--disable-gpu"])
        if args.only != "gif":
            screens(app.local_url, browser)
        if args.only != "screens":
            gif(app.local_url, browser)
        browser.close()
    app.close()


if __name__ == "__main__":
    main()
