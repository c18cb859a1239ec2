import hashlib

import pytest

from prefixserve.cache import BlockKeyer, CacheScope, pack_tokens

SCOPE = CacheScope("model-a", "tok-a")


def test_block_key_chains_scope_and_tokens_with_sha256():
    keyer = BlockKeyer(block_size=4)
    tokens = list(range(10))
    keys = keyer.keys(SCOPE.digest, tokens)
    assert len(keys) == 2  # the partial tail block of 2 tokens gets no key
    expected0 = hashlib.sha256(SCOPE.digest + pack_tokens([0, 1, 2, 3])).digest()
    expected1 = hashlib.sha256(expected0 + pack_tokens([4, 5, 6, 7])).digest()
    assert keys == [expected0, expected1]


def test_incremental_extend_equals_one_pass():
    keyer = BlockKeyer(block_size=16)
    tokens = list(range(1000, 1100))
    keys: list[bytes] = []
    for end in range(0, len(tokens) + 1, 7):
        keyer.extend(keys, SCOPE.digest, tokens[:end])
    keyer.extend(keys, SCOPE.digest, tokens)
    assert keys == keyer.keys(SCOPE.digest, tokens)
    assert len(keys) == 6


@pytest.mark.parametrize(
    "other",
    [
        CacheScope("model-b", "tok-a"),
        CacheScope("model-a", "tok-b"),
        CacheScope("model-a", "tok-a", adapter_id="lora-1"),
        CacheScope("model-a", "tok-a", cache_salt="tenant-2"),
    ],
)
def test_every_scope_field_changes_every_key(other):
    keyer = BlockKeyer(block_size=16)
    tokens = list(range(64))
    ours, theirs = keyer.keys(SCOPE.digest, tokens), keyer.keys(other.digest, tokens)
    assert not set(ours) & set(theirs)


def test_scope_fields_are_length_prefixed():
    # Naive concatenation would make ("ab", "c") and ("a", "bc") the same scope.
    assert CacheScope("ab", "c").digest != CacheScope("a", "bc").digest
    assert SCOPE.with_salt("t1").digest == CacheScope("model-a", "tok-a", cache_salt="t1").digest


def test_xxh3_is_selectable_and_differs_from_sha256():
    tokens = list(range(32))
    fast = BlockKeyer(16, "xxh3_128").keys(SCOPE.digest, tokens)
    assert len(fast) == 2 and all(len(key) == 16 for key in fast)
    assert fast != BlockKeyer(16).keys(SCOPE.digest, tokens)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="unknown prefix hash function 'md5'"):
        BlockKeyer(16, "md5")
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        BlockKeyer(0)
    with pytest.raises(ValueError, match="model_fingerprint"):
        CacheScope("", "tok")


def test_private_chain_forks_after_a_public_prefix():
    keyer = BlockKeyer(block_size=4)
    tokens = list(range(16))
    tenant_a, tenant_b = SCOPE.with_salt("a").digest, SCOPE.with_salt("b").digest
    public = keyer.keys(SCOPE.digest, tokens)
    keys_a = keyer.keys(SCOPE.digest, tokens, private_from=(2, tenant_a))
    keys_b = keyer.keys(SCOPE.digest, tokens, private_from=(2, tenant_b))
    assert keys_a[:2] == keys_b[:2] == public[:2]  # the shared prefix is the public one
    assert len({keys_a[2], keys_b[2], public[2]}) == 3 and keys_a[3] != keys_b[3]
    # Incremental extension forks at the same place.
    grown: list[bytes] = []
    for end in (3, 9, 16):
        keyer.extend(grown, SCOPE.digest, tokens[:end], (2, tenant_a))
    assert grown == keys_a


def test_the_last_token_rule_is_one_function():
    from prefixserve.cache import max_hit_blocks

    # n tokens in blocks of 16 may hit (n - 1) // 16 full blocks: the last token is always computed
    assert [max_hit_blocks(n, 16, n // 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 0, 0, 0, 1, 1, 2]
    assert max_hit_blocks(100, 16, 3) == 3  # never more than the keys given
    assert max_hit_blocks(5, 1, 5) == 4  # a trace replay: one id a block
