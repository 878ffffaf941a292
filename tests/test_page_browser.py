"""The page of `mmadapt serve --ui` in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`,
driven by selenium) against the page served on 127.0.0.1 over a model `mmadapt demo` trained on handwritten digits.

A person's path through it: upload a held-out digit, ask, read the answer (equal to `mmadapt chat`'s, greedy), ask
about another, read the model card; open Evidence and map an answer (the map image appears with the verdict in
words); pick an example, then paste an image (two turns equal to `mmadapt chat`'s on stdin); upload a file that is
not an image and a decompression bomb (each a message in the page), then ask again and get the answer. The chat,
the evidence view and the model card are photographed at 1280 x 800: into MMADAPT_SCREENSHOTS when it names a
directory (`MMADAPT_SCREENSHOTS=docs pytest tests/test_page_browser.py` renews docs/page_*.png), else into the
test's temporary directory. Without a browser the tests are skipped, except where MMADAPT_REQUIRE_BROWSER=1 (CI
sets it): there they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_page import png_bomb

pytest.importorskip("gradio")
webdriver = pytest.importorskip("selenium.webdriver")

from selenium.common.exceptions import WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402

from mmadapt.cli import main  # noqa: E402
from mmadapt.serve import BackgroundServer  # noqa: E402

pytestmark = pytest.mark.slow
QUESTION = "What digit is this?"
WIDTH, HEIGHT = 1280, 800


def no_browser(reason: str) -> None:
    """Fail where a browser is required (CI), else skip saying why."""
    if os.environ.get("MMADAPT_REQUIRE_BROWSER") == "1":
        pytest.fail(f"the browser tests need Chromium: {reason} (MMADAPT_REQUIRE_BROWSER=1)")
    pytest.skip(f"no browser: {reason}; install Debian's chromium and chromium-driver to run the page's tests")


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        no_browser("chromium or chromedriver is not on PATH")
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(argument)
    options.binary_location = chromium
    try:  # the driver given: selenium downloads nothing
        chrome = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=options)
    except WebDriverException as e:
        no_browser(f"Chromium did not start: {e.msg}")
    chrome.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",  # the viewport itself, whatever the window adds
                           {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False})
    yield chrome
    chrome.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`mmadapt demo` (150 steps on 48 px digits: 3 x 3 visual tokens; held-out accuracy 0.87 with the images, 0.10
    blanked), served as `mmadapt serve OUT --ui` serves it (the command's own code, up to uvicorn's loop: the app it
    builds is run on a thread here)."""
    import mmadapt.serve
    from mmadapt.demo import run_demo

    out = tmp_path_factory.mktemp("page_browser") / "digits"
    run_demo(out=out, steps=150, image_size=48, progress=False)
    built = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mmadapt.serve, "run", lambda app, **where: built.append((app, where)))
        assert main(["serve", str(out), "--ui", "--port", "0"]) == 0
    (app, where), = built
    assert where["host"] == "127.0.0.1"
    records = [json.loads(line) for line in (out / "data" / "eval.jsonl").read_text().splitlines()]
    with BackgroundServer(app) as server:
        yield SimpleNamespace(url=f"{server.url}/ui/", out=out, images=[out / "data" / r["image"] for r in records])


def shots(tmp_path: Path) -> Path:
    target = os.environ.get("MMADAPT_SCREENSHOTS")
    return Path(target) if target else tmp_path


def until(what: str, check: Callable[[], Any], timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"the page did not show {what} within {timeout} s")


def open_page(browser: Any, served: SimpleNamespace) -> None:
    browser.get(served.url)  # a new page load: a new session, an empty conversation
    until("the chat box", lambda: browser.find_elements(By.CSS_SELECTOR, "#ask textarea"))


def attach(browser: Any, path: Path) -> None:
    upload = browser.find_element(By.CSS_SELECTOR, "#ask input[type=file]")
    browser.execute_script("arguments[0].value = ''", upload)  # chromedriver adds to what the input already holds
    upload.send_keys(str(path))
    until(f"{path.name} attached",
          lambda: path.name in browser.find_element(By.CSS_SELECTOR, "#ask").get_attribute("innerHTML"))


def ask(browser: Any, text: str | None = QUESTION) -> None:
    box = browser.find_element(By.CSS_SELECTOR, "#ask textarea")
    if text is not None:
        box.clear()
        box.send_keys(text)
    box.send_keys(Keys.ENTER)


def answers(browser: Any) -> list[str]:
    return [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#chatbot [data-testid=bot]")]


def answered(browser: Any, count: int) -> str:
    """The text of the `count`-th answer, once the page says how it ended."""
    until(f"answer {count}", lambda: len(answers(browser)) >= count and "tokens" in browser.find_element(
        By.CSS_SELECTOR, "#finish").text)
    return answers(browser)[count - 1]


def mmadapt_chat(served: SimpleNamespace, image: Path, capsys: Any) -> str:
    capsys.readouterr()
    assert main(["chat", str(served.out), "--image", str(image), QUESTION]) == 0
    return capsys.readouterr().out.rstrip("\n")


def photograph(browser: Any, path: Path) -> None:
    """A screenshot of the viewport, once the status line has caught up (it polls every 2 s)."""
    until("the model idle", lambda: "idle" in browser.find_element(By.CSS_SELECTOR, "#status").text)
    time.sleep(2.5)  # one more tick of the status line: its counts include the answer just given
    browser.save_screenshot(str(path))


def toasts(browser: Any) -> list[str]:
    return [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".toast-body")]


