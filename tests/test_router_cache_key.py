"""OpenAI's prompt_cache_key at the router: requests sharing a key stay on one replica, keys spread over the
fleet, and an overloaded replica's keys overflow to the policy."""

from types import SimpleNamespace

import httpx
import pytest
from router_fakes import fake_fleet, post

from prefixserve.router.cache_key import keyed_replica
from prefixserve.router.settings import RouterSettings


@pytest.fixture(scope="module")
def tokenizer():
    from prefixserve.model.default import default_tokenizer_dir
    from prefixserve.model.tokenizers.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_tokenizer_dir())


def served_by(fakes, before):
    """Index of the one fake that got a request since `before` (request counts per fake)."""
    grew = [i for i, fake in enumerate(fakes) if len(fake.requests) > before[i]]
    assert len(grew) == 1, grew
    return grew[0]


def test_requests_sharing_a_key_stay_on_one_replica_and_keys_spread(tokenizer):
    with fake_fleet(tokenizer, 4) as (url, fakes, router):
        homes = {}
        for round_ in range(3):
            for key in [f"session-{i}" for i in range(12)]:
                before = [len(fake.requests) for fake in fakes]
                body = {
                    "prompt": f"turn {round_} of {key}: a prompt of its own",
                    "max_tokens": 2,
                    "prompt_cache_key": key,
                }
                assert post(url, "/v1/completions", body).status_code == 200
                homes.setdefault(key, set()).add(served_by(fakes, before))
        assert all(len(home) == 1 for home in homes.values())  # never moved: nothing was overloaded
        assert len({next(iter(home)) for home in homes.values()}) >= 3  # 12 keys over 4 replicas
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'prefixserve_router:cache_key_routes_total{outcome="kept"} 36.0' in metrics


def test_an_overloaded_replica_lets_its_keys_overflow():
    replicas = [SimpleNamespace(name=f"replica-{i}", load=0.0) for i in range(3)]
    home = keyed_replica("k", replicas, slack=5.0)
    assert home is keyed_replica("k", list(reversed(replicas)), slack=5.0)  # order does not matter
    home.load = 4.0
    assert keyed_replica("k", replicas, slack=5.0) is home  # busier, within the slack
    home.load = 6.0
    assert keyed_replica("k", replicas, slack=5.0) is None  # overloaded: the policy decides
    rest = [replica for replica in replicas if replica is not home]
    chosen = [keyed_replica(f"key-{i}", replicas, 5.0) for i in range(40)]
    assert all(replica is None or replica in rest for replica in chosen)  # the overloaded one takes none
    for i, replica in enumerate(chosen):  # a replica gone moves only its own keys: the others keep their homes
        if replica is not None:
            assert keyed_replica(f"key-{i}", rest, 5.0) is replica
    assert keyed_replica("k", rest, 5.0) in rest
    with pytest.raises(ValueError, match="--cache-key-slack"):
        RouterSettings(replicas=("http://127.0.0.1:9",), cache_key_slack=-1.0)
