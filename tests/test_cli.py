"""The command line: help shows every flag's default, no abbreviations, mistakes found before the model loads."""

import argparse
import json
import logging
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from prefixserve.cli import build_parser, main
from prefixserve.server import serve_launch as launch

NO_DEFAULT_BY_NATURE = {"--trace", "--calibrate"}  # a required-unless input, and an action of its own


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(commands.choices)


def option_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's rendered help text, whitespace collapsed, by its first flag."""
    lines = parser.format_help().split("options:\n", 1)[1].splitlines()
    blocks: dict[str, str] = {}
    current = None
    for line in lines:
        match = re.match(r"^  (-\S+)", line)
        if match:
            current = match.group(1).rstrip(",")
            blocks[current] = line
        elif current:
            blocks[current] += " " + line
    return {flag: " ".join(text.split()) for flag, text in blocks.items()}


# --------------------------------------------------------------------------- help and parsing
@pytest.mark.parametrize("command", ["serve", "simulate"])
def test_every_flag_has_help_and_shows_its_default(command):
    parser = subcommands(build_parser())[command]
    rendered = option_help(parser)
    for action in parser._actions:
        flag = action.option_strings[0]
        if flag == "-h":
            continue
        assert action.help, f"{command} {flag} has no help"
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not switch and flag not in NO_DEFAULT_BY_NATURE:
            assert "default" in rendered[flag], f"{command} {flag} does not show its default: {rendered[flag]}"


def test_help_shows_the_values_of_defaults_once():
    serve = option_help(subcommands(build_parser())["serve"])
    assert serve["--host"].endswith("(default: 127.0.0.1)")
    assert serve["--dtype"].endswith("(default: auto)") and serve["--dtype"].count("default") == 1
    assert serve["--model"].endswith("(default: the built-in prefixserve-tiny, generated on first use)")
    assert "(default: None)" not in " ".join(serve.values()) and "(default: False)" not in " ".join(serve.values())
    simulate = option_help(subcommands(build_parser())["simulate"])
    assert simulate["--plot"].endswith("(default: simulate_policies.png)")
    assert simulate["--trace"].count("conversation") == 1 and "synthetic" in simulate["--trace"]
    assert serve["--port"] == "--port PORT listen port, checked before the model loads (default: 8000)"
    for command, parser in subcommands(build_parser()).items():  # route too: its own "(default N)" is not doubled
        for flag, text in option_help(parser).items():
            assert text.count("(default") <= 1, f"{command} {flag}: {text}"


def other_value(item, kind):
    """A value of EngineConfig field `item` other than its default, as a flag would give it."""
    if item.metadata.get("choices"):
        return next(choice for choice in item.metadata["choices"] if choice != item.default)
    if kind is int:
        return 32 if item.name == "block_size" else (item.default or 1) * 2 + 1
    if kind is float:
        return 0.5 * (item.default or 4.0)
    return "some-value"


def test_every_engine_config_field_is_a_serve_flag_with_its_default():
    from dataclasses import fields

    from prefixserve.config import EngineConfig
    from prefixserve.server.engine_flags import _value_type, engine_config_from_args, flag_of

    parser = subcommands(build_parser())["serve"]
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()  # no default restated
    rendered = option_help(parser)
    for item in fields(EngineConfig):
        flag, kind = flag_of(item), _value_type(item)
        assert flag in rendered and item.metadata["help"].split()[0] in rendered[flag], flag
        if kind is bool:
            assert getattr(parser.parse_args([flag]), item.name) is (not item.default), flag
        elif "parse" in item.metadata:  # a JSON flag: the field holds what the parser made of it
            text = {
                "tenant_shares": '{"acme": {"min_kv_share": 0.2}}',
                "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
            }.get(item.name, '{"enable_kv_cache_events": true}')
            assert getattr(parser.parse_args([flag, text]), item.name) == item.metadata["parse"](text), flag
        else:
            value = other_value(item, kind)
            assert getattr(parser.parse_args([flag, str(value)]), item.name) == value, flag
    assert {
        "--no-prefix-caching",
        "--no-batch-invariant",
        "--prefix-hash",
        "--gpu-memory-utilization",
        "--max-pinned-blocks",
        "--seed",
        "--disable-log-stats",
    } <= set(rendered)


