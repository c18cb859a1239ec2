"""The sliding-window layers' own pool (issue 27, cache/window_slots.py): a running request holds only the blocks its
window covers on those layers, a cached prefix hits only where its last window is still held, and no token
changes for it: against transformers, against the engine with one pool for every layer, through reuse of
the window slots, and through a disk tier that brings them back."""

from __future__ import annotations

import pytest
from conftest import make_llm
from model_helpers import gemma3_config, mistral_config, write_servable_checkpoint
from test_engine_reference import transformers_greedy

from prefixserve import SamplingParams
from prefixserve.cache import Block
from prefixserve.cache.window_slots import WindowSlots

NUM_TOKENS = 12
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
STORY = (
    "Each window layer reads the last twenty keys of its row, so the blocks below them are released on "
    "those layers while the global layer keeps every one of them for the whole sequence. "
)
OPTIONS = {"max_num_batched_tokens": 32, "kv_cache_memory_bytes": 1 << 20}


def blocks(*ids: int) -> list[Block]:
    return [Block(block_id) for block_id in ids]


# ----------------------------------------------------------------- the bookkeeping alone
def test_detached_slots_stay_findable_until_reused_least_recent_first():
    slots = WindowSlots(num_blocks=8, num_slots=3, window=20, block_size=16)
    slots.attach([0, 1, 2])
    assert slots.num_held == 3 and not slots.can_attach((), 1)
    slots.detach([0])
    slots.detach([1])
    assert slots.num_idle == 2 and slots.slot_of[0] >= 0  # idle: K/V kept
    assert slots.can_attach([0], 1)  # 0 comes back from idle, 1's slot goes to a new block
    slots.attach([3])
    assert slots.slot_of[0] == -1 and slots.slot_of[1] >= 0 and slots.num_reused == 1  # 0 left first
    slots.detach([2, 3])
    slots.drop(3)
    assert slots.slot_of[3] == -1 and slots.num_held == 0 and slots.num_idle == 2


def test_a_match_is_cut_where_its_window_is_not_held():
    slots = WindowSlots(num_blocks=8, num_slots=8, window=20, block_size=16)
    hit = blocks(0, 1, 2, 3, 4)
    slots.attach([0, 1, 2, 3, 4])
    assert slots.usable_hit(hit) == 5
    slots.detach([3])
    slots.drop(3)  # block 3's window K/V gone: matches reading it are cut
    # 5 blocks -> first key 61 (block 3); 4 -> key 45 (block 2, 3); 3 -> key 29 (blocks 1, 2): usable
    assert slots.usable_hit(hit) == 3
    slots.drop(0)
    assert slots.usable_hit(hit) == 3  # block 0 lies below the 3-block match's window
    slots.drop(1)
    assert slots.usable_hit(hit) == 0  # 3 blocks need 1 and 2; 2 blocks (first key 13) and 1 need block 0


def test_a_merged_duplicate_hands_its_slot_and_users_to_the_kept_copy():
    slots = WindowSlots(num_blocks=4, num_slots=4, window=20, block_size=16)
    slots.attach([1])  # the duplicate, attached by the request that computed it
    slots.merge(1, 2)  # the cached copy 2 had no slot
    assert slots.slot_of[1] == -1 and slots.slot_of[2] >= 0 and slots.users[2] == 1
    slots.attach([3])
    slots.detach([3])  # 3 idle, with a slot
    slots.attach([0])
    slots.merge(0, 3)  # the copy has its own slot: the duplicate's is freed
    assert slots.slot_of[0] == -1 and slots.users[3] == 1 and slots.num_held == 2 and slots.num_idle == 0


# ------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def window_model(request, tmp_path_factory):
    config = {"gemma3": gemma3_config, "mistral": mistral_config}[request.param]()
    return write_servable_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=11)


