"""prefixserve on a real two-node Ray cluster: `serve run prefixserve.ray:build_app`, replicas on both nodes,
shared-prefix repeats hit through our request router, a node's raylet killed mid-run costs no request.

Marked `platforms` (.ci/run installs `prefixserve[ray]` and runs the group after the README's command). Ray
binds the machine's interface address whatever it is asked, so the cluster, Serve and the client run in a
network namespace of this test's own with only loopback up (root and `ip` needed; deleted afterwards).
Each node is a raylet of its own (`ray start --head` and `ray start --address`, 1 CPU each), so with one
CPU per engine replica the two replicas must land on different nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.platforms
pytest.importorskip("ray.serve", reason='Ray Serve is the optional extra: pip install "prefixserve[ray]"')

REPO = Path(__file__).resolve().parent.parent
GCS_PORT, HTTP_PORT = 6379, 8000  # inside the namespace nothing else listens
DOOMED = "prefixserve_test_lost_node"  # the custom resource that marks the node the test takes away


def _ray_tool(name: str) -> str:
    """The `ray` / `serve` console script of the interpreter running the tests."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"Ray's {name!r} command is not installed beside {sys.executable}")
    return found


class LoopbackNamespace:
    def __init__(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.fail("the Ray test needs root and iproute2's `ip` for its loopback-only network namespace")
        self.name = f"psray{os.getpid()}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"], check=True)

    def run(self, command: list[str], env: dict, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["ip", "netns", "exec", self.name, *command],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(command[:3])} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def delete(self) -> None:
        # Whatever still runs in the namespace (a raylet, workers) goes with it.
        pids = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", self.name], check=False)


@pytest.fixture
def cluster():
    namespace = LoopbackNamespace()
    temp = tempfile.mkdtemp(prefix="psray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    ray = _ray_tool("ray")
    try:
        namespace.run(
            [
                ray,
                "start",
                "--head",
                "--port",
                str(GCS_PORT),
                "--num-cpus",
                "1",
                "--temp-dir",
                temp,
                "--resources",
                json.dumps({"prefixserve_ingress": 1}),
                "--include-dashboard",
                "false",
                "--disable-usage-stats",
            ],
            env,
            120,
        )
        namespace.run(
            [
                ray,
                "start",
                "--address",
                f"127.0.0.1:{GCS_PORT}",
                "--num-cpus",
                "1",
                "--resources",
                json.dumps({DOOMED: 1}),
            ],
            env,
            120,
        )
        yield namespace, env
    finally:
        namespace.run([ray, "stop", "--force"], env, 60, check=False)
        namespace.delete()
        shutil.rmtree(temp, ignore_errors=True)


def _serve(namespace: LoopbackNamespace, env: dict, *app_args: str) -> dict:
    """`serve run prefixserve.ray:build_app` with these arguments, then the client's report (ray_serve_client.py)."""
    address = f"127.0.0.1:{GCS_PORT}"
    serve = _ray_tool("serve")
    namespace.run(
        [
            serve,
            "start",
            "--address",
            address,
            "--proxy-location",
            "HeadOnly",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(HTTP_PORT),
        ],
        env,
        120,
    )
    namespace.run(
        [
            serve,
            "run",
            "--address",
            address,
            "--non-blocking",
            "prefixserve.ray:build_app",
            "num_cpus=1",
            'ingress_resources={"prefixserve_ingress": 0.01}',
            *app_args,
        ],
        env,
        300,
    )
    mode = ["pd"] if any(arg.startswith("prefill_replicas=") for arg in app_args) else []
    done = namespace.run(
        [
            sys.executable,
            str(REPO / "tests" / "ray_serve_client.py"),
            address,
            f"http://127.0.0.1:{HTTP_PORT}",
            DOOMED,
            *mode,
        ],
        env,
        400,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(report))  # shown when an assertion fails
    return report


def test_two_node_cluster_serves_routes_and_survives_a_lost_node(cluster):
    namespace, env = cluster
    report = _serve(namespace, env, "num_replicas=2")

    # One engine replica per node (each node has the one CPU a replica takes), the doomed node among them.
    assert len(report["engine_nodes"]) == 2 and len(set(report["engine_nodes"])) == 2
    assert report["doomed_nodes"][0] in report["engine_nodes"]

    # Every turn after a session's first finds the session's prefix where the router sent it before.
    later = [row for row in report["repeats"] if row[1] > 0]
    hits = [row for row in later if row[3] >= 48]  # the shared 48 words span several 16-token blocks
    assert len(hits) >= 0.9 * len(later), report["repeats"]

    passed = report["pass_through"]
    assert passed["stream_status"] == 200 and passed["stream_done"] and passed["stream_chunks"] >= 3
    assert passed["messages_status"] == 200 and passed["messages_type"] == "message"
    assert 400 <= passed["bad_status"] < 500 and passed["bad_param"] == "max_tokens"  # the replica's own 4xx

    # The raylet killed mid-run, traffic on until the cluster declared the node dead and after: every request
    # answered (one caught on the lost replica goes to the other).
    loss = report["node_loss"]
    assert loss["node_declared_dead"], loss
    assert loss["statuses"] == [200] * len(loss["statuses"]), loss


def test_prefill_replicas_hand_prompts_over_the_shared_tier(cluster, tmp_path):
    """prefill_replicas=1 beside one engine (decode) replica, a Redis both reach: each new prompt's KV is computed
    on the prefill replica and fetched by the engine replica from the remote tier; its repeat hits the engine's
    own pool; the text is the same either way."""
    namespace, env = cluster
    if shutil.which("redis-server") is None:
        pytest.fail("the P/D test needs redis-server (.ci/run installs Debian's)")
    secret = tmp_path / "fleet.secret"
    secret.write_text("9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0\n")
    secret.chmod(0o600)
    redis = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            namespace.name,
            "redis-server",
            "--port",
            "6380",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        report = _serve(
            namespace,
            env,
            "num_replicas=1",
            "prefill_replicas=1",
            "kv_remote_url=redis://127.0.0.1:6380",
            f"kv_tier_secret_file={secret}",
        )
    finally:
        redis.kill()
        redis.wait(timeout=30)
    assert len(report["engine_nodes"]) == 1 and len(report["prefill_nodes"]) == 1
    assert report["engine_nodes"] != report["prefill_nodes"]  # one CPU each: the two nodes
    first, repeat = [row for row in report["pd"] if row[0] == 0], [row for row in report["pd"] if row[0] == 1]
    for (_, tokens, tiers, text), (_, _, again, text_again) in zip(first, repeat):
        assert tiers["remote"] >= tokens - 16 and tiers["device"] == 0, report["pd"]  # all but the partial tail
        assert again["device"] >= tokens - 16, report["pd"]
        assert text == text_again
