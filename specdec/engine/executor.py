"""The executor: the engine hands it one self-contained ``SchedulerOutput`` and gets one
``ModelRunnerOutput`` back, however many workers run the target.

The seam (vLLM v1's shape), agreed between tensor parallelism (issue 31) and Ray Serve replicas
(issue 32):

* ``uni``: the target runs in the engine process (``UniExecutor``, the default at
  tensor_parallel_size 1);
* ``mp``: tensor-parallel ranks in worker processes on this host (the default above 1);
* ``ray``: the ranks as Ray actors, possibly on several machines.

The scheduler, the speculator and every drafter stay in the engine process: drafting runs once,
beside rank 0 (draft TP 1), and the hidden rows a drafter reads come back with rank 0's output.
A Ray Serve replica is one whole engine; a tensor-parallel replica builds its engine with
``tensor_parallel_size`` and backend ``mp`` (one node) or ``ray`` (its placement group), and
nothing else crosses between the two.

A backend registers itself in ``EXECUTORS`` (name -> "module:Class", imported on use), so that
the engine never imports a backend it does not run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from specdec.worker.model_runner import ModelRunner, ModelRunnerOutput
from specdec.worker.static_runner import StaticModelRunner

if TYPE_CHECKING:
    from specdec.config import EngineConfig
    from specdec.engine.scheduler import SchedulerOutput
    from specdec.kv_cache.pool import KVCache
    from specdec.model.llama import LlamaModel


class ExecutorError(RuntimeError):
    """A worker died or failed: the in-flight requests cannot finish on this executor."""


class Executor:
    """Runs the target over one ``SchedulerOutput`` (forward, verification) on every rank."""

    #: ranks running the target (tensor_parallel_size)
    num_ranks: int = 1

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's runner, in the engine process (its hidden rows feed the drafter)."""
        raise NotImplementedError

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target states returned per scheduled request (see LlamaModel.forward_capture)."""
        return self.runner.hidden_layers

    @hidden_layers.setter
    def hidden_layers(self, layers: tuple[int, ...]) -> None:
        self.runner.hidden_layers = layers

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step of the target. Per-request failures come back as results; a failure of the
        executor itself (a worker gone) raises ``ExecutorError``."""
        raise NotImplementedError

    def check_health(self) -> None:
        """Raises ``ExecutorError`` when a worker is gone; cheap enough to call every step."""

    def shutdown(self) -> None:
        """Stops every worker (idempotent); the engine calls it once, on close."""


class UniExecutor(Executor):
    """Everything in the engine process: today's ``ModelRunner`` behind the seam."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        hidden_layers: tuple[int, ...],
        step_rows: int | None = None,
        use_graphs: bool = True,
    ) -> None:
        """``step_rows``: fixed-shape forwards with steps of that many rows a request
        (worker/static_runner.py; CUDA graphs unless ``use_graphs`` is false)."""
        if step_rows is None:
            self._runner = ModelRunner(model, kv, hidden_layers)
        else:
            self._runner = StaticModelRunner(
                model, kv, hidden_layers, step_rows, use_graphs=use_graphs
            )

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self._runner.execute_model(sched)


# backend name -> "module:Class"; a class is built as Class(config, model, kv, hidden_layers)
EXECUTORS: dict[str, str] = {
    "uni": "specdec.engine.executor:UniExecutor",
    "mp": "specdec.engine.mp_executor:MultiprocExecutor",
    "ray": "specdec.engine.mp_executor:RayExecutor",
}


def make_executor(
    config: EngineConfig,
    model: LlamaModel,
    kv: KVCache,
    hidden_layers: tuple[int, ...],
    step_rows: int | None = None,
) -> Executor:
    """The executor ``config`` names (``distributed_executor_backend``; ``uni`` at TP 1).
    ``step_rows``: fixed-shape forwards (one process only)."""
    backend = getattr(config, "distributed_executor_backend", None) or "uni"
    if backend == "uni":
        return UniExecutor(model, kv, hidden_layers, step_rows, not config.enforce_eager)
    module, _, cls = EXECUTORS[backend].partition(":")
    return getattr(importlib.import_module(module), cls)(config, model, kv, hidden_layers)
