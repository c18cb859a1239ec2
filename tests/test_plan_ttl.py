"""`prefixserve plan ttl`: the TTL planner on synthetic gap distributions with known answers, the readers of a
server's cache stats and of a trace, and the command line (files, a local stats server, bad input)."""

import argparse
import http.server
import json
import math
import re
import socket
import threading
from types import SimpleNamespace

import pytest

from prefixserve.cli import build_parser, main
from prefixserve.plan.gap_distribution import GapBucket, GapDistribution
from prefixserve.plan.gap_readers import distribution_from_stats, gaps_from_trace
from prefixserve.plan.ttl import GIB, CostModel, plan_ttl

SERVER_BOUNDS = [0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400]


def exponential_histogram(rate: float, width: float, num_buckets: int, total: float = 1e6) -> GapDistribution:
    def cdf(t):
        return 1 - math.exp(-rate * t)

    bounds = [width * (i + 1) for i in range(num_buckets)]
    counts = [(cdf(high) - cdf(high - width)) * total for high in bounds] + [(1 - cdf(bounds[-1])) * total]
    return GapDistribution.from_histogram(bounds, counts)


def stats_body(counts, num_releases, tenants=None) -> dict:
    def histogram(counts, num_releases):
        return {"counts": counts, "count": sum(counts), "sum": 0.0, "num_releases": num_releases}

    return {
        "object": "cache.stats",
        "mean_reused_prefix_tokens": 812.5,
        "other": {"ignored": True},
        "reuse_gaps": {
            "bucket_upper_bounds": SERVER_BOUNDS,
            "overall": histogram(counts, num_releases),
            "by_tenant": {name: histogram(*value) for name, value in (tenants or {}).items()},
        },
    }


# --------------------------------------------------------------------------- the distribution
def test_deterministic_gaps_survive_exactly_from_their_gap_on():
    gaps = GapDistribution.from_samples([60] * 10)
    assert [gaps.survival(ttl) for ttl in (1, 59.999, 60, 61, 86400)] == [0, 0, 1, 1, 1]
    assert [gaps.expected_held_seconds(ttl) for ttl in (30, 60, 100)] == [30, 60, 60]


def test_exponential_gaps_match_the_closed_form():
    rate = 1 / 100
    fine = exponential_histogram(rate, width=0.5, num_buckets=40_000)
    # the exact quantiles of the exponential: deterministic samples without sampling noise
    n = 20_000
    samples = GapDistribution.from_samples([-math.log(1 - (i + 0.5) / n) / rate for i in range(n)])
    for ttl in (1, 10, 100, 300, 1000):
        survival, held = 1 - math.exp(-rate * ttl), (1 - math.exp(-rate * ttl)) / rate
        assert fine.survival(ttl) == pytest.approx(survival, rel=1e-9)
        assert fine.expected_held_seconds(ttl) == pytest.approx(held, rel=1e-5)
        assert samples.survival(ttl) == pytest.approx(survival, abs=1 / n)
        assert samples.expected_held_seconds(ttl) == pytest.approx(held, rel=1e-3)


def test_gaps_inside_a_bucket_are_spread_uniformly():
    gaps = GapDistribution.from_histogram([10, 20], [0, 4, 0])  # four gaps, uniform on (10, 20]
    assert gaps.survival(15) == 0.5
    assert gaps.expected_held_seconds(15) == 0.5 * 12.5 + 0.5 * 15
    assert gaps.expected_held_seconds(20) == gaps.expected_held_seconds(1000) == 15
    assert gaps.survival(10) == 0 and gaps.expected_held_seconds(10) == 10


def test_never_returned_releases_hold_memory_for_the_whole_ttl_and_never_hit():
    gaps = GapDistribution.from_samples([10] * 3, num_never_returned=1)
    assert gaps.num_releases == 4 and gaps.return_fraction == 0.75
    assert gaps.survival(10) == gaps.survival(10**6) == 0.75
    assert gaps.expected_held_seconds(100) == (3 * 10 + 100) / 4
    nobody = GapDistribution.from_samples([], num_never_returned=5)
    assert nobody.survival(60) == 0 and nobody.expected_held_seconds(60) == 60


