"""InputBatch: step inputs from persistent buffers -- positions, slot mapping, block
table rows written by deltas, decodes first, logits rows, rows given back and reused."""

from __future__ import annotations

from pdserve.engine.input_batch import InputBatch
from pdserve.engine.request import Request
from pdserve.engine.sampling.sampling_params import SamplingParams

BS = 4  # block size


def req(rid: str, prompt: list[int], blocks: list[int], computed: int = 0,
        **params: object) -> Request:
    r = Request(rid, prompt, SamplingParams(**params))  # type: ignore[arg-type]
    r.block_ids = list(blocks)
    r.num_computed_tokens = computed
    return r


def batch() -> InputBatch:
    return InputBatch(max_num_seqs=4, max_model_len=32, max_num_tokens=64, block_size=BS)


def test_prefill_chunk_and_decode_positions_slots_and_order() -> None:
    b = batch()
    # a: 6-token prompt, all of it now (blocks 7, 3); c: a decode at position 9
    a = req("a", list(range(100, 106)), [7, 3])
    c = req("c", list(range(10)), [5, 2, 9], computed=9)
    step = b.prepare([(a, 6), (c, 1)])
    m = step.meta
    assert m.num_decode == 1 and m.query_len_list == [1, 6]  # the decode leads
    assert step.input_ids.tolist() == [9, *range(100, 106)]
    assert m.positions.tolist() == [9, 0, 1, 2, 3, 4, 5]
    # slot = block * BS + offset: position 9 is block index 2 (id 9), offset 1
    assert m.slot_mapping.tolist() == [9 * BS + 1, 28, 29, 30, 31, 12, 13]
    assert m.context_len_list == [10, 6] and m.query_start_list == [0, 1]
    assert step.logits_indices.tolist() == [0, 6]  # both caught up: both sample
    assert [r.request_id for r in step.sampled] == ["c", "a"]


def test_block_rows_grow_by_deltas_and_rows_are_reused() -> None:
    b = batch()
    a = req("a", list(range(8)), [4, 6])
    step = b.prepare([(a, 5)])  # first chunk: 5 of 8 prompt tokens
    row = step.meta.seq_rows_list[0]
    assert b.block_table_np[row, :2].tolist() == [4, 6]
    assert step.logits_indices.tolist() == []  # mid-prompt: nothing samples
    a.num_computed_tokens = 8
    a.token_ids.append(50)
    a.block_ids.append(11)  # a third block for the decode at position 8
    b.block_table_np[row, 0] = -1  # rows are written by deltas: block 0 is not rewritten
    step = b.prepare([(a, 1)])
    assert step.meta.seq_rows_list == [row]
    assert b.block_table_np[row, :3].tolist() == [-1, 6, 11]
    assert step.meta.slot_mapping.tolist() == [11 * BS + 0]
    b.release(a)
    b.release(a)  # idempotent
    z = req("z", [1, 2], [8])
    step = b.prepare([(z, 2)])
    assert step.meta.seq_rows_list == [row]  # the freed row is reused, from its start
    assert b.block_table_np[row, 0] == 8


def test_prompt_logprob_rows_follow_the_sampled_rows_and_are_recorded_once() -> None:
    b = batch()
    a = req("a", [10, 11, 12, 13, 14], [1, 2], prompt_logprobs=1)
    step = b.prepare([(a, 3)])  # positions 0..2 predict tokens 1..3
    assert step.logits_indices.tolist() == [0, 1, 2]
    assert step.prompt_targets == [(a, [11, 12, 13])]
    a.num_computed_tokens = 3
    a.prompt_logprobs.extend([None] * 3)  # type: ignore[list-item]  # the runner recorded them
    step = b.prepare([(a, 2)])  # positions 3, 4: 3 predicts 14; 4 samples the first token
    assert step.logits_indices.tolist() == [1, 0]
    assert step.prompt_targets == [(a, [14])]
