"""Busy is not down (issue 24): two real replicas kept busy with long prompts for a minute, with the
router's default health and control timeouts. Every small request sent meanwhile succeeds, the router's
/health never says no replica is healthy, and no replica is marked down. Bounded in count and time."""

import threading
import time

import httpx
from router_fleet import Fleet, down_counts, down_reasons_since

from prefixserve.model.tokenizers.tokenizer import Tokenizer
from prefixserve.router.settings import RouterSettings

BUSY_SECONDS = 60.0
MAX_LONG = 200  # bounds on what the loops send
MAX_SMALL = 240
LONG_TOKENS = 2040  # the prompts: about half the built-in model's 4,096 positions


def long_prompt(tokenizer: Tokenizer, index: int) -> str:
    """About LONG_TOKENS tokens of text, different from the first word on (no prefix hit makes it cheaper)."""
    words = [f"w{index}x{i}" for i in range(LONG_TOKENS)]
    while len(tokenizer.encode(" ".join(words))) > LONG_TOKENS:
        words = words[: int(len(words) * 0.9)]
    return " ".join(words)


def test_a_fleet_busy_with_long_prompts_for_a_minute_fails_no_small_request(default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    defaults = RouterSettings(replicas=("http://unused",))
    with Fleet(
        2,
        health_interval=defaults.health_interval,
        control_timeout=defaults.control_timeout,
        health_failure_threshold=defaults.health_failure_threshold,
    ) as fleet:
        before = down_counts(fleet)
        deadline = time.monotonic() + BUSY_SECONDS
        long_answers: list[int] = []

        def keep_busy(worker: int) -> None:
            with httpx.Client(timeout=300) as client:
                for index in range(worker, MAX_LONG, 2):
                    if time.monotonic() > deadline:
                        return
                    body = {"prompt": long_prompt(tokenizer, index), "max_tokens": 4, "temperature": 0}
                    long_answers.append(client.post(fleet.url + "/v1/completions", json=body).status_code)

        workers = [threading.Thread(target=keep_busy, args=(worker,)) for worker in range(2)]
        for worker in workers:
            worker.start()
        small, health = [], []
        with httpx.Client(timeout=60) as client:
            for index in range(MAX_SMALL):
                if time.monotonic() > deadline:
                    break
                answer = client.post(
                    fleet.url + "/v1/completions", json={"prompt": f"small {index}", "max_tokens": 2, "temperature": 0}
                )
                small.append((answer.status_code, answer.text[:200]))
                health.append(client.get(fleet.url + "/health").status_code)
                time.sleep(0.25)
        small_ended = time.monotonic()
        for worker in workers:
            worker.join(timeout=300)
        # the fleet really was busy for the minute, and small requests went on through all of it (how many fit
        # depends on the machine's speed: a slow one serves fewer, each behind a long prefill)
        assert len(long_answers) >= 4 and len(small) >= 5 and small_ended >= deadline
        assert [answer for answer in small if answer[0] != 200] == []
        assert set(health) == {200}
        assert set(long_answers) == {200}
        assert down_reasons_since(fleet, before) == [[], []]