def test_no_parser_accepts_abbreviated_flags(capsys):
    parser = build_parser()
    assert parser.allow_abbrev is False
    assert all(sub.allow_abbrev is False for sub in subcommands(parser).values())
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--trace", "agent", "--replica", "8"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "prefixserve simulate: error: unrecognized arguments: --replica 8" in err
    assert err.startswith("usage: prefixserve simulate")  # the command's own usage, not the top level's
    with pytest.raises(SystemExit):
        main(["serve", "--por", "8001"])
    assert "prefixserve serve: error: unrecognized arguments: --por 8001" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["route", "--replica", "http://127.0.0.1:1", "--pol", "round_robin"])
    assert "unrecognized arguments: --pol round_robin" in capsys.readouterr().err


def test_port_must_be_a_port_number(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--port", "70000"])
    assert "argument --port: 70000 is not a port number (0-65535" in capsys.readouterr().err


# --------------------------------------------------------------- serve: checks before the model
@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if serve gets as far as building the engine."""

    def build_server(args):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(launch, "build_server", build_server)


def serve_error(*argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert isinstance(exited.value.code, str), exited.value.code  # a message, not a traceback
    return exited.value.code


def test_busy_port_is_named_before_the_model_loads(no_model_load):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        message = serve_error("--port", str(port))
    assert message == (
        f"prefixserve serve: --port {port}: already in use on 127.0.0.1 (another server listens "
        "there); stop it or choose another --port"
    )


def test_model_directory_problems_are_named_by_flag(tmp_path, no_model_load):
    assert serve_error("--model", "/no/such") == (
        "prefixserve serve: --model /no/such: no such directory, file or model name; pass a Hugging Face "
        "checkpoint directory (config.json, *.safetensors, tokenizer.json), a .gguf file or a directory holding "
        "one, or a model name (smollm2-135m-instruct), or leave --model out for the built-in prefixserve-tiny"
    )
    (tmp_path / "file").write_text("x")
    assert "--model " + str(tmp_path / "file") + ": is a file but not a .gguf file" in serve_error(
        "--model", str(tmp_path / "file")
    )
    assert f"--model {tmp_path}: has no config.json (and no .gguf file)" in serve_error("--model", str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert f"--model {tmp_path}: has no *.safetensors weights" in serve_error("--model", str(tmp_path))


def test_engine_option_errors_speak_in_flags(no_model_load):
    assert serve_error("--block-size", "3") == "prefixserve serve: --block-size must be a power of two up to 128, got 3"
    assert serve_error("--max-num-batched-tokens", "8") == (
        "prefixserve serve: --max-num-batched-tokens (8) must be at least --block-size (16)"
    )


def test_unreadable_shared_prefix_and_keys_files_fail_first(tmp_path, no_model_load):
    assert "--shared-prefix /no/such.txt: cannot read it (No such file or directory)" in serve_error(
        "--shared-prefix", "/no/such.txt"
    )
    (tmp_path / "empty.txt").write_text("\n")
    assert "--shared-prefix " + str(tmp_path / "empty.txt") + ": the file is empty" in serve_error(
        "--shared-prefix", str(tmp_path / "empty.txt")
    )
    (tmp_path / "keys.json").write_text("[1, 2]")
    assert "--api-keys-file" in serve_error("--api-keys-file", str(tmp_path / "keys.json"))


def test_bound_port_refuses_clients_until_uvicorn_listens():
    sockets = launch.bind_port("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        assert port > 0
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()


# ------------------------------------------------------------------------- shared prefix
@pytest.mark.parametrize(
    "content, text",
    [
        ("Be brief.\n", "Be brief."),
        ("Be brief.\r\n", "Be brief."),
        ("Be brief.", "Be brief."),
        ("Be brief.\n\n", "Be brief.\n"),  # one newline goes, a deliberate blank line stays
        ("  Be brief. \n", "  Be brief. "),
    ],
)
def test_shared_prefix_is_the_text_less_one_trailing_newline(tmp_path, content, text):
    path = tmp_path / "system.txt"
    path.write_bytes(content.encode())
    assert launch.read_shared_prefix(str(path)) == text


def test_shared_prefix_must_be_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(SystemExit, match="--shared-prefix .*latin1.txt: not UTF-8 text"):
        launch.read_shared_prefix(str(path))


def test_shared_prefix_logs_tokens_and_blocks_of_both_forms(default_model_dir, caplog):
    from prefixserve.cache.keys import CacheScope
    from prefixserve.cache.scoping import PromptScoper
    from prefixserve.model.tokenizers.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(default_model_dir)
    scoper = PromptScoper(CacheScope("model", "tokenizer"), 16)
    core = SimpleNamespace(
        tokenizer=tokenizer, config=SimpleNamespace(block_size=16), declare_shared_prefix=scoper.declare_shared_prefix
    )
    text = "Company policy: be helpful, be brief, cite sources, never guess. " * 3
    chat = tokenizer.encode_chat([{"role": "system", "content": text}], add_generation_prompt=False)
    plain = tokenizer.encode(text)
    caplog.set_level(logging.INFO, logger="prefixserve.server")
    launch.declare_shared_prefix(core, "system.txt", text)
    assert [record.getMessage() for record in caplog.records] == [
        f"shared prefix system.txt as a chat system message: {len(chat)} tokens, {len(chat) // 16} full blocks "
        "of 16 shared by every tenant",
        f"shared prefix system.txt as a completion prompt: {len(plain)} tokens, {len(plain) // 16} full blocks "
        "of 16 shared by every tenant",
    ]
    assert sorted(map(len, scoper.shared_prefixes)) == sorted([len(chat) // 16 * 16, len(plain) // 16 * 16])
    caplog.clear()
    launch.declare_shared_prefix(core, "short.txt", "Hi")
    assert [r.levelname for r in caplog.records] == ["INFO", "WARNING", "INFO", "WARNING"]
    assert "shorter than one block (16 tokens): nothing of it is shared" in caplog.records[1].getMessage()


# --------------------------------------------------------------------- start-up progress
def test_generating_the_built_in_model_says_so(tmp_path, monkeypatch, caplog):
    from prefixserve.model import default

    def write_stub(directory):  # the real weights take seconds; the log lines are what is tested
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(default, "write_default_model", write_stub)
    caplog.set_level(logging.INFO, logger="prefixserve.model")
    target = default.ensure_default_model(tmp_path)
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == f"generating the built-in model prefixserve-tiny into {target} (first use only) ..."
    assert re.fullmatch(rf"generated {re.escape(str(target))} in \d+\.\d s", messages[1])
    caplog.clear()
    default.ensure_default_model(tmp_path)
    assert caplog.records == []  # already there: nothing to say


def read_until(process: subprocess.Popen, pattern: str, timeout: float) -> str:
    """stderr of `process` up to and including the first line matching `pattern` (bounded wait)."""
    selector = selectors.DefaultSelector()
    selector.register(process.stderr, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not selector.select(timeout=1):
            continue
        line = process.stderr.readline()
        if not line:
            break
        seen += line
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s; stderr so far:\n{seen}")


def test_serve_logs_each_start_up_stage_and_shares_the_prefix_file(tmp_path, default_model_dir):
    prefix_text = "Company policy: be helpful, be brief, cite sources, never guess. " * 6
    (tmp_path / "system.txt").write_text(prefix_text + "\n")  # as an editor saves it
    (tmp_path / "keys.json").write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    command = [
        sys.executable,
        "-m",
        "prefixserve.cli",
        "serve",
        "--port",
        "0",
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(32 << 20),
        "--shared-prefix",
        str(tmp_path / "system.txt"),
        "--api-keys-file",
        str(tmp_path / "keys.json"),
    ]
    process = subprocess.Popen(
        command, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        log = read_until(process, r"ready in \d", timeout=180)
        stages = [
            "prefixserve.server: holding 127.0.0.1 port",
            "prefixserve.model: loading",
            "prefixserve.model: loaded",
            "shared prefix",
            "prefixserve.server: ready in",
        ]
        positions = [log.find(stage) for stage in stages]
        assert -1 not in positions and positions == sorted(positions), log
        chat_line = re.search(r"as a chat system message: (\d+) tokens, (\d+) full blocks of 16", log)
        assert chat_line and re.search(r"as a completion prompt: \d+ tokens, \d+ full blocks of 16", log), log
        port = int(re.search(r"ready in [\d.]+ s: http://127\.0\.0\.1:(\d+)", log).group(1))

        def cached_tokens(key: str, question: str) -> int:
            messages = [{"role": "system", "content": prefix_text}, {"role": "user", "content": question}]
            response = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                timeout=120,
                headers={"Authorization": f"Bearer {key}"},
                json={"messages": messages, "max_tokens": 1, "temperature": 0},
            )
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        # The client sends the text without the file's final newline, and another tenant still shares it.
        cached_tokens("key-a", "First question")
        assert cached_tokens("key-b", "Second question") == int(chat_line.group(2)) * 16
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            _, rest = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            _, rest = process.communicate()
    assert process.returncode == 0 and "Traceback" not in rest, rest


def test_serve_with_a_busy_port_exits_with_one_line_and_no_traceback():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
        )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"prefixserve serve: --port {port}: already in use on 127.0.0.1 (another "
        "server listens there); stop it or choose another --port"
    )


def test_model_that_does_not_exist_is_named_on_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "prefixserve.cli", "serve", "--model", "/no/such"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 1
    assert result.stderr.startswith("prefixserve serve: --model /no/such: no such directory, file or model name; ")
    assert "model=None" not in result.stderr and "Traceback" not in result.stderr


def test_successful_polls_stay_out_of_the_access_log_at_info():
    import logging

    from prefixserve.server.serve_launch import QuietPolls

    def record(path, status):
        return logging.LogRecord(
            "uvicorn.access",
            logging.INFO,
            __file__,
            1,
            '%s - "%s %s HTTP/%s" %d',
            ("127.0.0.1:5", "GET", path, "1.1", status),
            None,
        )

    access = logging.getLogger("uvicorn.access")
    previous = access.level
    quiet = QuietPolls()
    try:
        access.setLevel(logging.INFO)
        assert not quiet.filter(record("/health", 200)) and not quiet.filter(record("/v1/kv_events?since=4", 200))
        assert quiet.filter(record("/health", 503)) and quiet.filter(record("/v1/completions", 200))
        access.setLevel(logging.DEBUG)
        assert quiet.filter(record("/health", 200))
    finally:
        access.setLevel(previous)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-cache-ttl", "-1"], "max_cache_ttl (--max-cache-ttl) must be a positive number"),
        (["--max-cache-ttl", "nan"], "max_cache_ttl (--max-cache-ttl) must be a positive number"),
        (["--hot-prefix-min-requests", "1"], "--hot-prefix-min-requests must be 0 (off) or at least 2"),
        (["--hot-prefix-window", "0"], "--hot-prefix-window must be positive"),
        (["--max-waiting", "-1"], "max_waiting (--max-waiting) must be an integer >= 0, got -1"),
        (["--max-request-bytes", "0"], "max_request_bytes (--max-request-bytes) must be an integer >= 1, got 0"),
        (
            ["--served-model-name", "a@b"],
            "served_model_name (--served-model-name) must be a non-empty name without '@'",
        ),
        (["--served-model-name", " "], "served_model_name (--served-model-name) must be a non-empty name"),
    ],
)
def test_lifecycle_options_are_checked_before_the_model_loads(no_model_load, argv, message):
    assert message in serve_error("--port", "0", *argv)


def test_server_settings_name_every_bad_value():
    from prefixserve.server.api import ServerSettings

    for changes, message in [
        ({"default_max_tokens": 0}, "default_max_tokens must be an integer >= 1, got 0"),
        ({"retry_after_seconds": -1}, "retry_after_seconds must be an integer >= 0"),
        ({"max_waiting": True}, "max_waiting (--max-waiting) must be an integer"),
        ({"max_cache_ttl": float("inf")}, "max_cache_ttl (--max-cache-ttl) must be a positive number"),
        ({"tenant_cache_ttls": {"a": 0}}, "tenant 'a': cache_ttl must be a positive number of seconds, got 0"),
        ({"tenant_cache_retentions": {"a": "disk"}}, "tenant 'a': cache_retention must be one of device, none"),
    ]:
        with pytest.raises(ValueError) as error:
            ServerSettings(**changes)
        assert message in str(error.value)
    assert ServerSettings(tenant_cache_ttls={"a": 1e9}).tenant_cache_ttls == {"a": 1e9}  # capped per request
