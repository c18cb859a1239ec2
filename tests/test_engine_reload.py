"""Hot reload in the engine (LLM.reload): a new version never reuses the old one's KV, in the pool or a tier."""

import pytest
from conftest import make_llm
from reload_helpers import two_versions

SYSTEM = "You are the assistant of a test suite. Answer briefly and never mention these instructions. " * 3
PROMPTS = [SYSTEM + f"Question {index}: what comes next?" for index in range(4)]
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def versions(default_model_dir, tmp_path_factory):
    """(path A, path B, cold greedy tokens of A, of B): two versions with the same KV layout."""
    path_b, cold = two_versions(default_model_dir, tmp_path_factory.mktemp("v2") / "model", 7, PROMPTS, GREEDY)
    return default_model_dir, path_b, cold[default_model_dir], cold[path_b]


def generate(llm):
    from prefixserve import SamplingParams

    return llm.generate(PROMPTS, SamplingParams(**GREEDY))


def test_after_a_reload_nothing_of_the_old_version_matches_and_outputs_are_the_new_models(versions, tmp_path):
    path_a, path_b, cold_a, cold_b = versions
    llm = make_llm(model=str(path_a), kv_host_cache_bytes=64 << 20, kv_disk_cache_dir=str(tmp_path / "disk"))
    assert [out.token_ids for out in generate(llm)] == cold_a
    assert [out.token_ids for out in generate(llm)] == cold_a  # warm: hits on version A
    tiers = llm.engine.tiers
    tiers["disk"].flush()
    num_cached = llm.engine.cache.num_cached_blocks
    num_disk = len(tiers["disk"].keys())
    assert num_cached > 0 and num_disk > 0
    evicted_before = llm.engine.cache.stats.num_evicted_blocks

    report = llm.reload(str(path_b))
    assert report.num_reclaimed_blocks == num_cached  # every old block freed at once, not aged out
    assert report.num_reclaimed_records["disk"] == num_disk
    assert (
        llm.engine.cache.num_cached_blocks == 0
        and llm.engine.cache.pool.num_free_blocks == llm.engine.cache.pool.num_blocks
    )
    assert tiers["disk"].keys() == [] and tiers["host"].keys() == []
    assert llm.engine.cache.stats.num_evicted_blocks == evicted_before  # reclaimed, not evicted
    assert report.model_fingerprint != report.previous_fingerprint

    outputs = generate(llm)
    assert [out.token_ids for out in outputs] == cold_b  # no wrong hit: version B's own tokens
    assert outputs[0].num_cached_tokens == 0  # the first request after the reload found nothing
    assert [out.token_ids for out in generate(llm)] == cold_b  # and warm on B
    llm.engine.cache.check_integrity()
    tiers["disk"].check_integrity()
    tiers["host"].check_integrity()


def test_reloading_back_serves_the_first_version_again_from_a_cold_cache(versions):
    path_a, path_b, cold_a, cold_b = versions
    llm = make_llm(model=str(path_a))
    generate(llm)
    llm.reload(str(path_b))
    generate(llm)
    llm.reload(None)  # the served path again: B
    assert [out.token_ids for out in generate(llm)] == cold_b
    llm.reload(str(path_a))
    outputs = generate(llm)
    assert [out.token_ids for out in outputs] == cold_a
    assert outputs[0].num_cached_tokens == 0


def test_a_reload_that_cannot_work_changes_nothing(versions, tmp_path):
    from model_helpers import qwen2_config, write_random_checkpoint

    from prefixserve.engine.operations.reload import IncompatibleModelError

    path_a, _, cold_a, _ = versions
    llm = make_llm(model=str(path_a))
    generate(llm)
    with pytest.raises(FileNotFoundError):
        llm.reload(str(tmp_path / "missing"))
    other = write_random_checkpoint(tmp_path / "qwen2", qwen2_config(), seed=1)
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):  # the checkpoint needs a tokenizer: A's
        shutil.copy(path_a / name, other / name)
    with pytest.raises(IncompatibleModelError, match="restart"):
        llm.reload(str(other))
    outputs = generate(llm)
    assert [out.token_ids for out in outputs] == cold_a
    assert outputs[0].num_cached_tokens > 0  # the old version's cache is intact


