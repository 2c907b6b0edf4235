"""The ``mp`` and ``ray`` executors: tensor-parallel ranks 1..N-1 in worker processes on this
host (``mp``), or in Ray actors, possibly on other hosts (``ray``, worker/tp_ray.py).

Rank 0 runs in the engine process, as with ``uni``. ``load_model`` starts the workers (they
load their shards while rank 0 loads its own) and gives rank 0's model the driver group that
hands every forward to them (worker/tp.py); the executor then watches them and stops them. A
worker that dies or raises fails the step with ``ExecutorError``; the engine then shuts down
(the server answers 503 from then on; nothing restarts: see worker/tp.py).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from specdec.distributed.binding import bind_rank, parse_cpu_binding
from specdec.distributed.shard import plan_shard
from specdec.engine.executor import Executor, ExecutorError
from specdec.model.loader import load_checkpoint
from specdec.model.model_loader import load_model
from specdec.model.registry import resolve_model_path
from specdec.worker.model_runner import ModelRunnerOutput
from specdec.worker.tp import DriverGroup, LoadArgs, MpWorkers, start_group

if TYPE_CHECKING:
    from specdec.config import EngineConfig
    from specdec.model.llama import LlamaModel
    from specdec.model.tokenizer import Tokenizer
    from specdec.worker.step import SchedulerOutput

logger = logging.getLogger("specdec.engine")
TP_START_TIMEOUT_S = 600.0  # workers spawn, import torch and load their shards


class MultiprocExecutor(Executor):
    """Rank 0 in-process, ranks 1..N-1 as spawned worker processes."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.num_ranks = config.tensor_parallel_size
        self.workers: MpWorkers | None = None  # started by load_model

    def load_model(
        self, device: torch.device, dtype: torch.dtype, kernels: str
    ) -> tuple[LlamaModel, Tokenizer]:
        """Start the workers (they load their shards), bind rank 0 to its cores, load rank 0's
        shard, and wait until every worker is ready; on failure the workers are stopped."""
        c, size = self.config, self.num_ranks
        cores = parse_cpu_binding(c.cpu_binding, size)
        load = LoadArgs(
            c.model, str(dtype).removeprefix("torch."), kernels, c.quantization,
            c.max_model_len, c.activation_dtype, c.kv_cache_dtype, c.tokenizer,
        )  # fmt: skip
        plan_shard(load_checkpoint(resolve_model_path(c.model)).arch, 0, size)  # before spawning
        before = (os.sched_getaffinity(0), torch.get_num_threads())
        group = self._start_workers(load, cores)
        self.workers = group.workers
        self.workers.restore = before
        bind_rank(cores[0], c.threads)
        try:
            out = load_model(
                c.model, device, dtype, kernels, c.quantization, c.max_model_len,
                c.activation_dtype, c.kv_cache_dtype, c.tokenizer, tp=group,
            )  # fmt: skip
            self.workers.wait_for("ready", time.monotonic() + TP_START_TIMEOUT_S)
        except BaseException:
            self.workers.stop()
            raise
        logger.info(
            "tensor parallel: %d ranks (workers %s), cores %s", size, self.workers.pids, cores
        )
        return out

    def _start_workers(self, load: LoadArgs, cores: list[list[int]]) -> DriverGroup:
        """Ranks 1..N-1, joined with rank 0 in one group (they load their shards meanwhile)."""
        return start_group(load, self.num_ranks, cores)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            return self.runner.execute_model(sched)
        except ExecutorError:
            self.shutdown()
            raise

    def check_health(self) -> None:
        if self.workers is None:
            raise ExecutorError("tensor-parallel workers never started")
        try:
            self.workers.check()
        except ExecutorError:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.stop()


class RayExecutor(MultiprocExecutor):
    """Rank 0 in-process, ranks 1..N-1 as Ray actors in one placement group (worker/tp_ray.py);
    the same lockstep, liveness read from the actors' tasks."""

    def _start_workers(self, load: LoadArgs, cores: list[list[int]]) -> DriverGroup:
        from specdec.worker.tp_ray import start_group_ray

        threads = self.config.threads or len(cores[-1])
        return start_group_ray(load, self.num_ranks, cores, threads)
