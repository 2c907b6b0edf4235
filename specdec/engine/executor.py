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

from specdec.config import executor_backend
from specdec.errors import ExecutorError as ExecutorError  # NOTE: its public name here too
from specdec.model.model_loader import load_model
from specdec.worker.model_runner import ModelRunner, ModelRunnerOutput
from specdec.worker.static_runner import StaticForward, StaticModelRunner

if TYPE_CHECKING:
    import torch

    from specdec.config import EngineConfig
    from specdec.kv_cache.pool import KVCache
    from specdec.model.llama import LlamaModel
    from specdec.model.tokenizer import Tokenizer
    from specdec.worker.step import SchedulerOutput


class Executor:
    """Runs the target over one ``SchedulerOutput`` (forward, verification) on every rank.
    This base runs it in the engine process alone (the ``uni`` backend's whole job)."""

    #: ranks running the target (tensor_parallel_size)
    num_ranks: int = 1

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._runner: ModelRunner | None = None

    def load_model(
        self, device: torch.device, dtype: torch.dtype, kernels: str
    ) -> tuple[LlamaModel, Tokenizer]:
        """The target as rank 0 sees it (the whole model here), and its tokenizer."""
        c = self.config
        return load_model(
            c.model, device, dtype, kernels, c.quantization, c.max_model_len,
            c.activation_dtype, c.kv_cache_dtype, c.tokenizer,
        )  # fmt: skip

    def init_runner(
        self,
        model: LlamaModel,
        kv: KVCache,
        hidden_layers: tuple[int, ...],
        step_rows: int | None = None,
    ) -> None:
        """Rank 0's runner over ``model`` (from ``load_model``) and its KV cache: a
        ``ModelRunner``, or with ``step_rows`` a ``StaticModelRunner`` for fixed-shape forwards
        (CUDA graphs unless ``enforce_eager``)."""
        # NOTE: step_rows is None above one rank (static_step_rows refuses tensor parallelism),
        # so only the uni backend ever builds the fixed-shape runner.
        if step_rows is None:
            self._runner = ModelRunner(model, kv, hidden_layers)
        else:
            static = StaticForward(
                model, kv, hidden_layers, step_rows, use_graphs=not self.config.enforce_eager
            )
            self._runner = StaticModelRunner(static)

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's runner, in the engine process (its hidden rows feed the drafter)."""
        if self._runner is None:
            raise RuntimeError("Executor.init_runner has not run")
        return self._runner

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
        return self.runner.execute_model(sched)

    def check_health(self) -> None:
        """Raises ``ExecutorError`` when a worker is gone; cheap enough to call every step."""

    def shutdown(self) -> None:
        """Stops every worker (idempotent); the engine calls it once, on close."""


class UniExecutor(Executor):
    """Everything in the engine process: ``ModelRunner`` behind the seam, or
    ``StaticModelRunner`` for fixed-shape forwards (worker/static_runner.py; CUDA graphs unless
    ``enforce_eager``). The base class's behaviour, under the backend's own name."""


# backend name -> "module:Class"; a class is built as Class(config)
EXECUTORS: dict[str, str] = {
    "uni": "specdec.engine.executor:UniExecutor",
    "mp": "specdec.engine.mp_executor:MultiprocExecutor",
    "ray": "specdec.engine.mp_executor:RayExecutor",
}


def make_executor(config: EngineConfig) -> Executor:
    """The executor of the backend ``config`` asks for (``executor_backend``); no worker
    starts before its ``load_model``."""
    module, _, cls = EXECUTORS[executor_backend(config)].partition(":")
    return getattr(importlib.import_module(module), cls)(config)
