"""Streams through the router while replicas are reloaded (issue 56): a stream goes on only on the model version it
began on. Two real replicas serve two checkpoints of the built-in model (their greedy texts differ from the first
token, and so does each one's continuation of the other's); in each repetition a stream runs, and after its k-th
chunk one replica is reloaded (POST /v1/admin/reload) and the stream's replica killed, or the stream's own replica
is reloaded under it. Every stream ends in exactly the text of the version it began on, or in that text's beginning
and a stream_interrupted error event: never a mixture.

The suite runs four repetitions at fixed moments, the stream's replica stopped (SIGSTOP) before the reload so the
break lands mid-stream, and each outcome is exact. The sweep (`-m sweeps`, .ci/run) runs fifty at random moments
and orders, with plain kills, and counts the mixed streams: none may be.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest
from router_fleet import ADMIN_KEY, Fleet, index_of, wait_healthy

from prefixserve.model.weights.versions import write_model_version

BODY = {
    "prompt": "A stream that must never mix two models: the story goes",
    "max_tokens": 160,  # about 1.5 s of decoding on one core: long enough for the moments below to land mid-stream
    "temperature": 0,
    "ignore_eos": True,
}
REQUEST_TIMEOUT = 120.0
NUM_SWEEP_REPETITIONS = 50
SWEEP_TIMEOUT = 1200.0  # the sweep's bound in time, however slow the machine
SWEEP_SEED = 56


@dataclass
class Versions:
    """The two checkpoints, what each is called in a system_fingerprint, and its greedy text of BODY."""

    paths: list[Path]
    names: list[str]  # "fp_" + 16 hex digits, as a replica's chunks name it
    texts: dict[str, str]  # name -> the whole text of an unbroken stream


@dataclass
class Ending:
    """How one stream through the router ended."""

    text: str
    version: str  # the system_fingerprint every chunk carried
    error: Optional[dict]
    replica: int  # the index of the replica it began on

    def outcome(self, versions: Versions) -> str:
        """exact: the whole text of the version it began on | interrupted: the beginning of that text, then a
        stream_interrupted event | mixed: any other text | failed: another error."""
        reference = versions.texts[self.version]
        if self.error is None:
            return "exact" if self.text == reference else "mixed"
        if not reference.startswith(self.text):
            return "mixed"
        return "interrupted" if self.error.get("code") == "stream_interrupted" else "failed"


@dataclass
class Replicas:
    """The fleet, and which checkpoint each replica serves as the test changed them."""

    fleet: Fleet
    versions: Versions
    serving: list[int] = field(default_factory=list)  # replica index -> index into versions.paths
    reloads: list[threading.Thread] = field(default_factory=list)
    reload_failures: list[tuple[int, Exception]] = field(default_factory=list)  # (replica, what its reload raised)

    def reload(self, index: int, version: int) -> dict:
        """Reload replica `index` to checkpoint `version`; its answer (it returns once the swap is done)."""
        response = httpx.post(
            self.fleet.urls[index] + "/v1/admin/reload",
            json={"model": str(self.versions.paths[version])},
            headers={"authorization": f"Bearer {ADMIN_KEY}"},
            timeout=REQUEST_TIMEOUT,
        )
        assert response.status_code == 200, response.text
        self.serving[index] = version
        return response.json()

    def reload_soon(self, index: int, version: int) -> dict:
        """The same in a thread (joined by `settle`): the stream and the kills go on meanwhile. Returns the dict
        its answer will be put in."""
        answer: dict = {}

        def reload() -> None:
            try:
                answer.update(self.reload(index, version))
            except (httpx.HTTPError, AssertionError) as failure:
                self.reload_failures.append((index, failure))

        thread = threading.Thread(target=reload)
        thread.start()
        self.reloads.append(thread)
        return answer

    def stop(self, index: int) -> None:
        """Freeze the replica (SIGSTOP) where its stream is, to be killed after what the test does next."""
        self.fleet.processes[index].send_signal(signal.SIGSTOP)

    def kill(self, index: int) -> None:
        self.fleet.kill(index)

    def settle(self, version_of_restarted: int) -> None:
        """Reloads answered, every killed replica started again (on `version_of_restarted`), all healthy."""
        for thread in self.reloads:
            thread.join(REQUEST_TIMEOUT)
            assert not thread.is_alive(), "a reload did not answer"
        self.reloads.clear()
        # only a replica killed under its reload may have failed it
        assert [f for i, f in self.reload_failures if self.fleet.processes[i].poll() is None] == []
        self.reload_failures.clear()
        for index, process in enumerate(self.fleet.processes):
            if process.poll() is not None:
                self.fleet.restart(index, "--model", str(self.versions.paths[version_of_restarted]))
                self.serving[index] = version_of_restarted
                wait_healthy(self.fleet.urls[index])
        self.fleet.wait_all_healthy()

    def other(self, index: int) -> int:
        return 1 - index

    def version_of(self, name: str) -> int:
        return self.versions.names.index(name)


def stream(replicas: Replicas, at_chunk: int, act: Callable[[int, str], None]) -> Ending:
    """A greedy stream through the router; after its `at_chunk`-th chunk, act(its replica, its version)."""
    fleet = replicas.fleet
    pieces, names, error, num_chunks = [], set(), None, 0
    body = {**BODY, "stream": True}
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT) as response:
        assert response.status_code == 200
        replica = index_of(fleet, response.headers["x-prefixserve-replica"])
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                assert len(names) == 1, names
                return Ending("".join(pieces), names.pop(), error, replica)
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            names.add(event["system_fingerprint"])
            pieces.extend(choice["text"] for choice in event["choices"])
            num_chunks += 1
            if num_chunks == at_chunk:
                act(replica, event["system_fingerprint"])
    raise AssertionError("the stream ended without [DONE]")


@pytest.fixture(scope="module")
def replicas(default_model_dir, tmp_path_factory):
    second = write_model_version(default_model_dir, tmp_path_factory.mktemp("v2") / "model", seed=56)
    paths = [Path(default_model_dir), second]
    with Fleet(2, replica_args=("--served-model-name", "reload-race")) as fleet:  # the name kept across restarts
        running = Replicas(fleet, Versions(paths, [], {}), serving=[0, 0])
        running.reload(1, 1)
        for index in (0, 1):  # each version's unbroken text, straight from a replica serving it
            answer = httpx.post(fleet.urls[index] + "/v1/completions", json=BODY, timeout=REQUEST_TIMEOUT).json()
            running.versions.names.append(answer["system_fingerprint"])
            running.versions.texts[answer["system_fingerprint"]] = answer["choices"][0]["text"]
        text_0, text_1 = running.versions.texts.values()
        assert len(running.versions.texts) == 2 and text_0[:8] != text_1[:8], "the two versions must differ at once"
        fleet.wait_all_healthy()
        yield running


def test_a_stream_ends_in_its_own_versions_text_whatever_replica_is_reloaded(replicas):
    """Four moments, each with one right outcome: the stream's replica is stopped after chunk 5 (so the break
    lands mid-stream), the other replica reloaded, then the stopped one killed; or the stream's own replica is
    reloaded after chunk 5 (it drains: the stream finishes on the version it began on before the swap)."""
    continued = replicas.fleet.router.metrics.continued

    def num_continued() -> float:
        return sum(continued.labels(r.name)._value.get() for r in replicas.fleet.router.replicas)

    def reload_other_then_kill(to_same_version: bool):
        def act(replica: int, name: str) -> None:
            replicas.stop(replica)
            own = replicas.version_of(name)
            replicas.reload(replicas.other(replica), own if to_same_version else 1 - own)
            replicas.kill(replica)

        return act

    # 1. The race: the other replica reloaded to the other version just before the stream's replica dies;
    #    the router's record of it is the old version (it refreshes every 10 s).
    ending = stream(replicas, 5, reload_other_then_kill(to_same_version=False))
    assert ending.outcome(replicas.versions) == "interrupted", ending
    assert "model version" in ending.error["message"]
    replicas.settle(version_of_restarted=0)

    # 2. Reloaded to the stream's own version: the stream goes on there, the text whole.
    before = num_continued()
    ending = stream(replicas, 5, reload_other_then_kill(to_same_version=True))
    assert ending.outcome(replicas.versions) == "exact", ending
    assert num_continued() == before + 1
    replicas.settle(version_of_restarted=0)

    # 3. The stream's own replica reloaded under it: drained, the stream ends on its version, no error.
    answers = []

    def reload_own(replica: int, name: str) -> None:
        own = replicas.version_of(name)
        answers.append(replicas.reload_soon(replica, 1 - own))

    ending = stream(replicas, 5, reload_own)
    replicas.settle(version_of_restarted=0)
    assert ending.outcome(replicas.versions) == "exact", ending
    assert ["fp_" + answers[0]["previous_fingerprint"][:16], "fp_" + answers[0]["model_fingerprint"][:16]] == [
        ending.version,
        replicas.versions.names[1 - replicas.version_of(ending.version)],
    ]

    # 4. A stream that begins right after its replica was reloaded (the router still has the version it read
    #    before): its chunks, not that record, say which version it began on; the other replica serves the other
    #    version, so the stream ends when its replica dies.
    replicas.reload(0, 1 - replicas.serving[0])  # the two now serve different versions, whichever began the stream
    if replicas.serving[0] == replicas.serving[1]:
        replicas.reload(1, 1 - replicas.serving[1])

    def kill(replica: int, name: str) -> None:
        replicas.stop(replica)
        replicas.kill(replica)

    ending = stream(replicas, 5, kill)
    assert ending.outcome(replicas.versions) == "interrupted", ending


SCENARIOS = ("reload_other_then_kill", "kill_while_reloading_other", "reload_own", "reload_own_then_kill")


def chaos(replicas: Replicas, scenario: str, target: int, delay: float) -> Callable[[int, str], None]:
    """What happens to the fleet at the stream's chosen moment; `target` is the version a reload goes to."""

    def act(replica: int, name: str) -> None:
        other = replicas.other(replica)
        if scenario == "reload_other_then_kill":
            replicas.reload(other, target)
            time.sleep(delay)
            replicas.kill(replica)
        elif scenario == "kill_while_reloading_other":
            replicas.reload_soon(other, target)
            time.sleep(delay)
            replicas.kill(replica)
        else:
            replicas.reload_soon(replica, target)
            if scenario == "reload_own_then_kill":
                time.sleep(delay)
                replicas.kill(replica)

    return act


