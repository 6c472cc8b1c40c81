"""The playground at / in a real headless browser: Debian's chromium (apt-get install chromium),
driven by Playwright's Python API over the live server (API key on): the page loads without the
key, lists the models once the key is given, streams a chat answer from the default model with
its TTFT and speed, shows a structured-output answer and a tool call, and shows an error as an
error."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from tests.server.conftest import API_KEY, MODEL

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (apt-get install chromium)"),
]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 180_000  # one answer of the default model on a loaded 2-core CPU


@pytest.fixture(scope="module")
def page(live_server):
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        # launch_persistent_context: the user-data dir is a new empty one (Playwright refuses
        # --user-data-dir among the arguments of a plain launch)
        context = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=CHROMIUM_ARGS)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.errors = errors
        yield page
        context.close()


def _send(page, text: str):
    """Sends a message; returns the assistant's message element once it is complete (its stats
    line is there, or an error the page found before sending)."""
    before = page.locator(".message.assistant").count()
    page.fill("#prompt", text)
    page.click("#send")
    message = page.locator(".message.assistant").nth(before)
    message.locator(".stats, .error-text").first.wait_for()
    page.wait_for_function("!document.getElementById('send').disabled")
    return message


def test_page_loads_without_the_key_and_lists_models_with_it(page, live_server):
    response = page.goto(live_server.base_url + "/")
    assert response.status == 200 and page.title() == "jaxserve playground"
    # /v1 is protected: without the key the page says so
    page.locator("#status.error").wait_for()
    assert "401" in page.text_content("#status")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [MODEL, "alias"]
    assert "max_model_len 2048" in page.text_content("#status")
    assert page.errors == []


def test_a_message_streams_an_answer(page, client):
    page.click("#clear")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "12")
    message = _send(page, "What is the capital of France?")
    assert "error" not in message.get_attribute("class")
    text = message.locator(".content").text_content()
    expected = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=0,
        max_tokens=12).choices[0].message.content
    assert text == expected and text
    stats = message.locator(".stats")
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    tokens, chunks = int(stats.get_attribute("data-tokens")), int(stats.get_attribute("data-chunks"))
    assert tokens >= 2 and chunks >= 2  # streamed in pieces, not at once
    line = stats.text_content()
    assert "TTFT" in line and "tok/s" in line and f"{tokens} tokens" in line
    assert page.errors == []


def test_structured_output_and_tool_calls(page):
    page.click("#clear")
    page.fill("#max_tokens", "40")
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    page.fill("#json_schema", json.dumps(schema))
    message = _send(page, "Which city is the capital of France?")
    answer = json.loads(message.locator(".content").text_content())
    assert set(answer) == {"city"} and answer["city"] in ("Paris", "Rome")

    page.click("#clear")
    page.fill("#json_schema", "")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    page.fill("#tools", json.dumps([tool]))
    page.select_option("#tool_choice", "required")
    page.fill("#max_tokens", "60")
    message = _send(page, "What is the weather in Paris?")
    assert "error" not in message.get_attribute("class"), message.text_content()
    assert message.locator(".tool-call .tool-name").first.text_content() == "get_weather("
    args = json.loads(message.locator(".tool-call .tool-arguments").first.text_content())
    assert isinstance(args["city"], str)
    assert "finish: tool_calls" in message.locator(".stats").text_content()
    page.fill("#tools", "")
    page.select_option("#tool_choice", "")
    assert page.errors == []


def test_errors_show_as_errors(page):
    page.click("#clear")
    page.fill("#max_tokens", "100000")  # more than the context holds: a 400 from the server
    message = _send(page, "Hello")
    assert "error" in message.get_attribute("class")
    error = message.locator(".error-text").text_content()
    assert error.startswith("400 BadRequestError:") and "max_tokens" in error, error
    assert message.locator(".content").text_content() == ""
    page.fill("#max_tokens", "8")
    page.fill("#tools", "[not json")  # refused in the page before anything is sent
    message = _send(page, "Hello")
    assert "not valid JSON" in message.locator(".error-text").text_content()
    page.fill("#tools", "")
    assert page.errors == []
