"""KV transfer wire data: layout hash, TransferParams, block-run coalescing, notifications."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.errors import CompatibilityError, InvalidRequestError, KVTransferError
from pdserve.kv_transfer.layout import PROTOCOL_VERSION, BlockRun, KVLayout, coalesce_runs
from pdserve.kv_transfer.params import TransferParams
from pdserve.kv_transfer.wire import (Notif, NotifKind, PeerInfo, decode_metadata,
                                      encode_metadata)


def make_layout(**overrides: object) -> KVLayout:
    fields: dict[str, object] = dict(model_id="tiny", dtype="float32", num_layers=4,
                                     num_kv_heads=2, head_dim=16, block_size=16, num_blocks=64)
    fields.update(overrides)
    return KVLayout(**fields)  # type: ignore[arg-type]


def make_params(**overrides: object) -> TransferParams:
    fields: dict[str, object] = dict(request_id="req-1", dst_agent="decode-0",
                                     dst_blocks=(5, 6, 9), compat_hash=make_layout().compat_hash())
    fields.update(overrides)
    return TransferParams(**fields)  # type: ignore[arg-type]


# ---- KVLayout ---------------------------------------------------------------------------
def test_block_bytes_and_shape() -> None:
    layout = make_layout()
    assert layout.shape == (64, 4, 2, 16, 2, 16)
    assert layout.block_bytes == 4 * 2 * 16 * 2 * 16 * 4
    assert make_layout(dtype="bfloat16").block_bytes == layout.block_bytes // 2
    small = KVLayout("small", "float32", 30, 3, 64, 16, 128)
    assert small.block_bytes == 737_280  # the ~0.74 MB block of the design brief


def test_compat_hash_ignores_num_blocks_only() -> None:
    base = make_layout()
    assert base.compat_hash() == make_layout(num_blocks=1000).compat_hash()
    for field, value in [("model_id", "other"), ("dtype", "bfloat16"), ("num_layers", 5),
                         ("num_kv_heads", 4), ("head_dim", 32), ("block_size", 32)]:
        other = make_layout(**{field: value})
        assert other.compat_hash() != base.compat_hash(), field
        assert base.differences(other) == [f"{field}: {getattr(base, field)!r} != {value!r}"]


@pytest.mark.parametrize("field,value", [("dtype", "int8"), ("head_dim", 0), ("num_blocks", -1),
                                         ("block_size", True), ("model_id", "")])
def test_layout_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError):
        make_layout(**{field: value})


def test_layout_dict_round_trip() -> None:
    layout = make_layout(dtype="bfloat16")
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError, match="head_dim"):
        KVLayout.from_dict({k: v for k, v in layout.to_dict().items() if k != "head_dim"})


# ---- coalescing -------------------------------------------------------------------------
def test_coalesce_consecutive_pairs_into_runs() -> None:
    assert coalesce_runs([0, 1, 2, 3], [10, 11, 12, 13]) == [BlockRun(0, 10, 4)]
    # src consecutive but dst jumps: two runs; dst consecutive but src jumps: two runs
    assert coalesce_runs([0, 1, 2], [10, 11, 20]) == [BlockRun(0, 10, 2), BlockRun(2, 20, 1)]
    assert coalesce_runs([0, 5, 6], [1, 2, 3]) == [BlockRun(0, 1, 1), BlockRun(5, 2, 2)]
    # descending ids never merge
    assert len(coalesce_runs([3, 2, 1], [3, 2, 1])) == 3
    assert coalesce_runs([], []) == []


# ---- TransferParams ---------------------------------------------------------------------
def test_params_round_trip_through_bytes() -> None:
    params = make_params(dst_blocks=[1, 2, 3], expires_at=12.5)
    again = TransferParams.from_bytes(params.to_bytes())
    assert again == params
    assert again.dst_blocks == (1, 2, 3) and again.protocol_version == PROTOCOL_VERSION


def test_params_version_mismatch_is_compatibility_error() -> None:
    body = json.loads(make_params().to_bytes())
    body["protocol_version"] = PROTOCOL_VERSION + 1
    with pytest.raises(CompatibilityError, match="protocol version"):
        TransferParams.from_bytes(json.dumps(body).encode())
    with pytest.raises(CompatibilityError, match="protocol version"):
        make_params(protocol_version=PROTOCOL_VERSION + 1).check_compatible(make_layout())


def test_params_hash_mismatch_names_the_request() -> None:
    params = make_params()
    params.check_compatible(make_layout(num_blocks=8))  # capacity is not part of the hash
    with pytest.raises(CompatibilityError, match="req-1.*hash"):
        params.check_compatible(make_layout(head_dim=32))


@pytest.mark.parametrize("bad", [
    dict(dst_blocks=()), dict(dst_blocks=(1, 1)), dict(dst_blocks=(-1,)),
    dict(dst_blocks=(1.5,)), dict(expires_at=-1), dict(request_id=""),
    dict(dst_agent=""), dict(dst_blocks="123"),
])
def test_params_reject_malformed_blocks(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        make_params(**bad)


def test_params_block_range_checked_against_the_receiver() -> None:
    params = make_params(dst_blocks=(0, 1, 9))
    params.check_blocks(dst_num_blocks=10)
    with pytest.raises(InvalidRequestError, match=r"dst_blocks.*\[9\]"):
        params.check_blocks(dst_num_blocks=9)


@pytest.mark.parametrize("data", [b"not json", b"[1,2]", b'{"protocol_version": %d}' % PROTOCOL_VERSION,
                                  b'{"protocol_version": %d, "compat_hash": "x", "request_id": "r",'
                                  b' "dst_blocks": [1], "dst_agent": "d", "expires_at": 0,'
                                  b' "extra": 1}' % PROTOCOL_VERSION])
def test_params_from_bytes_rejects_garbage(data: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        TransferParams.from_bytes(data)


# ---- wire -------------------------------------------------------------------------------
def test_notif_round_trip_and_foreign_messages() -> None:
    done = Notif(NotifKind.DONE, "r", writes=3, blocks=7, nbytes=700)
    write = Notif(NotifKind.WRITE, "r", seq=2, runs=((4, 3), (9, 1)))
    abort = Notif(NotifKind.RECEIVER_ABORT, "r", reason="client went away")
    for notif in (done, write, abort):
        assert Notif.from_bytes(notif.to_bytes()) == notif
    assert abort.kind.to_sender and not write.kind.to_sender
    assert Notif.from_bytes(b"hello") is None
    assert Notif.from_bytes(done.to_bytes()[:-3]) is None


def test_metadata_envelope_round_trip_and_version() -> None:
    info = PeerInfo("decode-0", make_layout(), base_addr=0x7F00_0000_1000, region_bytes=1 << 20)
    got, nixl_md = decode_metadata(encode_metadata(info, b"\x00nixl-blob"))
    assert got == info and nixl_md == b"\x00nixl-blob" and got.mem_type == "DRAM"
    on_gpu = PeerInfo("prefill-0", make_layout(), base_addr=0x7A00_0000_0000, region_bytes=1 << 20,
                      dev_id=3, mem_type="VRAM")
    assert decode_metadata(encode_metadata(on_gpu, b""))[0] == on_gpu  # where the region lives travels
    with pytest.raises(KVTransferError, match="mem_type"):
        decode_metadata(encode_metadata(on_gpu, b"").replace(b'"VRAM"', b'"XRAM"'))
    blob = bytearray(encode_metadata(info, b""))
    blob[7] ^= 0xFF  # the protocol version's low byte
    with pytest.raises(CompatibilityError, match="protocol version"):
        decode_metadata(bytes(blob))
    with pytest.raises(KVTransferError):
        decode_metadata(b"garbage")


def test_params_carry_an_expiry_that_round_trips_and_is_checked() -> None:
    import time

    from pdserve.kv_transfer import TransferParams

    p = TransferParams(request_id="r", dst_agent="d", dst_blocks=(1, 2), compat_hash="h",
                       expires_at=time.time() + 60)
    q = TransferParams.from_bytes(p.to_bytes())
    assert q == p and not q.expired()
    assert q.expired(now=p.expires_at + 0.001)
    assert not TransferParams(request_id="r", dst_agent="d", dst_blocks=(1,), compat_hash="h").expired()


def test_negative_expiry_is_refused() -> None:
    import pytest

    from pdserve.engine.errors import InvalidRequestError
    from pdserve.kv_transfer import TransferParams

    with pytest.raises(InvalidRequestError, match="expires_at"):
        TransferParams(request_id="r", dst_agent="d", dst_blocks=(1,), compat_hash="h", expires_at=-1.0)
