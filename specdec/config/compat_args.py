"""vLLM's and llama.cpp's engine arguments that change nothing here: ``RefusedArgs`` (options
that would change the output: their defaults and harmless values only, else an error) and
``IgnoredArgs`` (accepted, logged once when given)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.config.arg_spec import REFUSED, _arg, _ignored, _nothing, _only, json_value

# why options are refused (their values would change the output, and specdec cannot honour them)
_ONE_MODEL = "specdec builds the model from its own config; it cannot override it"
_TEXT_ONLY = "specdec serves text generation only (no pooling, embedding or scoring models)"
_NO_LORA = "specdec loads no LoRA adapters"
_NO_PLUGINS = "specdec loads no Python plugins into the sampler"
# structured_outputs_config keys that would change the output (the built-in engine always allows
# JSON whitespace and additional properties the schema allows)
_STRUCTURED_CHANGING = ("disable_any_whitespace", "disable_additional_properties")


def _only_harmless_structured(value: Any) -> str | None:
    """structured_outputs_config: the backend choice is ignored; output-changing keys refused."""
    if isinstance(value, dict):
        bad = [k for k in _STRUCTURED_CHANGING if value.get(k)]
        if bad:
            return f"{', '.join(bad)} cannot be honoured by the built-in grammar engine"
    return None


@dataclass
class RefusedArgs:
    """vLLM options specdec cannot honour."""

    # -- vLLM options that would change the output and cannot be honoured: their defaults (and
    # harmless values) are accepted, any other value is a one-line error naming the option
    task: str | None = _arg(
        None, "vLLM: generate (or auto) only", kind=REFUSED,
        check=_only(None, "auto", "generate", why=_TEXT_ONLY),
    )  # fmt: skip
    runner: str | None = _arg(
        None, "vLLM: generate (or auto) only", kind=REFUSED,
        check=_only(None, "auto", "generate", why=_TEXT_ONLY),
    )  # fmt: skip
    convert: str | None = _arg(
        None, "vLLM: none (or auto) only", kind=REFUSED,
        check=_only(None, "auto", "none", why=_TEXT_ONLY),
    )  # fmt: skip
    hf_overrides: Any = _arg(
        None, "vLLM: none (JSON)", type=json_value, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    hf_config_path: str | None = _arg(None, "vLLM: none", kind=REFUSED, check=_nothing(_ONE_MODEL))
    model_class_overrides: Any = _arg(
        None, "vLLM: none (JSON)", type=json_value, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    rope_scaling: Any = _arg(
        None, "older vLLM: none (JSON)", type=json_value, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    rope_theta: float | None = _arg(
        None, "older vLLM: none", type=float, kind=REFUSED, check=_nothing(_ONE_MODEL)
    )
    quantization_config: Any = _arg(
        None, "vLLM: none (JSON); see --quantization", type=json_value, kind=REFUSED,
        check=_nothing("specdec quantizes with --quantization q8_0/q4_0/q4_1 only"),
    )  # fmt: skip
    logits_processors: list[str] | None = _arg(
        None, "vLLM: none", nargs="+", kind=REFUSED, check=_nothing(_NO_PLUGINS)
    )
    logprobs_mode: str | None = _arg(
        None, "vLLM: raw_logprobs only (what specdec returns)", kind=REFUSED,
        check=_only(None, "raw_logprobs", why="specdec returns raw_logprobs only"),
    )  # fmt: skip


@dataclass
class IgnoredArgs:
    """vLLM / llama.cpp options without effect on one CPU device with text-only models."""

    # -- vLLM / llama.cpp options without effect here (logged once when given)
    reasoning_parser: str | None = _ignored(
        None, "reasoning text stays in content (no reasoning_content field)",
        note="--reasoning-parser {value}: accepted, but reasoning is not split from the "
        "answer: its text stays in content (no reasoning_content field)",
    )  # fmt: skip
    reasoning_parser_plugin: str | None = _ignored(None, "no plugins")
    structured_outputs_config: Any = _ignored(
        None, "JSON; the built-in grammar engine is used", type=json_value,
        check=_only_harmless_structured,
    )  # fmt: skip
    guided_decoding_backend: str | None = _ignored(None, "older vLLM: the built-in grammar engine")
    additional_config: Any = _ignored(None, "JSON; platform options", type=json_value)
    enable_lora: bool = _ignored(False, "no adapters are loaded unless named", type=bool)
    scheduling_policy: str | None = _ignored(
        None, "fcfs; a request's priority changes when it runs, not its output"
    )
    trust_remote_code: bool = _ignored(
        False, "no remote code runs: architectures are built in", type=bool
    )
    async_scheduling: bool = _ignored(False, "one engine thread", type=bool)
    use_v2_block_manager: bool = _ignored(False, "slot-based KV pool", type=bool)
    enable_chunked_prefill: bool | None = _ignored(
        None, "prompts are always prefilled in chunks", type=bool
    )
    block_size: int | None = _ignored(None, "slot-based KV pool", type=int)
    swap_space: float | None = _ignored(None, "no GPU memory to swap", type=float)
    cpu_offload_gb: float | None = _ignored(None, "weights are in RAM", type=float)
    max_seq_len_to_capture: int | None = _ignored(None, "no CUDA graphs", type=int)
    disable_custom_all_reduce: bool = _ignored(False, "one device", type=bool)
    compilation_config: Any = _ignored(
        None, "no torch.compile (JSON or a level)", type=json_value, flags=("-cc",)
    )
    optimization_level: str | None = _ignored(None, "no torch.compile", flags=("-O",))
    performance_mode: str | None = _ignored(None, "GPU tuning")
    load_format: str | None = _ignored(None, "GGUF or safetensors, detected")
    code_revision: str | None = _ignored(None, "no remote code runs")
    tokenizer_mode: str | None = _ignored(None, "the model's own tokenizer")
    config_format: str | None = _ignored(None, "config.json or GGUF metadata")
    max_logprobs: int | None = _ignored(None, "at most 20", type=int)
    n_gpu_layers: int | None = _ignored(
        None, "llama.cpp: no GPU offload; every layer runs on the CPU", type=int,
        flags=("-ngl", "--gpu-layers"),
    )  # fmt: skip
    # vLLM's GPU, multi-node, multimodal, LoRA and observability options: nothing to do on one
    # CPU device with text-only models (a parallel degree above 1 is refused: ParallelArgs)
    enable_expert_parallel: bool = _ignored(
        False, "experts run on the one device", type=bool, flags=("-ep",)
    )
    max_parallel_loading_workers: int | None = _ignored(None, "one loader", type=int)
    allowed_local_media_path: str | None = _ignored(None, "text only")
    allowed_media_domains: list[str] | None = _ignored(None, "text only", nargs="+")
    allow_deprecated_quantization: bool = _ignored(False, "GPU", type=bool)
    enable_return_routed_experts: bool = _ignored(False, "GPU", type=bool)
    return_sampling_mask: bool = _ignored(False, "GPU", type=bool)
    use_fp64_gumbel: bool = _ignored(False, "counter-based draws", type=bool)
    enable_trace_replay: bool = _ignored(False, "GPU", type=bool)
    disable_sliding_window: bool = _ignored(False, "GPU attention", type=bool)
    disable_cascade_attn: bool = _ignored(False, "GPU attention", type=bool)
    skip_tokenizer_init: bool = _ignored(False, "the tokenizer is loaded", type=bool)
    enable_prompt_embeds: bool = _ignored(False, "token prompts only", type=bool)
    pooler_config: Any = _ignored(None, "no pooling models", type=json_value)
    override_pooler_config: Any = _ignored(None, "no pooling models", type=json_value)
    logits_processor_pattern: str | None = _ignored(None, "no plugins")
    enable_sleep_mode: bool = _ignored(False, "GPU", type=bool)
    enable_cumem_allocator: bool = _ignored(False, "GPU", type=bool)
    enable_nccl_comm_suspend: bool = _ignored(False, "GPU", type=bool)
    model_impl: str | None = _ignored(None, "built-in architectures")
    override_attention_dtype: str | None = _ignored(None, "GPU attention")
    io_processor_plugin: str | None = _ignored(None, "no plugins")
    renderer_num_workers: int | None = _ignored(None, "GPU", type=int)
    safetensors_load_strategy: str | None = _ignored(None, "loader")
    safetensors_prefetch_num_threads: int | None = _ignored(None, "loader", type=int)
    safetensors_prefetch_block_size: str | None = _ignored(None, "loader")
    model_loader_extra_config: Any = _ignored(None, "loader (JSON)", type=json_value)
    ignore_patterns: list[str] | None = _ignored(None, "loader", nargs="+")
    use_tqdm_on_load: bool = _ignored(True, "loader", type=bool)
    pt_load_map_location: str | None = _ignored(None, "loader")
    attention_backend: str | None = _ignored(None, "GPU attention")
    mamba_backend: str | None = _ignored(None, "no Mamba models")
    mamba_ssu_algorithm: str | None = _ignored(None, "no Mamba models")
    enable_mamba_cache_stochastic_rounding: bool = _ignored(False, "no Mamba models", type=bool)
    mamba_cache_philox_rounds: int | None = _ignored(None, "no Mamba models", type=int)
    master_addr: str | None = _ignored(None, "one host")
    master_port: int | None = _ignored(None, "one host", type=int)
    node_rank: int | None = _ignored(None, "one host", type=int, flags=("-r",))
    distributed_timeout_seconds: int | None = _ignored(None, "one process", type=int)
    cpu_distributed_timeout_seconds: int | None = _ignored(None, "one process", type=int)
    numa_bind: bool = _ignored(False, "see --threads", type=bool)
    numa_bind_nodes: list[str] | None = _ignored(None, "see --threads", nargs="+")
    numa_bind_cpus: list[str] | None = _ignored(None, "see --threads", nargs="+")
    device_ids: str | None = _ignored(None, "one device")
    dcp_comm_backend: str | None = _ignored(None, "one device")
    dcp_q_replicate: bool | None = _ignored(None, "one device", type=bool)
    dcp_kv_cache_interleave_size: int | None = _ignored(None, "one device", type=int)
    cp_kv_cache_interleave_size: int | None = _ignored(None, "one device", type=int)
    data_parallel_start_rank: int | None = _ignored(None, "one engine", type=int, flags=("-dpr",))
    data_parallel_size_local: int | None = _ignored(None, "one engine", type=int, flags=("-dpl",))
    data_parallel_address: str | None = _ignored(None, "one engine", flags=("-dpa",))
    data_parallel_rpc_port: int | None = _ignored(None, "one engine", type=int, flags=("-dpp",))
    data_parallel_backend: str | None = _ignored(None, "one engine", flags=("-dpb",))
    data_parallel_hybrid_lb: bool = _ignored(False, "one engine", type=bool, flags=("-dph",))
    data_parallel_external_lb: bool = _ignored(False, "one engine", type=bool, flags=("-dpe",))
    data_parallel_multi_port_external_lb: bool = _ignored(
        False, "one engine", type=bool, flags=("-dpm",)
    )
    enable_batch_sharded_sampling: bool | None = _ignored(None, "one device", type=bool)
    enable_ep_weight_filter: bool = _ignored(False, "one device", type=bool)
    all2all_backend: str | None = _ignored(None, "one device")
    enable_dbo: bool = _ignored(False, "one device", type=bool)
    ubatch_size: int | None = _ignored(None, "one device", type=int)
    enable_elastic_ep: bool = _ignored(False, "one device", type=bool)
    dbo_decode_token_threshold: int | None = _ignored(None, "one device", type=int)
    dp_sync_interval: int | None = _ignored(None, "one engine", type=int)
    dbo_prefill_token_threshold: int | None = _ignored(None, "one device", type=int)
    disable_nccl_for_dp_synchronization: bool | None = _ignored(None, "one engine", type=bool)
    enable_eplb: bool = _ignored(False, "one device", type=bool)
    eplb_config: Any = _ignored(None, "one device (JSON)", type=json_value)
    expert_placement_strategy: str | None = _ignored(None, "one device")
    num_redundant_experts: int | None = _ignored(None, "one device", type=int)
    eplb_window_size: int | None = _ignored(None, "one device", type=int)
    eplb_step_interval: int | None = _ignored(None, "one device", type=int)
    eplb_log_balancedness: bool | None = _ignored(None, "one device", type=bool)
    ray_workers_use_nsight: bool = _ignored(False, "one process", type=bool)
    worker_cls: str | None = _ignored(None, "one process")
    worker_extension_cls: str | None = _ignored(None, "one process")
    enable_fault_tolerance: bool = _ignored(False, "one process", type=bool)
    fault_tolerance_config: Any = _ignored(None, "one process (JSON)", type=json_value)
    enable_multimodal_encoder_data_parallel: bool = _ignored(False, "text only", type=bool)
    num_gpu_blocks_override: int | None = _ignored(None, "see --kv-cache-memory", type=int)
    prefix_caching_hash_algo: str | None = _ignored(None, "the pool's own hashing")
    prefix_cache_retention_interval: int | None = _ignored(None, "LRU", type=int)
    kv_cache_dtype_skip_layers: list[str] | None = _ignored(None, "GPU", nargs="+")
    kv_sharing_fast_prefill: bool = _ignored(False, "GPU", type=bool)
    calculate_kv_scales: bool = _ignored(False, "no fp8 KV", type=bool)
    mamba_cache_dtype: str | None = _ignored(None, "no Mamba models")
    mamba_ssm_cache_dtype: str | None = _ignored(None, "no Mamba models")
    mamba_block_size: int | None = _ignored(None, "no Mamba models", type=int)
    mamba_cache_mode: str | None = _ignored(None, "no Mamba models")
    kv_offloading_size: float | None = _ignored(None, "the KV pool is in RAM", type=float)
    kv_offloading_backend: str | None = _ignored(None, "the KV pool is in RAM")
    offload_backend: str | None = _ignored(None, "weights are in RAM")
    cpu_offload_params: list[str] | None = _ignored(None, "weights are in RAM", nargs="+")
    offload_group_size: int | None = _ignored(None, "weights are in RAM", type=int)
    offload_num_in_group: int | None = _ignored(None, "weights are in RAM", type=int)
    offload_prefetch_step: int | None = _ignored(None, "weights are in RAM", type=int)
    offload_params: list[str] | None = _ignored(None, "weights are in RAM", nargs="+")
    language_model_only: bool = _ignored(False, "text only", type=bool)
    limit_mm_per_prompt: Any = _ignored(None, "text only (JSON)", type=json_value)
    enable_mm_embeds: bool = _ignored(False, "text only", type=bool)
    media_io_kwargs: Any = _ignored(None, "text only (JSON)", type=json_value)
    mm_processor_kwargs: Any = _ignored(None, "text only (JSON)", type=json_value)
    mm_processor_cache_gb: float | None = _ignored(None, "text only", type=float)
    mm_processor_cache_type: str | None = _ignored(None, "text only")
    mm_hasher_algorithm: str | None = _ignored(None, "text only")
    mm_shm_cache_max_object_size_mb: int | None = _ignored(None, "text only", type=int)
    mm_encoder_only: bool = _ignored(False, "text only", type=bool)
    mm_encoder_tp_mode: str | None = _ignored(None, "text only")
    mm_encoder_attn_backend: str | None = _ignored(None, "text only")
    mm_encoder_attn_dtype: str | None = _ignored(None, "text only")
    mm_encoder_fp8_scale_path: str | None = _ignored(None, "text only")
    mm_encoder_fp8_scale_save_path: str | None = _ignored(None, "text only")
    mm_encoder_fp8_scale_save_margin: float | None = _ignored(None, "text only", type=float)
    interleave_mm_strings: bool = _ignored(False, "text only", type=bool)
    skip_mm_profiling: bool = _ignored(False, "text only", type=bool)
    video_pruning_rate: float | None = _ignored(None, "text only", type=float)
    video_pruning_method: str | None = _ignored(None, "text only")
    mm_tensor_ipc: str | None = _ignored(None, "text only")
    mm_processor_device: str | None = _ignored(None, "text only")
    mm_ipc_gpu_memory_gb: float | None = _ignored(None, "text only", type=float)
    mm_device_do_normalize: bool | None = _ignored(None, "text only", type=bool)
    disable_mm_preprocessor_cache: bool = _ignored(False, "text only", type=bool)
    max_loras: int | None = _ignored(None, _NO_LORA, type=int)
    max_lora_rank: int | None = _ignored(None, _NO_LORA, type=int)
    lora_dtype: str | None = _ignored(None, _NO_LORA)
    lora_extra_vocab_size: int | None = _ignored(None, _NO_LORA, type=int)
    enable_tower_connector_lora: bool = _ignored(False, _NO_LORA, type=bool)
    max_cpu_loras: int | None = _ignored(None, _NO_LORA, type=int)
    fully_sharded_loras: bool = _ignored(False, _NO_LORA, type=bool)
    lora_target_modules: list[str] | None = _ignored(None, _NO_LORA, nargs="+")
    default_mm_loras: Any = _ignored(None, _NO_LORA, type=json_value)
    specialize_active_lora: bool = _ignored(False, _NO_LORA, type=bool)
    enable_mixed_moe_lora_format: bool = _ignored(False, _NO_LORA, type=bool)
    enable_moe_shared_loras: bool = _ignored(False, _NO_LORA, type=bool)
    show_hidden_metrics_for_version: str | None = _ignored(None, "see /metrics")
    otlp_traces_endpoint: str | None = _ignored(None, "no tracing")
    collect_detailed_traces: list[str] | None = _ignored(None, "no tracing", nargs="+")
    kv_cache_metrics: bool = _ignored(False, "see /metrics", type=bool)
    kv_cache_metrics_sample: float | None = _ignored(None, "see /metrics", type=float)
    cudagraph_metrics: bool = _ignored(False, "no CUDA graphs", type=bool)
    enable_layerwise_nvtx_tracing: bool = _ignored(False, "no tracing", type=bool)
    enable_mfu_metrics: bool = _ignored(False, "see /metrics", type=bool)
    enable_logging_iteration_details: bool = _ignored(False, "see /metrics", type=bool)
    jit_monitor_mode: str | None = _ignored(None, "no JIT")
    jit_monitor_verbose: bool = _ignored(False, "no JIT", type=bool)
    aggregate_engine_logging: bool = _ignored(False, "one engine", type=bool)
    max_num_scheduled_tokens: int | None = _ignored(None, "see --max-num-batched-tokens", type=int)
    max_num_partial_prefills: int | None = _ignored(None, "chunked prefill", type=int)
    max_long_partial_prefills: int | None = _ignored(None, "chunked prefill", type=int)
    long_prefill_token_threshold: int | None = _ignored(None, "chunked prefill", type=int)
    num_lookahead_slots: int | None = _ignored(None, "drafts reserve their own KV", type=int)
    num_scheduler_steps: int | None = _ignored(
        None, "older vLLM: one scheduled step at a time (drafts give several tokens a step)",
        type=int,
    )  # fmt: skip
    disable_chunked_mm_input: bool = _ignored(False, "text only", type=bool)
    scheduler_cls: str | None = _ignored(None, "the built-in scheduler")
    disable_hybrid_kv_cache_manager: bool | None = _ignored(None, "one KV pool", type=bool)
    stream_interval: int | None = _ignored(None, "every step streams", type=int)
    cudagraph_capture_sizes: list[str] | None = _ignored(None, "no CUDA graphs", nargs="+")
    cuda_graph_sizes: list[str] | None = _ignored(None, "no CUDA graphs", nargs="+")
    max_cudagraph_capture_size: int | None = _ignored(None, "no CUDA graphs", type=int)
    ir_op_priority: Any = _ignored(None, "no torch.compile (JSON)", type=json_value)
    enable_flashinfer_autotune: bool | None = _ignored(None, "GPU", type=bool)
    enable_bf16x3_router_gemm: bool | None = _ignored(None, "GPU", type=bool)
    moe_backend: str | None = _ignored(None, "the native kernels")
    linear_backend: str | None = _ignored(None, "the native kernels")
    diffusion_config: Any = _ignored(None, "JSON", type=json_value, flags=("-dc",))
    kv_transfer_config: Any = _ignored(None, "one engine (JSON)", type=json_value)
    ec_transfer_config: Any = _ignored(None, "one engine (JSON)", type=json_value)
    ec_manager_config: Any = _ignored(None, "text only (JSON)", type=json_value)
    attention_config: Any = _ignored(None, "GPU attention (JSON)", type=json_value, flags=("-ac",))
    reasoning_config: Any = _ignored(None, "JSON", type=json_value)
    kernel_config: Any = _ignored(None, "the native kernels (JSON)", type=json_value)
    profiler_config: Any = _ignored(None, "no profiler (JSON)", type=json_value)
    weight_transfer_config: Any = _ignored(None, "one engine (JSON)", type=json_value)
    fail_on_environ_validation: bool = _ignored(False, "no vLLM environment", type=bool)
    gdn_prefill_backend: str | None = _ignored(None, "GPU")
    kda_prefill_backend: str | None = _ignored(None, "GPU")
