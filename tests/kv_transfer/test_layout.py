"""Unit tests: KV layout arithmetic and handshake check, descriptor merging, message
packing, and the send/receive bookkeeping rules — no processes, no transports."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv_transfer import (
    BACKENDS,
    DEFAULT_BACKEND,
    FailReason,
    KVLayout,
    KVLayoutMismatch,
    make_receiver,
    make_sender,
)
from pdserve.kv_transfer.layout import Slice, plan_slice
from pdserve.kv_transfer.recv_state import RecvTracker
from pdserve.kv_transfer.regions import Run, block_runs, byte_regions, chunk_slices
from pdserve.kv_transfer.send_state import SendTracker
from pdserve.kv_transfer.wire import Kind, Message, pack, unpack

SMOL = KVLayout("HuggingFaceTB/SmolLM2-135M", "float32", 30, 3, 64, 16)
TINY = KVLayout("tiny", "bfloat16", 3, 2, 4, 4)


def test_byte_sizes_match_tensor_layout() -> None:
    assert SMOL.block_bytes == 737_280
    assert SMOL.layer_bytes == 737_280 // 30
    kv = torch.zeros(TINY.kv_shape(5), dtype=torch.bfloat16)
    assert TINY.check_tensor(kv) == 5
    assert kv[1].numel() * kv.element_size() == TINY.block_bytes
    # kv[b, lo:hi] starts at b * block_bytes + lo * layer_bytes (block-major layout)
    offset = kv[3, 2].data_ptr() - kv.data_ptr()
    assert offset == 3 * TINY.block_bytes + 2 * TINY.layer_bytes


def test_int8_rows_carry_their_scale() -> None:
    """An int8 cache row is head_dim values and a float32 scale: the engine's tensor
    has that shape and a block is still one region (the scales move with it)."""
    from pdserve.engine.model.kv_cache import row_width

    q = dataclasses.replace(SMOL, dtype="int8")
    assert q.row_width == row_width(64, "int8") == 68
    assert q.block_shape()[-1] == 68
    assert q.block_bytes == 30 * 2 * 3 * 16 * 68
    assert SMOL.block_bytes / 2 / q.block_bytes > 1.8  # against bfloat16: 1.88x
    assert q.check_tensor(torch.zeros(q.kv_shape(3), dtype=torch.int8)) == 3
    with pytest.raises(KVLayoutMismatch, match="dtype: local='int8' peer='bfloat16'"):
        q.check_compatible(dataclasses.replace(SMOL, dtype="bfloat16"))


def test_check_tensor_rejects_wrong_tensors() -> None:
    with pytest.raises(ValueError, match="dtype"):
        TINY.check_tensor(torch.zeros(TINY.kv_shape(2)))
    with pytest.raises(ValueError, match="shape"):
        TINY.check_tensor(torch.zeros(2, 3, 2, 4, 2, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        TINY.check_tensor(torch.zeros(TINY.kv_shape(4), dtype=torch.bfloat16)[::2])


def test_invalid_layouts_fail_loudly() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVLayout("m", "int4", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="num_layers"):
        KVLayout("m", "float32", 0, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown KVLayout fields"):
        KVLayout.from_dict({**TINY.to_dict(), "extra": 1})


def test_compat_hash_and_mismatch_message_names_fields() -> None:
    same = KVLayout.from_dict(TINY.to_dict())
    assert same.compat_hash() == TINY.compat_hash()
    TINY.check_compatible(same)
    other = KVLayout("tiny", "float16", 3, 2, 4, 8)
    assert other.compat_hash() != TINY.compat_hash()
    with pytest.raises(KVLayoutMismatch) as info:
        TINY.check_compatible(other)
    text = str(info.value)
    assert "dtype: local='bfloat16' peer='float16'" in text
    assert "block_size: local=4 peer=8" in text
    assert "num_layers" not in text


def test_block_runs_merge_only_when_both_sides_continue() -> None:
    assert block_runs([4, 5, 6, 9], [10, 11, 12, 2]) == [Run(4, 10, 3), Run(9, 2, 1)]
    assert block_runs([1, 2], [5, 7]) == [Run(1, 5, 1), Run(2, 7, 1)]
    assert block_runs([3, 2], [4, 3]) == [Run(3, 4, 1), Run(2, 3, 1)]  # descending: no merge
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


def test_byte_regions_whole_blocks_and_layer_ranges() -> None:
    bb, lb = TINY.block_bytes, TINY.layer_bytes
    assert byte_regions(TINY, [4, 5, 9], [0, 1, 7], (0, 3)) == [
        (4 * bb, 0, 2 * bb),
        (9 * bb, 7 * bb, bb),
    ]
    # a layer range is contiguous only within one block: one region per block
    assert byte_regions(TINY, [4, 5], [0, 1], (1, 3)) == [
        (4 * bb + lb, lb, 2 * lb),
        (5 * bb + lb, bb + lb, 2 * lb),
    ]


@settings(deadline=None, max_examples=50)
@given(st.lists(st.integers(0, 63), unique=True, max_size=40), st.randoms())
def test_byte_regions_copy_equals_block_copy(src: list[int], rnd: random.Random) -> None:
    dst = rnd.sample(range(64), len(src))
    layers = rnd.choice([(0, 3), (1, 2), (0, 1)])
    kv = torch.arange(64 * TINY.block_bytes, dtype=torch.uint8) % 251
    out = torch.zeros_like(kv)
    for s, d, n in byte_regions(TINY, src, dst, layers):
        out[d : d + n] = kv[s : s + n]
    want = torch.zeros(TINY.kv_shape(64), dtype=torch.bfloat16)
    src_kv = kv.view(torch.bfloat16).view(TINY.kv_shape(64))
    for s, d in zip(src, dst, strict=True):
        want[d, layers[0] : layers[1]] = src_kv[s, layers[0] : layers[1]]
    assert torch.equal(out.view(torch.bfloat16).view(TINY.kv_shape(64)), want)


def test_head_slice_regions_copy_equals_slice_copy() -> None:
    """A rank holding heads [1, 3) of 4 writes head 2 into a rank holding [2, 4): one
    region per (block, layer, K/V), landing in the receiver's first head."""
    four = dataclasses.replace(TINY, num_kv_heads=4)
    src_l, dst_l = (dataclasses.replace(four, heads=h) for h in ((1, 3), (2, 4)))
    src, dst, layers = [5, 0, 6], [2, 3, 9], (1, 3)
    kv = torch.arange(8 * src_l.block_bytes, dtype=torch.uint8) % 251
    out = torch.zeros(10 * dst_l.block_bytes, dtype=torch.uint8)
    regions = byte_regions(src_l, src, dst, layers, dst_l, (2, 3))
    assert len(regions) == 3 * 2 * 2
    for s, d, n in regions:
        out[d : d + n] = kv[s : s + n]
    src_kv = kv.view(torch.bfloat16).view(src_l.kv_shape(8))
    got = out.view(torch.bfloat16).view(dst_l.kv_shape(10))
    want = torch.zeros_like(got)
    want[dst, 1:3, :, 0:1] = src_kv[src, 1:3, :, 1:2]
    assert torch.equal(got, want)


