"""Driving Debian's headless Chromium with selenium, for the dashboard tests
(a helper module, not a test module)."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@contextmanager
def chromium(width: int = 1500, height: int = 900) -> Iterator[Any]:
    """A headless Chromium whose window is ``width`` x ``height`` px."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


async def in_page(driver: Any, fn: Callable[[Any], Any]) -> Any:
    """Run a (blocking) selenium call in a thread."""
    return await trio.to_thread.run_sync(fn, driver)


async def page_until(driver: Any, script: str, within: float = 15.0, what: str = "") -> Any:
    """Poll a JavaScript expression in the page until it is truthy."""
    with trio.move_on_after(within):
        while True:
            r = await in_page(driver, lambda d: d.execute_script("return " + script))
            if r:
                return r
            await trio.sleep(0.05)
    raise AssertionError(f"timed out waiting for the page to show {what or script}")


def http(
    url: str, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """(status, body) of a GET (or a POST with ``data``)."""
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


#: JavaScript: every cell, button, link and input of the visible sections
#: that sticks out of its section (or the section out of the window), as
#: text lines; [] when nothing is cut off.
OVERFLOWS = r"""
const out = [];
const vw = document.documentElement.clientWidth;
for (const sec of document.querySelectorAll("main:not([hidden]) section")) {
  if (sec.offsetParent === null) continue;
  const s = sec.getBoundingClientRect();
  const name = "section " + (sec.querySelector("h2")?.innerText || "");
  if (s.right > vw + 0.5 || s.left < -0.5) out.push(`${name} ${s.left}..${s.right} > ${vw}`);
  if (sec.scrollWidth > sec.clientWidth + 1) {
    out.push(`${name} scrolls: ${sec.scrollWidth} > ${sec.clientWidth}`);
  }
  for (const el of sec.querySelectorAll("th, td, button, input, svg, pre, a")) {
    if (el.offsetParent === null) continue;
    const r = el.getBoundingClientRect();
    if (r.right > s.right + 0.5 || r.left < s.left - 0.5) {
      const what = JSON.stringify(el.innerText || el.id || "").slice(0, 40);
      out.push(`${el.tagName} ${what} ${r.left}..${r.right} outside ${s.left}..${s.right}`);
    }
  }
}
return out;
"""