def test_the_overflow_bucket_is_a_miss_held_for_the_whole_ttl():
    gaps = GapDistribution.from_histogram([10], [2, 2])  # two within 10 s, two came back after more than 10 s
    assert gaps.num_returned == 4 and gaps.return_fraction == 1 and gaps.range_end == 10
    assert gaps.survival(10) == gaps.survival(10**6) == 0.5
    assert gaps.expected_held_seconds(1000) == (2 * 5 + 2 * 1000) / 4


def test_histogram_and_samples_agree_at_the_bucket_bounds():
    samples = [second - 0.5 for second in range(1, 11) for _ in range(second)]  # each 1 s bucket's midpoint
    bounds = list(range(1, 11))
    counts = [samples.count(second - 0.5) for second in bounds] + [0]
    from_samples = GapDistribution.from_samples(samples, num_never_returned=7)
    from_histogram = GapDistribution.from_histogram(bounds, counts, num_never_returned=7)
    for ttl in bounds:
        assert from_histogram.survival(ttl) == pytest.approx(from_samples.survival(ttl), rel=1e-12)
        assert from_histogram.expected_held_seconds(ttl) == pytest.approx(
            from_samples.expected_held_seconds(ttl), rel=1e-12
        )


def test_a_trace_binned_into_the_server_histogram_survives_alike_at_every_bound():
    from prefixserve.traces.named import load_trace

    trace = load_trace("conversation", limit=3000)
    found = gaps_from_trace(trace.requests, trace.block_size)
    samples = [bucket for bucket in found.distribution.buckets for _ in range(int(bucket.count))]
    counts = [0] * (len(SERVER_BOUNDS) + 1)
    for bucket in samples:
        counts[next((i for i, bound in enumerate(SERVER_BOUNDS) if bucket.high <= bound), len(SERVER_BOUNDS))] += 1
    binned = GapDistribution.from_histogram(SERVER_BOUNDS, counts, found.distribution.num_never_returned)
    for bound in SERVER_BOUNDS:
        assert binned.survival(bound) == pytest.approx(found.distribution.survival(bound), abs=1e-12)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GapDistribution.from_samples([5, -1]), "drop negative"),
        (lambda: GapDistribution.from_samples([5, math.nan]), "finite seconds"),
        (lambda: GapDistribution.from_samples([]), "no releases to plan from"),
        (lambda: GapDistribution.from_histogram([1, 2], [1, 1]), "len(bounds) + 1 counts"),
        (lambda: GapDistribution.from_histogram([2, 1], [1, 1, 1]), "increasing"),
        (lambda: GapDistribution.from_histogram([], [1]), "at least one bucket"),
        (lambda: GapDistribution.from_histogram([1, 2], [1, -1, 0]), "counts must be finite numbers >= 0"),
        (lambda: GapDistribution.from_samples([1], num_never_returned=-1), "never-returned"),
        (lambda: GapDistribution([GapBucket(0, 10, 1), GapBucket(5, 15, 1)]), "overlap"),
        (lambda: GapDistribution.from_samples([1]).survival(0), "positive, finite number of seconds"),
        (lambda: GapDistribution.from_samples([1]).expected_held_seconds(-5), "positive, finite number of seconds"),
        (lambda: GapDistribution.from_samples([1]).survival(math.inf), "positive, finite number of seconds"),
    ],
)
def test_bad_gaps_name_the_fix(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


# --------------------------------------------------------------------------- the plan
# A prefix of 1,000 tokens whose KV weighs exactly 1 GiB; a miss re-prefills for 1 GPU second, and a GPU second
# costs $1; one release an hour, so a row's USD an hour is the cost of one release.
UNIT = dict(
    prefix_tokens=1000, prefill_seconds_per_token=1e-3, kv_bytes_per_token=GIB / 1000, releases_per_second=1 / 3600
)
BIMODAL = GapDistribution.from_samples([10] * 8 + [1000] * 2)  # 80% come back after 10 s, 20% after 1,000 s


def test_bimodal_gaps_keep_for_the_short_mode_when_memory_is_dear():
    plan = plan_ttl(BIMODAL, [1000, 5, 100, 10], **UNIT, cost=CostModel(3600, memory_usd_per_gib_hour=36))
    assert [row.ttl_seconds for row in plan.rows] == [5, 10, 100, 1000]
    # $0.01 per GiB-second held + $1 per miss: held E[min(gap, ttl)] seconds, missed with P(gap > ttl)
    assert [row.held_seconds_per_release for row in plan.rows] == [5, 10, 28, 208]
    assert [row.hit_rate for row in plan.rows] == [0, 0.8, 0.8, 1]
    assert [row.cost_usd_per_hour for row in plan.rows] == pytest.approx([1.05, 0.30, 0.48, 2.08])
    assert plan.recommended.ttl_seconds == 10
    row = plan.rows[1]
    assert row.memory_bytes == pytest.approx(10 / 3600 * GIB)
    assert row.miss_tokens_per_turn == pytest.approx(200) and row.extra_ttft_seconds_per_turn == pytest.approx(0.2)


def test_bimodal_gaps_keep_through_the_long_mode_when_memory_is_cheap():
    plan = plan_ttl(BIMODAL, [5, 10, 100, 1000], **UNIT, cost=CostModel(3600, memory_usd_per_gib_hour=1.8))
    assert [row.cost_usd_per_hour for row in plan.rows] == pytest.approx([1.0025, 0.205, 0.214, 0.104])
    assert plan.recommended.ttl_seconds == 1000


def test_waiting_is_priced_per_second_a_returning_user_waits():
    plan = plan_ttl(BIMODAL, [10], **UNIT, cost=CostModel(0, 0, waiting_usd_per_second=3))
    assert plan.rows[0].waiting_usd_per_hour == pytest.approx(3 * 0.2)
    assert plan.rows[0].cost_usd_per_hour == plan.rows[0].waiting_usd_per_hour


def test_the_release_rate_scales_dollars_and_memory_not_the_choice():
    slow = plan_ttl(BIMODAL, [5, 10, 100, 1000], **UNIT)
    fast = plan_ttl(BIMODAL, [5, 10, 100, 1000], **{**UNIT, "releases_per_second": 100 / 3600})
    assert fast.recommended.ttl_seconds == slow.recommended.ttl_seconds
    for quick, steady in zip(fast.rows, slow.rows):
        assert quick.memory_bytes == pytest.approx(100 * steady.memory_bytes)
        assert quick.cost_usd_per_hour == pytest.approx(100 * steady.cost_usd_per_hour)
        assert quick.hit_rate == steady.hit_rate


def test_a_tie_goes_to_the_shorter_ttl():
    plan = plan_ttl(
        GapDistribution.from_samples([10] * 4),
        [20, 10, 40],
        **UNIT,
        cost=CostModel(gpu_usd_per_hour=1, memory_usd_per_gib_hour=0),
    )
    assert [row.cost_usd_per_hour for row in plan.rows] == [0, 0, 0]
    assert plan.recommended.ttl_seconds == 10


def test_prefixes_that_never_come_back_only_cost_memory():
    plan = plan_ttl(
        GapDistribution.from_samples([], num_never_returned=3),
        [10, 100],
        **UNIT,
        cost=CostModel(3600, memory_usd_per_gib_hour=36),
    )
    for row in plan.rows:
        assert (row.hit_rate, row.miss_tokens_per_turn, row.recompute_usd_per_hour) == (0, 0, 0)
    assert [row.cost_usd_per_hour for row in plan.rows] == pytest.approx([0.1, 1.0])
    assert plan.recommended.ttl_seconds == 10 and plan.return_fraction == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"ttls_seconds": []}, "no candidate TTLs"),
        ({"ttls_seconds": [10, 0]}, "positive, finite number of seconds"),
        ({"prefix_tokens": 0}, "prefix_tokens must be a positive"),
        ({"releases_per_second": -1}, "releases_per_second must be a positive"),
        ({"kv_bytes_per_token": math.nan}, "kv_bytes_per_token must be a positive"),
    ],
)
def test_bad_plan_inputs_name_the_fix(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_ttl(BIMODAL, **{"ttls_seconds": [10], **UNIT, **change})
    with pytest.raises(ValueError, match="memory_usd_per_gib_hour must be a finite price"):
        CostModel(memory_usd_per_gib_hour=-1)


# --------------------------------------------------------------------------- inputs
def test_stats_body_overall_and_by_tenant():
    counts = [0] * 17
    counts[5], counts[16] = 6, 2  # six gaps in (10, 30] s, two beyond a day
    stats = stats_body(counts, num_releases=10, tenants={"acme": ([0] * 4 + [3] + [0] * 12, 3)})
    overall = distribution_from_stats(stats)
    assert (overall.num_releases, overall.num_returned, overall.num_never_returned) == (10, 8, 2)
    assert overall.survival(20) == pytest.approx(0.3) and overall.survival(30) == pytest.approx(0.6)
    acme = distribution_from_stats(stats, tenant="acme")
    assert acme.survival(10) == 1 and acme.survival(7.5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tenant 'other' has no reuse gaps in these stats; tenants: acme"):
        distribution_from_stats(stats, tenant="other")


@pytest.mark.parametrize(
    "stats, message",
    [
        ({"object": "cache.stats"}, "no reuse_gaps.bucket_upper_bounds"),
        ([1, 2], "no reuse_gaps.bucket_upper_bounds"),
        (stats_body([1] * 16, 20), "len(bounds) + 1 counts"),
        (stats_body([1] * 17, 5), "num_releases must be a number >= its count of gaps (17)"),
        (
            {
                **stats_body([1] * 17, 20),
                "reuse_gaps": {
                    **stats_body([1] * 17, 20)["reuse_gaps"],
                    "overall": {"counts": [1] * 17, "count": 3, "num_releases": 20},
                },
            },
            "count 3 is not the sum of its counts (17)",
        ),
    ],
)
def test_a_malformed_stats_body_names_the_fix(stats, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        distribution_from_stats(stats)


def test_trace_gaps_follow_a_whole_prefix_to_its_next_turn():
    def request(seconds, input_length, hash_ids):
        return SimpleNamespace(arrival_time=seconds, input_length=input_length, hash_ids=hash_ids)

    requests = [
        request(0, 1000, [1, 2]),  # releases block 1 (its second block is partial)
        request(5, 1100, [7, 8, 9]),  # another session: releases [7, 8]
        request(30, 1536, [1, 3, 4]),  # the first session's next turn: gap 30 s, 512 tokens reused; releases [1,3,4]
        request(40, 1024, [1, 5]),  # shares block 1 only, whose release was taken: releases [1, 5]
        request(100, 1600, [7, 8, 6, 10]),  # the second session's next turn: gap 95 s, 1,024 tokens
        request(110, 100, [11]),  # under one block: releases nothing
    ]
    found = gaps_from_trace(requests, block_size=512)
    assert [(bucket.high, bucket.count) for bucket in found.distribution.buckets] == [(30, 1), (95, 1)]
    assert found.distribution.num_never_returned == 3  # [1,3,4], [1,5], [7,8,6]
    assert found.mean_reused_prefix_tokens == (512 + 1024) / 2
    assert found.releases_per_second == 5 / 110


# --------------------------------------------------------------------------- command line
def plan_ttl_parser() -> argparse.ArgumentParser:
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    (actions,) = [a for a in commands.choices["plan"]._actions if isinstance(a, argparse._SubParsersAction)]
    return actions.choices["ttl"]


def test_every_plan_ttl_flag_has_help_and_a_stated_default():
    parser = plan_ttl_parser()
    rendered = "".join(parser.format_help().split())  # no whitespace: argparse wraps a long default anywhere
    for action in parser._actions:
        assert action.help, f"{action.option_strings[0]} has no help"
        if action.option_strings[0] not in ("-h", "--gaps", "--url", "--trace"):  # the one required choice
            assert "default" in action.help or f"(default:{action.default})" in rendered, action.option_strings


def test_plan_ttl_on_the_conversation_trace_prints_plots_and_writes_json(tmp_path, capsys):
    plot, report = tmp_path / "ttl.png", tmp_path / "ttl.json"
    code = main(["plan", "ttl", "--trace", "conversation", "--plot", str(plot), "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    assert "TTL plan from trace conversation (12,031 requests" in out and "<- recommended" in out
    data = json.loads(report.read_text())
    assert len(data["rows"]) == 14 and data["rows"][0]["ttl_seconds"] == 10 and data["rows"][-1]["ttl_seconds"] == 86400
    cheapest = min(data["rows"], key=lambda row: row["cost_usd_per_hour"])
    assert data["recommended_ttl_seconds"] == cheapest["ttl_seconds"]
    assert data["num_releases"] == 12031 and data["prefix_tokens"] > 512
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {plot}" in out and f"wrote {report}" in out


def test_plan_ttl_from_a_list_of_gaps(tmp_path, capsys):
    gaps = tmp_path / "gaps.txt"
    gaps.write_text("10, 10\n10 10 10 10 10 10\n1000\n1000\n")  # BIMODAL, as text
    argv = [
        "plan",
        "ttl",
        "--gaps",
        str(gaps),
        "--ttls",
        "5,10s,100,1000",
        "--prefix-tokens",
        "1000",
        "--prefill-seconds-per-token",
        "0.001",
        "--kv-bytes-per-token",
        str(GIB / 1000),
        "--releases-per-second",
        str(1 / 3600),
        "--gpu-usd-per-hour",
        "3600",
        "--memory-usd-per-gib-hour",
    ]
    json_path = tmp_path / "plan.json"
    assert main([*argv, "36", "--json", str(json_path)]) == 0
    out = capsys.readouterr().out
    assert "recommended TTL: 10 s: 80.0% of returning turns hit" in out
    assert "reuses 1,000 prefix tokens (given)" in out and "1 ms a token (given)" in out
    assert json.loads(json_path.read_text())["recommended_ttl_seconds"] == 10
    gaps.write_text(json.dumps([10] * 8 + [1000] * 2))  # the same as a JSON list
    assert main([*argv, "1.8"]) == 0
    assert "recommended TTL: 16.7 min (1000 s): 100.0% of returning turns hit" in capsys.readouterr().out


def test_plan_ttl_from_a_saved_stats_body_per_tenant(tmp_path, capsys):
    counts = [0] * 17
    counts[4] = 5
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(stats_body(counts, 10, tenants={"acme": (counts, 5)})))
    assert main(["plan", "ttl", "--gaps", str(stats), "--tenant", "acme", "--ttls", "10,1h"]) == 0
    out = capsys.readouterr().out
    assert f"TTL plan from --gaps {stats}, tenant acme" in out
    assert "5 prefix releases; 100.0% of them came back" in out and "reuses 812 prefix tokens (the stats' mean)" in out
    assert main(["plan", "ttl", "--gaps", str(stats), "--ttls", "10,1d,2d"]) == 0
    assert "* beyond the histogram's last bound (1 d)" in capsys.readouterr().out


@pytest.fixture
def stats_server():
    """A local stand-in for a server's GET /v1/cache/stats: answers the admin key 'admin-key' only."""
    counts = [0] * 17
    counts[6] = 4
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            authorized = self.headers.get("Authorization") == "Bearer admin-key"
            body = (
                stats_body(counts, 8) if authorized else {"error": {"message": "this endpoint needs the admin API key"}}
            )
            payload = json.dumps(body).encode()
            self.send_response(200 if authorized else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_plan_ttl_from_a_running_server(stats_server, capsys):
    url, seen = stats_server
    assert main(["plan", "ttl", "--url", url + "/", "--admin-api-key", "admin-key", "--ttls", "1m"]) == 0
    assert seen == [("/v1/cache/stats", "Bearer admin-key")]
    out = capsys.readouterr().out
    assert f"TTL plan from {url}/v1/cache/stats" in out and "8 prefix releases; 50.0%" in out
    assert main(["plan", "ttl", "--url", url]) == 2
    err = capsys.readouterr().err
    assert "answered 401: this endpoint needs the admin API key; pass --admin-api-key" in err
    assert len(err.strip().splitlines()) == 1


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gaps", "/no/such/gaps.json"], "no such file"),
        (["--gaps", "{garbage"], "neither JSON nor numbers"),
        (["--gaps", '{"object": "cache.stats"}'], "no reuse_gaps.bucket_upper_bounds"),
        (["--gaps", '"sixty"'], "JSON str, not a list of gap seconds"),
        (["--gaps", "[10, -3]"], "drop negative"),
        (["--gaps", "[]"], "no releases to plan from"),
        (["--gaps", "[10]", "--tenant", "acme"], "--tenant needs cache stats"),
        (["--trace", "conversation", "--tenant", "acme"], "a trace has no tenants"),
        (["--trace", "conversation", "--num-never-returned", "3"], "stats and traces count their own"),
        (["--gaps", '{"reuse_gaps": {}}', "--num-never-returned", "3"], "count their own (num_releases minus count)"),
        (["--gaps", "[10]", "--ttls", "10,soon"], "'soon' is not a positive duration"),
        (["--gaps", "[10]", "--ttls", "0"], "'0' is not a positive duration"),
        (["--gaps", "[10]", "--prefix-tokens", "-5"], "prefix_tokens must be a positive"),
        (["--gaps", "[10]", "--prefix-tokens", "0"], "prefix_tokens must be a positive"),
        (["--gaps", "[10]", "--releases-per-second", "0"], "releases_per_second must be a positive"),
        (["--gaps", "[10]", "--memory-usd-per-gib-hour", "-1"], "memory_usd_per_gib_hour must be a finite price"),
        (["--gaps", "[10]", "--plot", "/no/such/folder/ttl.png"], "does not exist"),
        (["--trace", "/no/such/trace.jsonl"], "does not exist"),
        (["--url", "CLOSED"], "could not fetch"),
    ],
)
def test_plan_ttl_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    if argv[0] == "--gaps" and not argv[1].startswith("/"):  # the file's text: write it and pass the file
        path = tmp_path / "gaps.json"
        path.write_text(argv[1])
        argv = ["--gaps", str(path), *argv[2:]]
    argv = [closed_port_url() if value == "CLOSED" else value for value in argv]
    assert main(["plan", "ttl", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("prefixserve plan ttl: error: ")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_plan_ttl_needs_exactly_one_source(capsys):
    for argv in ([], ["--gaps", "a", "--trace", "conversation"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "ttl", *argv])
        assert exit_info.value.code == 2
    assert "one of the arguments --gaps --url --trace is required" in capsys.readouterr().err


def test_plan_ttl_labels_every_number_it_was_not_given(tmp_path, capsys):
    gaps = tmp_path / "gaps.json"
    gaps.write_text("[30, 90, 400]")
    assert main(["plan", "ttl", "--gaps", str(gaps), "--num-never-returned", "1", "--ttls", "1m"]) == 0
    out = capsys.readouterr().out
    assert "4 prefix releases; 75.0% of them came back" in out
    assert "reuses 2,000 prefix tokens (stated; pass --prefix-tokens)" in out
    assert "(stated: Llama-3-8B on one H100 at 12,000 tokens/s; pass --prefill-seconds-per-token)" in out
    assert "KV 128 KiB a token (stated: Llama-3-8B in bfloat16" in out
    assert "1 releases/s (stated; scales memory and dollars, not the choice)" in out
