"""The ``mp`` and ``ray`` executors: tensor-parallel ranks 1..N-1 in worker processes on this
host (``mp``), or in Ray actors, possibly on other hosts (``ray``, worker/tp_ray.py).

Rank 0's runner is in the engine process, as with ``uni``; its model is rank 0's shard and
drives the workers at every forward (worker/tp.py), so this class only watches them. A worker
that dies or raises fails the step with ``ExecutorError``; the engine then shuts down (the
server answers 503 from then on; nothing restarts: see worker/tp.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdec.engine.executor import Executor, ExecutorError
from specdec.worker.model_runner import ModelRunner, ModelRunnerOutput

if TYPE_CHECKING:
    from specdec.config import EngineConfig
    from specdec.engine.scheduler import SchedulerOutput
    from specdec.kv_cache.pool import KVCache
    from specdec.model.llama import LlamaModel
    from specdec.worker.tp import MpWorkers


class MultiprocExecutor(Executor):
    """Rank 0 in-process, ranks 1..N-1 as spawned workers (started by ``load_target``)."""

    def __init__(
        self, config: EngineConfig, model: LlamaModel, kv: KVCache, hidden_layers: tuple[int, ...]
    ) -> None:
        if model.tp is None or model.tp.workers is None:
            raise ExecutorError("distributed_executor_backend mp: the model has no workers")
        self.num_ranks = model.tp.size
        self.workers: MpWorkers = model.tp.workers
        self._runner = ModelRunner(model, kv, hidden_layers)

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            return self._runner.execute_model(sched)
        except ExecutorError:
            self.shutdown()
            raise

    def check_health(self) -> None:
        try:
            self.workers.check()
        except ExecutorError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        self.workers.stop()


class RayExecutor(MultiprocExecutor):
    """Rank 0 in-process, ranks 1..N-1 as Ray actors (started by ``load_target``); the same
    lockstep, liveness read from the actors' tasks."""
