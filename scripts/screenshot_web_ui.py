"""Take the README's screenshot of the web UI (docs/web_ui.png): a real server on the default
model, a few API requests sharing a system prompt (so the cache view has a tree), and one chat
message sent through the page. Needs chromium and chromedriver (scripts/test.sh installs them).

Run: python scripts/screenshot_web_ui.py [--out docs/web_ui.png]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from browser_fixtures import wait_for  # noqa: E402
from server_fixtures import ServerProcess  # noqa: E402

SYSTEM = "You are a concise assistant for a bicycle shop. Answer in one or two sentences."
QUESTIONS = ["How often should I oil my chain?", "What tyre pressure suits a city bike?",
             "How do I fix a puncture?"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/web_ui.png")
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    server = ServerProcess()
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1400,900", "--disable-gpu"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        chrome.get(server.url + "/")
        wait_for(lambda: chrome.find_element(By.ID, "hit-rate").text.endswith("%"))
        for question in QUESTIONS:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            body = {"model": "default", "messages": messages, "max_tokens": 40, "temperature": 0}
            requests.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            time.sleep(2)
        chrome.find_element(By.ID, "system").send_keys(SYSTEM)
        chrome.find_element(By.ID, "prompt").send_keys("Which lock should I buy for my bike?")
        chrome.find_element(By.ID, "send").click()
        wait_for(lambda: "tokens/s" in chrome.find_element(By.CSS_SELECTOR, ".stats").text, 120)
        time.sleep(3)  # a poll after the answer: the tree shows it, the charts move
        chrome.save_screenshot(args.out)
        print(f"wrote {args.out}")
    finally:
        chrome.quit()
        server.stop()


if __name__ == "__main__":
    main()
