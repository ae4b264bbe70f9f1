"""A router process for the Batch API's kill test: a local engine (tiny model), the HTTP API on
127.0.0.1 and the batch runner, its batches in the Redis named by the environment
(``BATCH_REDIS_URL``, ``BATCH_REDIS_PASSWORD``: never in argv), its items' lease
``BATCH_LEASE_S`` seconds (default 15). Prints its base URL and, on a second line, its runner's
lease holder, then serves until it is killed.

    python batch_router_proc.py MODEL_DIR NAMESPACE
"""

from __future__ import annotations

import asyncio
import os
import sys


async def main(model_dir: str, namespace: str) -> None:
    from pdserve.cluster.state.batch_store import RedisBatchStore
    from pdserve.cluster.state.redis_server import connect
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.router.batch_runner import BatchRunner
    from pdserve.router.http_server import start_http_server
    from pdserve.router.local_backend import LocalEngineBackend
    from pdserve.router.serving import Serving

    store = RedisBatchStore(connect(os.environ["BATCH_REDIS_URL"], password=os.environ["BATCH_REDIS_PASSWORD"]),
                            namespace=namespace)
    # float32: the test compares its tokens with an engine that batched them otherwise, and bf16
    # (dtype auto on an AMX or AVX512-BF16 host) rounds a row differently in another batch
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_blocks=512, max_num_seqs=32, warm_up=False,
                                    dtype="float32"))
    serving = Serving(LocalEngineBackend(engine, model_name="tiny"), tokenizer=load_tokenizer(model_dir))
    server = await start_http_server(serving, batches=store)
    runner = BatchRunner(serving, store, poll_s=0.05, max_concurrent=16,
                         lease_s=float(os.environ.get("BATCH_LEASE_S", "15")))
    print(server.base_url, flush=True)
    print(runner.holder, flush=True)
    await runner.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