def test_a_request_made_before_a_reload_is_refused_after_it(versions):
    from prefixserve import SamplingParams

    path_a, path_b, _, _ = versions
    llm = make_llm(model=str(path_a))
    stale = llm.engine.make_request(PROMPTS[0], SamplingParams(**GREEDY))
    llm.reload(str(path_b))
    with pytest.raises(ValueError, match="make it again"):
        llm.engine.submit(stale)


def test_the_old_versions_remote_records_stay_for_other_replicas_until_the_operator_purges_them(
    versions, redis_server, tier_secret_file
):
    import redis

    path_a, path_b, _, cold_b = versions
    client = redis.Redis.from_url(redis_server.url)
    llm = make_llm(model=str(path_a), kv_remote_url=redis_server.url, kv_tier_secret_file=tier_secret_file)
    generate(llm)
    llm.engine.tiers.tiers["remote"].flush()
    old = llm.engine.scope.digest.hex().encode()
    assert len(list(client.scan_iter(match=b"*" + old + b"*"))) > 0
    llm.reload(str(path_b))  # a rolling deploy: other replicas may still read version A's records
    assert len(list(client.scan_iter(match=b"*" + old + b"*"))) > 0
    assert [out.token_ids for out in generate(llm)] == cold_b
    with pytest.raises(ValueError, match="remote tier"):
        make_llm(model=str(path_a)).reload(str(path_b), purge_remote=True)
    llm.reload(str(path_a))
    llm.reload(str(path_b), purge_remote=True)  # the last replica moved: version A's records go now
    assert list(client.scan_iter(match=b"*" + old + b"*")) == []
    new = llm.engine.scope.digest.hex().encode()
    llm.engine.tiers.tiers["remote"].flush()
    assert [out.token_ids for out in generate(llm)] == cold_b
    llm.engine.tiers.tiers["remote"].flush()
    assert len(list(client.scan_iter(match=b"*" + new + b"*"))) > 0  # the serving version's records stay


def relowered_copy(source, directory):
    """`source` with a tokenizer that lowercases first: another tokenizer (fingerprint) on the same weights."""
    import json
    import shutil

    shutil.copytree(source, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


def test_a_reload_swaps_one_version_that_every_reader_sees(versions, tmp_path):
    import dataclasses

    from prefixserve import SamplingParams
    from prefixserve.model import Tokenizer

    path_a, path_b, _, _ = versions
    path_c = relowered_copy(path_b, tmp_path / "lowercased")
    llm = make_llm(model=str(path_a))
    first = llm.engine.version
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.max_model_len = 1  # a version never changes: a reload replaces it whole
    shared = llm.engine.tokenizer.encode(SYSTEM)
    assert llm.engine.declare_shared_prefix(shared) > 0

    llm.reload(str(path_b))  # the same tokenizer: the declared public prefix keeps its meaning
    assert llm.engine.scoper.shared_prefixes and llm.engine.version is not first
    assert llm.engine.runner.model is llm.engine.version.model
    assert llm.engine.max_model_len == first.max_model_len

    llm.reload(str(path_c))  # another tokenizer: token ids, text and shared prefixes all follow it
    served, expected = llm.engine.version, Tokenizer.from_dir(path_c)
    assert served.tokenizer.fingerprint == expected.fingerprint != first.tokenizer.fingerprint
    assert llm.engine.scoper.shared_prefixes == []
    request = llm.engine.make_request(PROMPTS[0], SamplingParams(**GREEDY))
    assert request.prompt_token_ids == expected.encode(PROMPTS[0]) != first.tokenizer.encode(PROMPTS[0])
    output = llm.generate([PROMPTS[0]], SamplingParams(**GREEDY))[0]
    assert output.text == expected.decode(output.token_ids)
    assert llm.engine.runner.model is served.model and llm.engine.scope == served.scope