def test_the_pages_answer_is_mmadapt_chats_answer(browser, served, capsys, tmp_path):
    open_page(browser, served)
    image = served.images[0]
    attach(browser, image)
    ask(browser)
    answer = answered(browser, 1)
    assert answer == mmadapt_chat(served, image, capsys) and answer.isdigit()
    assert QUESTION in [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#chatbot [data-testid=user]")]
    photograph(browser, shots(tmp_path) / "page_chat.png")

    attach(browser, served.images[1])  # a second turn, about another digit
    ask(browser)
    assert answered(browser, 2).isdigit() and not toasts(browser)

    next(tab for tab in browser.find_elements(By.CSS_SELECTOR, "button[role=tab]") if tab.text == "Model card").click()
    card = until("the model card", lambda: (text := browser.find_element(By.CSS_SELECTOR, "#card").text)
                 and "Final evaluation" in text and text)
    assert "qwen3_5_vit" in card and "step-0000150" in card and "accuracy_real" in card and "SHA-256" in card
    photograph(browser, shots(tmp_path) / "page_card.png")


def test_the_evidence_view_shows_the_map_and_the_verdict(browser, served, tmp_path):
    open_page(browser, served)
    attach(browser, served.images[2])
    ask(browser)
    answer = answered(browser, 1)
    next(tab for tab in browser.find_elements(By.CSS_SELECTOR, "button[role=tab]") if tab.text == "Evidence").click()
    browser.find_element(By.CSS_SELECTOR, "#explain").click()
    words = until("the verdict", lambda: (text := browser.find_element(By.CSS_SELECTOR, "#verdict").text)
                  and "Image effect" in text and text)
    assert f"Answer explained: “{answer}”" in words
    assert any(v in words for v in ("Trusted map", "Do not trust this map", "Do not read this map"))
    assert "image blanked" in words and "another image" in words
    width = until("the map", lambda: browser.execute_script(
        "const img = document.querySelector('#evidence-map img'); return img && img.complete && img.naturalWidth"))
    assert width >= 800  # the picture `mmadapt explain` draws (10 inches at 100 dpi)
    photograph(browser, shots(tmp_path) / "page_evidence.png")


def test_a_bad_upload_is_a_message_and_the_next_question_is_answered(browser, served, capsys, tmp_path):
    open_page(browser, served)
    text_file = tmp_path / "notes.png"
    text_file.write_text("these are notes, not an image")
    for bad, message in ((text_file, "not a PNG, JPEG, WebP or GIF image"),
                         (png_bomb(tmp_path / "bomb.png"), "image_too_large")):
        attach(browser, bad)
        ask(browser)
        shown = until(f"the message about {bad.name}", lambda b=bad: [t for t in toasts(browser) if b.name in t])
        assert message in shown[-1] and not answers(browser)
    image = served.images[3]
    attach(browser, image)
    ask(browser, text=None)  # the question is still in the box
    assert answered(browser, 1) == mmadapt_chat(served, image, capsys)


PASTE = """
const [data, name] = arguments;
const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
const clipboard = new DataTransfer();
clipboard.items.add(new File([bytes], name, {type: "image/png"}));
document.querySelector("#ask textarea").dispatchEvent(
    new ClipboardEvent("paste", {clipboardData: clipboard, bubbles: true, cancelable: true}));
"""


def test_an_example_then_a_pasted_image_are_answered_as_mmadapt_chat_answers_the_two_turns(browser, served, capsys,
                                                                                            monkeypatch):
    import base64
    import io

    open_page(browser, served)
    name = "digit-1496"  # the first held-out record: the page's first example
    next(b for b in browser.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == name).click()
    until("the example in the box", lambda: QUESTION in browser.find_element(By.CSS_SELECTOR, "#ask textarea")
          .get_attribute("value"))
    ask(browser, text=None)
    first = answered(browser, 1)

    pasted = served.images[4]
    browser.execute_script(PASTE, base64.b64encode(pasted.read_bytes()).decode(), pasted.name)
    until("the pasted image in the box",
          lambda: pasted.name in browser.find_element(By.CSS_SELECTOR, "#ask").get_attribute("innerHTML"))
    ask(browser)
    second = answered(browser, 2)

    # `mmadapt chat` holding the same conversation on stdin: an image, the question; another image, the question
    example = served.out / "data" / "images" / f"{name}.png"  # the example is this file, decoded and written again
    turns = f"/image {example}\n{QUESTION}\n/image {pasted}\n{QUESTION}\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    capsys.readouterr()
    assert main(["chat", str(served.out)]) == 0
    assert capsys.readouterr().out.splitlines() == [first, second]