@pytest.mark.sweeps
def test_fifty_streams_through_random_reloads_and_kills_mix_no_text(replicas):
    """Issue 56's goal: fifty repetitions at random moments (after chunk 1 to 40, delays of 0 to 0.3 s), in random
    orders (a reload, then the stream's replica killed; both at once; the stream's own replica reloaded, then
    killed or not), each reload to a random version, and at random a replica reloaded just before the stream
    begins (the router's record of its version stale). No stream mixes two versions' text; each ends whole or
    interrupted."""
    rng = random.Random(SWEEP_SEED)
    outcomes: Counter = Counter()
    wrong = []  # (repetition, scenario, chunk, delay, ending) of each stream that ended otherwise
    router = replicas.fleet.router
    replicas.settle(version_of_restarted=0)  # the fleet whole, whatever ran before
    continued_before = sum(router.metrics.continued.labels(r.name)._value.get() for r in router.replicas)
    started = time.monotonic()
    for repetition in range(NUM_SWEEP_REPETITIONS):
        assert time.monotonic() - started < SWEEP_TIMEOUT, f"the sweep ran out of time after {repetition}"
        scenario, at_chunk = rng.choice(SCENARIOS), rng.randint(1, 40)
        target, delay = rng.randrange(2), rng.uniform(0.0, 0.3)
        if rng.random() < 0.3:
            replicas.reload(rng.randrange(2), rng.randrange(2))
        ending = stream(replicas, at_chunk, chaos(replicas, scenario, target, delay))
        outcome = ending.outcome(replicas.versions)
        outcomes[outcome] += 1
        if outcome not in ("exact", "interrupted"):
            wrong.append((repetition, scenario, at_chunk, round(delay, 3), ending))
        replicas.settle(version_of_restarted=rng.randrange(2))
    num_continued = sum(router.metrics.continued.labels(r.name)._value.get() for r in router.replicas)
    print(
        f"\n{NUM_SWEEP_REPETITIONS} repetitions in {time.monotonic() - started:.0f} s: {dict(outcomes)}, "
        f"{num_continued - continued_before:.0f} streams continued on another replica"
    )
    assert wrong == [] and sum(outcomes.values()) == NUM_SWEEP_REPETITIONS
