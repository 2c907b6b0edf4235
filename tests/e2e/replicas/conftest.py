"""Fixtures the replica tests (data parallel, Ray Serve) share."""

from __future__ import annotations

import pytest

from tests.fixtures.replicas import MODEL


@pytest.fixture(scope="module")
def single():
    """One in-process server of the model, the reference the replicas' answers must equal."""
    from specdec.config import EngineConfig
    from specdec.engine.async_llm import AsyncLLM
    from specdec.entrypoints.openai.api_server import BackgroundServer, build_app

    llm = AsyncLLM.from_config(EngineConfig(model=MODEL, max_model_len=1024), log_stats=False)
    srv = BackgroundServer(build_app(llm, [MODEL])).start()
    yield srv
    srv.stop()
