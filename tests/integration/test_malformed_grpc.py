"""A gRPC request whose bytes are not a valid message is INVALID_ARGUMENT, with no traceback logged.

A real gRPC server on 127.0.0.1 over a real engine (tiny model); the requests are raw bytes sent
through a channel without a serializer, as a broken or hostile client would send them. gRPC's
own handling was UNKNOWN ("Unexpected DecodeError") plus an ERROR traceback per request.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
from log_records import LogRecords

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto import pdserve_pb2 as pb
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.local_backend import LocalEngineBackend
from pdserve.router.serving import Serving

pytestmark = pytest.mark.timeout(120)

CASES = {
    "corrupt wire format": b"\xff\xff\xff\xff",
    "bad UTF-8 in the text field": b"\x1a\x02\xff\xfe",  # field 3 (text), length 2
    "truncated": pb.GenerateRequest(text="hello there").SerializeToString()[:-3],
}


@pytest.fixture(scope="module")
def target(tiny_model):
    records = LogRecords()
    logging.getLogger().addHandler(records)
    engine = LLMEngine(EngineConfig(model_dir=str(tiny_model), num_blocks=64, max_model_len=128, max_num_seqs=8))
    backend = LocalEngineBackend(engine, model_name="tiny")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-grpc", daemon=True)
    thread.start()
    serving = Serving(backend, tokenizer=load_tokenizer(tiny_model))
    server = asyncio.run_coroutine_threadsafe(start_grpc_server(serving), loop).result(30)
    try:
        yield server.target
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        backend.close()
        logging.getLogger().removeHandler(records)
    assert engine.block_manager.all_free() and not engine.has_unfinished()
    tracebacks = records.tracebacks()
    assert not tracebacks, tracebacks


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_generate_request_is_invalid_argument(target: str, case: str) -> None:
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_stream("/pdserve.v1.Generation/Generate")  # raw bytes in, raw bytes out
        with pytest.raises(grpc.RpcError) as info:
            list(call(CASES[case], timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    assert "not a valid pdserve.v1.GenerateRequest" in info.value.details()


def test_a_malformed_list_models_request_is_invalid_argument_and_good_calls_still_work(target: str) -> None:
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/pdserve.v1.Generation/ListModels")(b"\xff\xff", timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        good = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
        replies = list(channel.unary_stream("/pdserve.v1.Generation/Generate")(good, timeout=30))
        assert pb.GenerateResponse.FromString(replies[-1]).final.usage.completion_tokens == 2
