"""Record the README's animation: the Decode tab replaying a Medusa run, then a Race, captured in headless Chromium
and written as one looping GIF (assets/playground.gif) plus a still of each tab (assets/screenshot-*.png).

Usage: python scripts/record_gif.py   (needs the dev setup's Playwright and /usr/bin/chromium; about 2 minutes)
"""

from __future__ import annotations

import time
from pathlib import Path

from PIL import Image
from playwright.sync_api import expect, sync_playwright

from playground.ui import build_app, launch_options

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1280, "height": 860}
FRAME_S = 0.15
WIDTH = 800  # of the GIF, in pixels


def capture(page, seconds: float, until) -> list[Image.Image]:
    """Screenshots every FRAME_S for at most `seconds`, until `until()` holds."""
    frames, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        path = ASSETS / ".frame.png"
        page.screenshot(path=str(path))
        frames.append(Image.open(path).convert("RGB"))
        if until():
            break
        time.sleep(FRAME_S)
    (ASSETS / ".frame.png").unlink(missing_ok=True)
    return frames


def main() -> None:
    app = build_app()
    app.launch(prevent_thread_lock=True, quiet=True, **launch_options())
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless=new", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(app.local_url, wait_until="domcontentloaded")
        expect(page.get_by_role("button", name="Decode")).to_be_visible(timeout=60_000)
        page.get_by_text("Give three tips for staying focused while studying.").click()  # the Medusa example
        page.get_by_role("button", name="Decode").click()
        expect(page.locator("#pg-stats h3")).to_contain_text("x plain decoding", timeout=180_000)
        slider = page.locator("#pg-step input[type=range]")
        at_end = lambda: slider.input_value() == slider.get_attribute("max")  # noqa: E731
        expect(slider).not_to_have_value(slider.get_attribute("max"), timeout=10_000)  # the replay after measuring
        expect(slider).to_have_value(slider.get_attribute("max"), timeout=120_000)
        page.locator("#pg-generated").scroll_into_view_if_needed()
        page.get_by_role("button", name="▶ Play").click()  # from the first step, for the recording
        expect(slider).not_to_have_value(slider.get_attribute("max"), timeout=10_000)
        decode = capture(page, 30, at_end)
        decode += [decode[-1]] * 12  # hold the finished run
        page.screenshot(path=str(ASSETS / "screenshot-decode.png"))
        page.get_by_role("tab", name="Race").click()
        page.get_by_role("button", name="Race").click()
        expect(page.locator("#pg-race-status")).to_contain_text("replaying", timeout=300_000)
        page.locator("#pg-race").scroll_into_view_if_needed()
        status = page.locator("#pg-race-status")
        race = capture(page, 20, lambda: "replayed" in status.inner_text())
        race += [race[-1]] * 12
        page.screenshot(path=str(ASSETS / "screenshot-race.png"))
        browser.close()
    app.close()
    frames = [frame.resize((WIDTH, round(frame.height * WIDTH / frame.width))) for frame in decode + race]
    palette = [frame.quantize(colors=128, method=Image.Quantize.MEDIANCUT) for frame in frames]
    palette[0].save(ASSETS / "playground.gif", save_all=True, append_images=palette[1:], loop=0,
                    duration=int(FRAME_S * 1000), optimize=True)
    print(f"{len(frames)} frames -> {ASSETS / 'playground.gif'} "
          f"({(ASSETS / 'playground.gif').stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