def run_tracking_held(llm, prompt: str) -> tuple[list[int], list[int], int]:
    """(prompt ids, output ids, most window slots held at once) of one request stepped to the end."""
    engine = llm.engine
    request = engine.add_request(prompt, PARAMS)
    most = moved = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.window_slots.num_held)
        start = request.window_start  # where the last step's window began
        moved = max(moved, start)
        # below the window nothing is attached; from it on, every block has its slot
        assert all(engine.window_slots.users[block.block_id] == 0 for block in request.blocks[:start])
        assert all(engine.window_slots.slot_of[block.block_id] >= 0 for block in request.blocks[start:])
    assert moved > 10  # the window went along the sequence
    return request.token_ids[: request.num_prompt_tokens], list(request.output_token_ids), most


def test_a_long_request_holds_only_its_window_and_gives_the_reference_tokens(window_model, attention_path):
    llm = make_llm(model=str(window_model), **OPTIONS)
    engine = llm.engine
    assert engine.window_slots is not None  # window 18-20 keys, 512-token context: a pool of their own
    prompt_ids, output, most = run_tracking_held(llm, STORY * 6)
    assert len(prompt_ids) > 200
    assert output == transformers_greedy(window_model, [prompt_ids], NUM_TOKENS)[0]
    # the window (20 keys) and a 32-token chunk span at most 5 blocks of 16, far fewer than the sequence's
    assert most <= 5 < len(prompt_ids) // 16
    assert engine.window_slots.num_held == 0  # finished: its slots are idle, kept for hits
    warm = llm.generate([STORY * 6], PARAMS, use_tqdm=False)[0]
    assert warm.token_ids == output and warm.num_cached_tokens >= len(prompt_ids) - 16


def test_a_match_whose_window_slots_were_reused_is_cut_and_still_exact(window_model):
    llm = make_llm(model=str(window_model), **OPTIONS)
    engine = llm.engine
    first = llm.generate([STORY * 6], PARAMS, use_tqdm=False)[0]
    others = [f"Request number {i} talks about something else entirely, at length. " * 14 for i in range(6)]
    llm.generate(others, PARAMS, use_tqdm=False)
    assert engine.window_slots.num_reused > 0  # the others' windows took the first request's idle slots
    again = llm.generate([STORY * 6], PARAMS, use_tqdm=False)[0]
    full_blocks = (len(first.prompt_token_ids) - 1) // 16
    assert again.num_cached_tokens < full_blocks * 16  # cut back: its last window's slots were reused
    assert again.token_ids == first.token_ids
    one_pool = make_llm(model=str(window_model), window_kv_release=False, **OPTIONS)
    assert one_pool.engine.window_slots is None
    assert one_pool.generate([STORY * 6], PARAMS, use_tqdm=False)[0].token_ids == first.token_ids


def test_the_same_budget_holds_more_blocks(window_model):
    released = make_llm(model=str(window_model), **OPTIONS).engine
    one_pool = make_llm(model=str(window_model), window_kv_release=False, **OPTIONS).engine
    assert released.cache.pool.num_blocks > one_pool.cache.pool.num_blocks
    assert released.window_slots.num_slots < released.cache.pool.num_blocks
    window_caches = [cache for cache, layer in zip(released.runner.kv_caches, released.runner.window_layers) if layer]
    assert window_caches and all(k.shape[0] == released.window_slots.num_slots for k, _ in window_caches)


def test_a_tier_brings_back_the_window_layers_a_match_lacks(window_model, tmp_path):
    """The first prompt's window slots are reused by others while its blocks stay in the pool: the disk tier
    (written when each block was computed, every layer) restores them, the cached copies take the slots."""
    llm = make_llm(
        model=str(window_model),
        kv_disk_cache_dir=str(tmp_path),
        max_num_batched_tokens=32,
        kv_cache_memory_bytes=600 << 10,
    )
    prompts = [STORY * 6] + [f"Unrelated prompt {i} takes the window slots of the first. " * 10 for i in range(5)]
    cold = [llm.generate([prompt], PARAMS, use_tqdm=False)[0] for prompt in prompts]
    assert llm.engine.window_slots.num_reused > 0
    again = llm.generate([prompts[0]], PARAMS, use_tqdm=False)[0]
    assert (
        llm.engine.tiers.reader.hit_tokens["disk"] > 0 and again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    )
    assert again.token_ids == cold[0].token_ids
    reference = transformers_greedy(window_model, [out.prompt_token_ids for out in cold], NUM_TOKENS)
    assert [out.token_ids for out in cold] == reference
