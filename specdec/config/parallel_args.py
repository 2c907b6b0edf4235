"""The parallel engine arguments: threads, tensor parallelism and its ranks' cores, the replica
index, and vLLM's other parallel sizes (1 only)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.config.arg_spec import SINGLE, _arg


@dataclass
class ParallelArgs:
    """Tensor parallelism, threads, replicas."""

    threads: int | None = _arg(
        None, "CPU threads for torch and the native kernels (llama.cpp's -t)", type=int,
        flags=("-t",),
    )  # fmt: skip
    # -- one device
    tensor_parallel_size: int = _arg(
        1, "ranks running the target, each with its shard of the weights and KV heads",
        type=int, flags=("-tp",),
    )  # fmt: skip
    distributed_executor_backend: str | None = _arg(
        None, "how the ranks run: uni (one process) or mp (worker processes; the default above "
        "tensor_parallel_size 1)",
    )  # fmt: skip
    cpu_binding: str | None = _arg(
        None, "each rank's cores, '|'-separated ('0-31|32-63'; env SPECDEC_CPU_OMP_THREADS_BIND); "
        "default: the usable cores split evenly",
    )  # fmt: skip
    pipeline_parallel_size: int = _arg(1, "1 only", type=int, flags=("-pp",), kind=SINGLE)
    data_parallel_size: int = _arg(
        1,
        "specdec serve: engine replicas behind one endpoint; 1 elsewhere",
        type=int,
        flags=("-dp",),
        kind=SINGLE,
    )
    data_parallel_rank: int = _arg(
        0,
        "this engine's replica index: labels its KV events and offsets their ports (serve "
        "--data-parallel-size sets it for each replica)",
        type=int,
        flags=("-dpn",),
    )
    nnodes: int = _arg(1, "1 only", type=int, kind=SINGLE)
    decode_context_parallel_size: int = _arg(1, "1 only", type=int, flags=("-dcp",), kind=SINGLE)
    prefill_context_parallel_size: int = _arg(1, "1 only", type=int, flags=("-pcp",), kind=SINGLE)
