"""The shared tiers are a trust boundary (issue 23): what an attacker who can write Redis or a cache
directory tries, and what each replica does about it.

Forged records (another prompt's KV under this prompt's key, parent, scope and token ids), records
planted for a prompt nobody has sent, a genuine record replayed under another key, another tenant's
encrypted record, NaN payloads: each is refused before it reaches the pool, counted by reason, and
the answer is what a tier-less engine gives. A FIFO under a record's name, at run time or at
start-up, a hung read, a wrong-type Redis value and a deleted cache directory cost a recompute,
never a hang.
"""

from __future__ import annotations

import os
import random
import shutil
import struct
import threading

import pytest
from conftest import TIER_SECRET, make_llm
from tier_helpers import BLOCK_SIZE, SCOPE, make_chain

from prefixserve import SamplingParams
from prefixserve.tiers import BlockRecord, DiskTier, HostTier, Keyring, RecordExpectation, Sealer, read_header
from prefixserve.tiers.record import RecordError, decode_record, encode_record

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX_LEN = 160  # 10 blocks of 16
ATTACKER = Sealer(Keyring.from_secret("the attacker's own secret, 32+ chars long"))


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(PREFIX_LEN)] + [5, 6, 7]


def tokens_of(llm, batch, salt=None):
    items = [{"prompt_token_ids": p, "cache_salt": salt} if salt else p for p in batch]
    return [out.token_ids for out in llm.generate(items, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of a tier-less, cache-less engine: what every attacked replica must still answer."""
    llm = make_llm(enable_prefix_caching=False)
    batch = [prompt(seed) for seed in range(3)]
    return batch, tokens_of(llm, batch)


def payload_of(data: bytes) -> bytes:
    header = read_header(data)
    return data[header.header_length : header.header_length + header.payload_length]


def forged(data: bytes, payload: bytes, sealer) -> bytes:
    """The record's key, parent, scope and token ids with another payload, re-encoded (as an attacker can)."""
    header = read_header(data)
    return encode_record(
        BlockRecord(
            header.key, header.parent_key, header.scope_digest, header.token_ids, header.dtype, header.shape, payload
        ),
        sealer,
    )


# ------------------------------------------------------------------ Redis, across replicas
@pytest.mark.parametrize("attacker_seal", [None, ATTACKER], ids=["crc-only", "attackers-secret"])
def test_forged_records_in_redis_are_refused_and_the_answer_is_unchanged(
    reference, redis_server, tier_secret_file, attacker_seal
):
    (q, x, _), (expected_q, expected_x, _) = reference
    options = dict(kv_remote_url=redis_server.url, kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    writer = make_llm(**options)
    assert tokens_of(writer, [q, x]) == [expected_q, expected_x]
    writer.engine.tiers.tiers["remote"].flush()
    client = redis_server.client()
    records = {name: client.get(name) for name in client.keys("pskv:*")}
    by_tokens = {read_header(data).token_ids: data for data in records.values()}
    q_blocks = [tuple(q[i : i + 16]) for i in range(0, PREFIX_LEN, 16)]
    x_blocks = [tuple(x[i : i + 16]) for i in range(0, PREFIX_LEN, 16)]
    for name, data in records.items():
        tokens = read_header(data).token_ids
        if tokens in q_blocks:  # Q's block i now carries X's block i
            client.set(name, forged(data, payload_of(by_tokens[x_blocks[q_blocks.index(tokens)]]), attacker_seal))
    reader = make_llm(**options)
    out = reader.generate([q], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected_q
    assert out.cached_tokens_by_tier["remote"] == 0
    remote = reader.engine.tiers.tiers["remote"]
    assert remote.rejections == {"auth": 1} and remote.stats.rejected_records == 1
    # the refused record was deleted, the rest stay refused: a second look accepts nothing either
    assert reader.generate([q], GREEDY, use_tqdm=False)[0].token_ids == expected_q


def test_records_planted_for_a_prompt_nobody_sent_are_refused(reference, redis_server, tier_secret_file):
    (q, x, p), (expected_q, _, expected_p) = reference
    options = dict(kv_remote_url=redis_server.url, kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    writer = make_llm(**options)
    tokens_of(writer, [x])
    writer.engine.tiers.tiers["remote"].flush()
    client = redis_server.client()
    x_records = [client.get(name) for name in client.keys("pskv:*")]
    engine = writer.engine
    salt = "tenant-planted"
    scope, _ = engine.scoper.scope_for(p, salt)  # computable from the public weights and the tenant's salt
    keys = engine.keyer.keys(scope, p)
    prefix = b"pskv:" + engine.scope.digest.hex().encode() + b":"
    parent = None
    for index, key in enumerate(keys[: PREFIX_LEN // 16]):
        template = read_header(x_records[index])
        record = BlockRecord(
            key,
            parent,
            template.scope_digest,
            tuple(p[index * 16 : (index + 1) * 16]),
            template.dtype,
            template.shape,
            payload_of(x_records[index]),
        )
        client.set(prefix + key.hex().encode(), encode_record(record))
        parent = key
    reader = make_llm(**options)
    assert tokens_of(reader, [p], salt=salt) == [expected_p]
    assert reader.engine.tiers.tiers["remote"].rejections == {"auth": 1}


def test_a_genuine_record_replayed_under_another_key_is_refused(redis_server, tier_secret_file, reference):
    (q, x, _), (expected_q, _, _) = reference
    options = dict(kv_remote_url=redis_server.url, kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    writer = make_llm(**options)
    tokens_of(writer, [q, x])
    writer.engine.tiers.tiers["remote"].flush()
    client = redis_server.client()
    records = {name: client.get(name) for name in client.keys("pskv:*")}
    q_first = [name for name, data in records.items() if read_header(data).token_ids == tuple(q[:16])][0]
    x_first = [data for data in records.values() if read_header(data).token_ids == tuple(x[:16])][0]
    client.set(q_first, x_first)  # sealed by the fleet, but X's block under Q's name
    reader = make_llm(**options)
    assert tokens_of(reader, [q]) == [expected_q]
    assert reader.engine.tiers.tiers["remote"].rejections == {"key": 1}


def test_a_wrong_type_value_under_a_record_name_is_replaced(redis_server, tier_secret_file, reference):
    (q, _, _), (expected_q, _, _) = reference
    options = dict(kv_remote_url=redis_server.url, kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    writer = make_llm(**options)
    tokens_of(writer, [q])
    remote = writer.engine.tiers.tiers["remote"]
    remote.flush()
    client = redis_server.client()
    names = sorted(client.keys("pskv:*"))
    client.delete(names[0])
    client.rpush(names[0], b"not", b"a", b"record")  # a list: GET fails WRONGTYPE, EXISTS says present
    other = make_llm(**options)
    assert tokens_of(other, [q]) == [expected_q]  # reads it, refuses it, recomputes, writes the record back
    other.engine.tiers.tiers["remote"].flush()
    assert client.type(names[0]) == b"string"
    third = make_llm(**options)
    out = third.generate([q], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected_q and out.cached_tokens_by_tier["remote"] == PREFIX_LEN


def test_the_remote_tier_needs_a_secret_or_an_explicit_insecure(redis_server, caplog):
    with pytest.raises(ValueError, match="kv_tier_secret_file"):
        make_llm(kv_remote_url=redis_server.url)
    with caplog.at_level("WARNING", logger="prefixserve"):
        make_llm(kv_remote_url=redis_server.url, kv_remote_insecure=True)
    assert any("not sealed" in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError, match="kv_tier_encrypt needs kv_tier_secret_file"):
        make_llm(kv_tier_encrypt=True)


# ------------------------------------------------------------------ encryption per tenant
def test_encrypted_records_reveal_no_tokens_or_kv_and_open_for_no_other_tenant(reference, tmp_path, tier_secret_file):
    (q, _, _), (expected_q, _, _) = reference
    options = dict(
        kv_disk_cache_dir=str(tmp_path),
        kv_tier_secret_file=tier_secret_file,
        kv_tier_encrypt=True,
        kv_fetch_policy="always",
    )
    writer = make_llm(**options)
    assert tokens_of(writer, [q], salt="tenant-a") == [expected_q]
    writer.engine.tiers["disk"].flush()
    plain = make_llm(kv_disk_cache_dir=str(tmp_path / "plain"), kv_fetch_policy="always")
    tokens_of(plain, [q], salt="tenant-a")
    plain.engine.tiers["disk"].flush()
    files = sorted(tmp_path.glob("??/*.kv"))
    plain_files = sorted((tmp_path / "plain").glob("??/*.kv"))
    assert files and len(files) == len(plain_files)
    first_block = struct.pack(f"<{16}I", *q[:16])
    for path, plain_path in zip(files, plain_files):
        data = path.read_bytes()
        assert first_block not in data and struct.pack("<4I", *q[16:20]) not in data
        plain_payload = payload_of(plain_path.read_bytes())
        assert plain_payload[:256] not in data  # no 256-byte run of any block's KV
    writer.close()
    # the same records, read by tenant b's requests through the same keys: every one opens under tenant a's
    # key only (the chain is tenant-salted, so here we hand tenant b's key the record directly)
    sealer = writer.engine.tiers["disk"].sealer
    data = files[0].read_bytes()
    header = read_header(data)
    scope_a, _ = writer.engine.scoper.scope_for(q, "tenant-a")
    scope_b, _ = writer.engine.scoper.scope_for(q, "tenant-b")
    for scope, opens in ((scope_a, True), (scope_b, False)):
        expect = RecordExpectation(header.key, header.scope_digest, None, header.dtype, header.shape, scope)
        if opens:
            decode_record(data, expect, sealer)
        else:
            with pytest.raises(RecordError, match="auth"):
                decode_record(data, expect, sealer)
    restarted = make_llm(**options)
    out = restarted.generate([{"prompt_token_ids": q, "cache_salt": "tenant-a"}], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected_q and out.cached_tokens_by_tier["disk"] == PREFIX_LEN


def test_a_shared_prefix_is_sealed_under_the_public_scope_and_the_rest_under_the_tenants():
    """Past a declared shared prefix the chain forks into the tenant's private scope: the blocks before it
    are sealed for every tenant, the blocks after it for that tenant only (Request.block_scope)."""
    from prefixserve.engine.request import Request

    request = Request("r", list(range(64)), GREEDY, scope_digest=b"public", private_from=(2, b"tenant"))
    assert [request.block_scope(i) for i in range(4)] == [b"public", b"public", b"tenant", b"tenant"]
    assert Request("s", [1], GREEDY, scope_digest=b"own").block_scope(3) == b"own"


# ------------------------------------------------------------------ payloads and files
def test_a_sealed_record_holding_nan_is_refused(reference, tmp_path, tier_secret_file):
    (q, _, _), (expected_q, _, _) = reference
    options = dict(kv_disk_cache_dir=str(tmp_path), kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    writer = make_llm(**options)
    tokens_of(writer, [q])
    writer.close()
    fleet = Sealer(Keyring.from_secret(TIER_SECRET))  # a replica with a bug: sealed, but NaN
    victim = sorted(tmp_path.glob("??/*.kv"), key=lambda path: read_header(path.read_bytes()).parent_key is not None)[0]
    data = victim.read_bytes()
    nan = struct.pack("<f", float("nan")) * (len(payload_of(data)) // 4)
    victim.write_bytes(forged(data, nan, fleet))
    reader = make_llm(**options)
    out = reader.generate([q], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == expected_q and out.cached_tokens_by_tier["disk"] == 0
    assert reader.engine.tiers["disk"].rejections == {"nonfinite": 1}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_under_a_record_name_never_blocks_a_read_or_the_start_up(reference, tmp_path, tier_secret_file):
    (q, _, _), (expected_q, _, _) = reference
    options = dict(kv_disk_cache_dir=str(tmp_path), kv_tier_secret_file=tier_secret_file, kv_fetch_policy="always")
    llm = make_llm(**options)
    tokens_of(llm, [q])
    disk = llm.engine.tiers["disk"]
    disk.flush()
    path = sorted(tmp_path.glob("??/*.kv"))[0]
    os.unlink(path)
    os.mkfifo(path)  # no writer ever opens it: a blocking open() waits forever
    llm.engine.cache.clear()  # the next request reads the disk
    done = threading.Event()
    result: list = []

    def ask():
        result.append(tokens_of(llm, [q]))
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    assert done.wait(120), "a read of the FIFO blocked the request"
    assert result == [[expected_q]]
    assert disk.stats.rejected_records == 1
    llm.close()
    if not path.exists():  # the read removed it (and the recompute may have written the record back)
        os.mkfifo(path)
    elif not path.is_fifo():
        os.unlink(path)
        os.mkfifo(path)
    started: list = []
    thread = threading.Thread(target=lambda: started.append(DiskTier(tmp_path, 64 << 20)), daemon=True)
    thread.start()
    thread.join(60)
    assert started, "the disk tier's start-up blocked on a FIFO"
    tier = started[0]
    assert tier.rebuild_report.num_records > 0 and path.is_fifo()  # skipped, never opened
    tier.close()


def test_a_hung_read_costs_one_deadline_and_the_request_recomputes(reference, tmp_path):
    """A tier whose reads never return (a dead NFS mount): the request waits the deadline, recomputes with
    the same tokens, the tier is counted slow and is skipped while that read is still stuck."""
    (q, x, _), (expected_q, expected_x, _) = reference
    llm = make_llm(kv_disk_cache_dir=str(tmp_path), kv_fetch_policy="always", kv_tier_deadline=0.2)
    tokens_of(llm, [q, x])
    disk = llm.engine.tiers["disk"]
    disk.flush()
    release = threading.Event()
    real_get = disk.get

    def hung_get(keys):
        release.wait(60)  # far past the deadline: only giving up on it answers sooner
        return real_get(keys)

    disk.get = hung_get
    try:
        llm.engine.cache.clear()  # the next requests look in the disk tier
        assert tokens_of(llm, [q]) == [expected_q]
        assert not release.is_set()  # answered while the read was still stuck
        assert disk.stats.slow_reads == 1
        assert tokens_of(llm, [x]) == [expected_x]  # the stalled tier is skipped: no second wait
        assert disk.stats.slow_reads == 1
    finally:
        release.set()


def test_a_deleted_cache_directory_reports_nothing_held_and_is_written_again(tmp_path):
    directory = tmp_path / "kv"
    tier = DiskTier(directory, 1 << 20)
    records = make_chain(list(range(8 * BLOCK_SIZE)))
    tier.put(records)
    assert tier.used_bytes > 0
    shutil.rmtree(directory)
    assert tier.used_bytes == 0 and tier.keys() == []
    assert tier.get([records[0].key]) == [None]
    tier.put(records)
    assert tier.contains([record.key for record in records]) == len(records) and tier.used_bytes > 0
    tier.check_integrity()
    tier.close()


# ------------------------------------------------------------------ keyring and rotation
def test_a_secret_is_rolled_in_while_the_old_ones_records_are_accepted_for_the_stated_window(tmp_path):
    old, new = "o" * 40, "n" * 40
    record = make_chain(list(range(BLOCK_SIZE)))[0]
    expect = RecordExpectation(record.key, SCOPE, record.token_ids, record.dtype, record.shape)
    sealed_old = encode_record(record, Sealer(Keyring.from_secret(old)))
    secret_file = tmp_path / "secret"
    secret_file.write_text(f"# rolled in on 2026-12-02\n{new}\n{old} until=2999-01-01T00:00:00Z\n")
    rolled = Sealer(Keyring.from_file(secret_file))
    assert decode_record(sealed_old, expect, rolled).payload == record.payload  # old records still read
    sealed_new = encode_record(record, rolled)
    assert read_header(sealed_new).key_id == Keyring.from_secret(new).sealing.key_id  # new ones under the new
    secret_file.write_text(f"{new}\n{old} until=2020-01-01T00:00:00Z\n")  # the window has passed
    expired = Sealer(Keyring.from_file(secret_file))
    with pytest.raises(RecordError, match="auth"):
        decode_record(sealed_old, expect, expired)
    decode_record(sealed_new, expect, expired)


@pytest.mark.parametrize(
    "text,message",
    [
        ("short\n", "at least 32 characters"),
        ("", "holds no secret"),
        (f"{'a' * 40} until=2999-01-01T00:00:00Z\n", "takes no until="),
        (f"{'a' * 40}\n{'b' * 40}\n", "add until="),
        (f"{'a' * 40}\n{'b' * 40} until=tomorrow\n", "ISO 8601"),
        (f"{'a' * 40}\n{'a' * 40} until=2999-01-01T00:00:00Z\n", "appears twice"),
    ],
)
def test_a_bad_secret_file_is_refused_naming_the_fix(tmp_path, text, message):
    path = tmp_path / "secret"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Keyring.from_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        Keyring.from_file(tmp_path / "missing")


def test_every_tier_seals_what_it_stores(tmp_path):
    sealer = Sealer(Keyring.from_secret(TIER_SECRET))
    records = make_chain(list(range(2 * BLOCK_SIZE)))
    for tier in (HostTier(1 << 20, sealer=sealer), DiskTier(tmp_path, 1 << 20, sealer=sealer)):
        tier.put(records)
        stored = tier.get([records[0].key])[0]
        assert read_header(stored).seal == sealer.seal
        with pytest.raises(RecordError, match="auth"):
            decode_record(
                stored, RecordExpectation(records[0].key, SCOPE, records[0].token_ids, "float32", records[0].shape)
            )  # a reader without the secret
        tier.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_finite_check_finds_one_nan_or_infinity_in_any_dtype(dtype):
    import torch

    from prefixserve.engine.tier_reader import TORCH_DTYPES, payload_is_finite

    values = torch.linspace(-1e3, 1e3, 4096).to(TORCH_DTYPES[dtype])
    assert payload_is_finite(values.view(torch.uint8).numpy().tobytes(), dtype)
    for bad in (float("nan"), float("inf"), float("-inf")):
        spoiled = values.clone()
        spoiled[2047] = bad
        assert not payload_is_finite(spoiled.view(torch.uint8).numpy().tobytes(), dtype), (dtype, bad)
    assert payload_is_finite(b"", dtype)
