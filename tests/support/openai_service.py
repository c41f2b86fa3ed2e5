"""A coordinator with its OpenAI HTTP API and a real target worker, in this process, for an async OpenAI client."""

import asyncio
import openai

from tests.support.services import TARGET


def in_process_coordinator(scenario, max_concurrent_requests=256, retry_window=30.0, target_engine=None):
    """target_engine: the target worker's engine (default: one on the tiny random TARGET)."""
    from specdec.common.config import ServerOptions
    from specdec.common.models import load_model
    from specdec.coordinator.config import CoordinatorConfig, PoolSettings
    from specdec.coordinator.server import build_engine, launch
    from specdec.coordinator.worker_clients import GrpcWorkers
    from specdec.target_worker.engine import TargetEngine
    from specdec.target_worker.server import start_target_server

    async def run():
        engine = target_engine or TargetEngine(load_model(TARGET))
        model = engine.loaded
        target, port = await start_target_server(engine)
        workers = GrpcWorkers(f"127.0.0.1:{port}", None, settings=PoolSettings(poll_interval=0.1))
        config = CoordinatorConfig(target_retry_window=retry_window)
        engine = await build_engine(workers, config, tokenizer=model.tokenizer)
        coordinator = await launch(engine, ServerOptions(host="127.0.0.1"), max_concurrent_requests, http_port=0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{coordinator.http_port}/v1", api_key="-", max_retries=0)
        try:
            await scenario(client, target)
        finally:
            await client.close()
            await coordinator.stop()
            await workers.close()
            await target.stop(0)

    asyncio.run(run())