def test_layouts_of_shards_are_compatible_and_slices_checked() -> None:
    full = dataclasses.replace(TINY, num_kv_heads=4)
    shard = dataclasses.replace(full, heads=(2, 4))
    assert shard.local_heads == 2 and shard.block_shape() == (3, 2, 2, 4, 4)
    assert KVLayout.from_dict(shard.to_dict()) == shard and "heads" not in full.to_dict()
    shard.check_compatible(full)
    assert plan_slice(full, shard) == Slice((2, 4))  # the receiver's heads, one part
    assert plan_slice(shard, full, Slice((2, 4), 1, 2).to_dict()) == Slice((2, 4), 1, 2)
    with pytest.raises(KVLayoutMismatch, match=r"the sender lacks some"):
        plan_slice(shard, full)
    with pytest.raises(ValueError, match="heads"):
        dataclasses.replace(full, heads=(3, 5))


def test_chunk_slices_bound_message_size() -> None:
    assert chunk_slices(10, 100, 350) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert chunk_slices(2, 1000, 10) == [slice(0, 1), slice(1, 2)]  # >= 1 block each
    assert chunk_slices(0, 10, 10) == []


def test_wire_pack_unpack_roundtrip() -> None:
    kv = torch.randn(TINY.kv_shape(8)).to(torch.bfloat16)
    msg = Message(Kind.DATA, "req-é", 3, 5, (6, 1), (1, 3), {"first_token": 9})
    staging = torch.empty(1 << 16, dtype=torch.uint8)
    header, payload = pack(msg, TINY, kv, [2, 7], staging)
    got, data = unpack(header, payload.clone(), TINY)
    assert got == msg
    assert torch.equal(data, kv[[2, 7], 1:3])


def test_wire_carries_a_head_slice_and_its_part() -> None:
    shard = dataclasses.replace(TINY, heads=(1, 2))
    kv = torch.randn(TINY.kv_shape(8)).to(torch.bfloat16)
    msg = Message(Kind.DATA, "r", 0, 1, (4,), (0, 3), {}, (1, 2), 1, 2)
    header, payload = pack(msg, TINY, kv, [6], torch.empty(1 << 16, dtype=torch.uint8))
    got, data = unpack(header, payload.clone(), shard)
    assert got == msg and torch.equal(data, kv[[6], :, :, 1:2])


def test_recv_tracker_waits_for_every_part() -> None:
    t = RecvTracker(num_blocks=4)
    t.expect("r", [1], 10)
    t.landed("r", 0, 1, {"tok": 1}, "p0", part=0, parts=2)
    t.landed("r", 0, None, None, "p1", part=1, parts=2)
    assert t.drain() == []  # part 1 has not had its final message
    t.landed("r", 1, 2, {"tok": 1}, "p1", part=1, parts=2)
    (event,) = t.drain()
    assert event.ok and event.notify == {"tok": 1}


def test_recv_tracker_completes_in_any_order_and_fails_once() -> None:
    t = RecvTracker(num_blocks=16)
    t.expect("r", [1, 2], 10)
    assert not t.may_write("r", [1, 3])  # not its blocks
    t.landed("r", 1, 2, {"tok": 1}, peer="p")  # final arrives first
    assert t.drain() == []
    t.landed("r", 0, None, None)
    (event,) = t.drain()
    assert event.ok and event.notify == {"tok": 1}
    t.expect("s", [1], 10)
    assert t.start_ending("s", FailReason.ABORTED, "x")
    assert not t.may_write("s", [1]) and t.num_pending == 1
    t.finish("s")
    assert [(e.ok, e.reason) for e in t.drain()] == [(False, FailReason.ABORTED)]
    assert not t.end("s", FailReason.ABORTED, "again")


def test_recv_tracker_checks_every_part_wrote_every_block() -> None:
    t = RecvTracker(num_blocks=8)
    t.expect("r", [1, 2], 10)
    t.landed("r", 0, None, None, part=0, parts=2, blocks=[1, 2])
    t.landed("r", 1, 2, {"tok": 1}, part=0, parts=2, blocks=[])
    t.landed("r", 0, 1, {"tok": 1}, part=1, parts=2, blocks=[1])  # part 1 skipped block 2
    (event,) = t.drain()
    assert (event.ok, event.reason) == (False, FailReason.TRANSPORT)
    assert "1 of 2 blocks never written (blocks [2]" in event.error and t.num_pending == 0
    t.expect("s", [3], 10)  # a backend that cannot say which blocks: not checked
    t.landed("s", 0, 1, {}, blocks=None)
    assert [e.ok for e in t.drain()] == [True]


def test_send_tracker_numbers_messages_and_waits_for_inflight() -> None:
    t = SendTracker(timeout_s=10)
    a = t.begin("p", "r", final=False, n_messages=2)
    b = t.begin("p", "r", final=True, n_messages=1)
    assert a and b and (a.first_seq, a.total, b.first_seq, b.total) == (0, None, 2, 3)
    t.fail("r", FailReason.ABORTED, "x")
    assert a.cancel.set and t.drain() == []  # 3 messages still in flight
    for _ in range(3):
        t.message_done("r", None)
    assert [(e.ok, e.reason) for e in t.drain()] == [(False, FailReason.ABORTED)]
    assert t.begin("p", "r", final=True, n_messages=1) is None  # ended: dropped


def test_send_tracker_owes_event_for_request_receiver_gave_up_on() -> None:
    t = SendTracker(timeout_s=10)
    t.fail_unknown("r", FailReason.ABORTED, "aborted by receiver")
    assert t.begin("p", "r", final=False, n_messages=1) is None
    assert [(e.request_id, e.ok) for e in t.drain()] == [("r", False)]
    assert t.begin("p", "r", final=True, n_messages=1) is None
    assert t.drain() == []


def test_factory_names_and_options() -> None:
    assert DEFAULT_BACKEND == "nixl" and set(BACKENDS) == {"nixl", "torch", "ray", "local"}
    kv = torch.zeros(TINY.kv_shape(4), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="local, nixl, ray, torch"):
        make_sender("rdma", kv, TINY)
    with pytest.raises(ValueError, match="no option"):
        make_receiver("local", kv, TINY, port=1)
    with make_receiver("local", kv, TINY) as recv:
        assert recv.endpoint()["num_blocks"] == 4
