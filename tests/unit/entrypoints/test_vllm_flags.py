"""vLLM's `vllm serve` flags and `LLM(...)` keywords on specdec: every one parses as vLLM parses
it, and is honoured, ignored with one log line, or refused with one line naming it."""

from __future__ import annotations

import json
import logging

import pytest

from specdec import LLM, SamplingParams, cli, config
from specdec.config import ConfigError, EngineArgs
from specdec.entrypoints.openai import api_server

# vLLM's serve flags (vllm/engine/arg_utils.py EngineArgs.add_cli_args and
# vllm/entrypoints/openai/cli_args.py FrontendArgs / make_arg_parser), written out here as data:
# boolean flags (vLLM: --X and --no-X; a few store_true only) ...
VLLM_BOOL_FLAGS = """
trust-remote-code enforce-eager enable-return-routed-experts return-sampling-mask use-fp64-gumbel
enable-trace-replay disable-sliding-window disable-cascade-attn skip-tokenizer-init
enable-prompt-embeds enable-sleep-mode enable-cumem-allocator enable-nccl-comm-suspend
allow-deprecated-quantization use-tqdm-on-load enable-mamba-cache-stochastic-rounding numa-bind
dcp-q-replicate data-parallel-hybrid-lb data-parallel-external-lb enable-expert-parallel
enable-batch-sharded-sampling enable-ep-weight-filter enable-dbo enable-elastic-ep
disable-nccl-for-dp-synchronization enable-eplb ray-workers-use-nsight disable-custom-all-reduce
enable-fault-tolerance enable-prefix-caching kv-sharing-fast-prefill language-model-only
enable-mm-embeds mm-encoder-only interleave-mm-strings skip-mm-profiling mm-device-do-normalize
enable-lora enable-tower-connector-lora fully-sharded-loras specialize-active-lora
enable-mixed-moe-lora-format enable-moe-shared-loras kv-cache-metrics cudagraph-metrics
enable-layerwise-nvtx-tracing enable-mfu-metrics enable-logging-iteration-details
jit-monitor-verbose enable-chunked-prefill disable-chunked-mm-input
disable-hybrid-kv-cache-manager async-scheduling enable-flashinfer-autotune
enable-bf16x3-router-gemm fail-on-environ-validation
trust-request-chat-template return-tokens-as-token-ids enable-auto-tool-choice
exclude-tools-when-tool-choice-none enable-prompt-tokens-details enable-per-request-metrics
enable-server-load-tracking enable-force-include-usage enable-tokenizer-info-endpoint
enable-log-outputs enable-log-deltas cohere-is-reasoning-model log-error-stack tokens-only
disable-uvicorn-access-log allow-credentials enable-ssl-refresh enable-request-id-headers
disable-fastapi-docs enable-offline-docs enable-flash-late-interaction enable-log-requests
""".split()
VLLM_STORE_TRUE_FLAGS = """
disable-log-stats aggregate-engine-logging data-parallel-multi-port-external-lb
disable-log-requests eplb-log-balancedness enable-multimodal-encoder-data-parallel
disable-mm-preprocessor-cache calculate-kv-scales
""".split()
# ... flags with a value (or several, or JSON), as a pasted command gives them
VLLM_VALUE_FLAGS = {
    "--model": ["m"], "--runner": ["generate"], "--convert": ["none"], "--task": ["generate"],
    "--tokenizer": ["t"], "--tokenizer-mode": ["auto"], "--dtype": ["bfloat16"], "--seed": ["0"],
    "--hf-config-path": [""], "--allowed-local-media-path": ["/tmp"],
    "--allowed-media-domains": ["a.com", "b.com"], "--revision": ["main"],
    "--code-revision": ["main"], "--tokenizer-revision": ["main"], "--max-model-len": ["32k"],
    "--quantization": ["gguf"], "-q": ["gguf"], "--quantization-config": ["{}"],
    "--max-logprobs": ["20"], "--logprobs-mode": ["raw_logprobs"],
    "--served-model-name": ["a", "b"], "--config-format": ["auto"], "--hf-token": ["tok"],
    "--hf-overrides": ["{}"], "--model-class-overrides": ["{}"], "--pooler-config": ["{}"],
    "--generation-config": ["vllm"], "--override-generation-config": ['{"temperature": 0.5}'],
    "--model-impl": ["auto"], "--logits-processors": ["a.B", "c.D"],
    "--io-processor-plugin": ["p"], "--renderer-num-workers": ["1"], "--load-format": ["auto"],
    "--download-dir": ["/tmp"], "--safetensors-load-strategy": ["lazy"],
    "--safetensors-prefetch-num-threads": ["4"], "--safetensors-prefetch-block-size": ["16M"],
    "--model-loader-extra-config": ['{"a": 1}'], "--ignore-patterns": ["*.pt", "original/*"],
    "--pt-load-map-location": ["cpu"], "--attention-backend": ["FLASH_ATTN"],
    "--mamba-backend": ["triton"], "--mamba-ssu-algorithm": ["x"],
    "--mamba-cache-philox-rounds": ["4"], "--reasoning-parser": ["deepseek_r1"],
    "--reasoning-parser-plugin": ["p.py"], "--distributed-executor-backend": ["mp"],
    "--pipeline-parallel-size": ["1"], "-pp": ["1"], "--master-addr": ["127.0.0.1"],
    "--master-port": ["29501"], "--nnodes": ["1"], "--node-rank": ["0"], "-r": ["0"],
    "--distributed-timeout-seconds": ["60"], "--cpu-distributed-timeout-seconds": ["60"],
    "--numa-bind-nodes": ["0", "1"], "--numa-bind-cpus": ["0-3", "4-7"], "--device-ids": ["0,1"],
    "--tensor-parallel-size": ["1"], "-tp": ["1"], "--decode-context-parallel-size": ["1"],
    "-dcp": ["1"], "--dcp-comm-backend": ["ag_rs"], "--dcp-kv-cache-interleave-size": ["1"],
    "--cp-kv-cache-interleave-size": ["1"], "--prefill-context-parallel-size": ["1"],
    "-pcp": ["1"], "--data-parallel-size": ["1"], "-dp": ["1"], "--data-parallel-rank": ["0"],
    "-dpn": ["0"], "--data-parallel-start-rank": ["0"], "-dpr": ["0"],
    "--data-parallel-size-local": ["1"], "-dpl": ["1"], "--data-parallel-address": ["h"],
    "-dpa": ["h"], "--data-parallel-rpc-port": ["13345"], "-dpp": ["13345"],
    "--data-parallel-backend": ["mp"], "-dpb": ["mp"], "-dph": [], "-dpe": [], "-dpm": [],
    "-ep": [], "--all2all-backend": ["naive"], "--ubatch-size": ["0"],
    "--dbo-decode-token-threshold": ["32"], "--dp-sync-interval": ["1"],
    "--dbo-prefill-token-threshold": ["512"], "--eplb-config": ['{"window_size": 1000}'],
    "--expert-placement-strategy": ["linear"], "--num-redundant-experts": ["0"],
    "--eplb-window-size": ["1000"], "--eplb-step-interval": ["3000"],
    "--max-parallel-loading-workers": ["2"], "--worker-cls": ["auto"],
    "--worker-extension-cls": [""], "--fault-tolerance-config": ["{}"], "--block-size": ["16"],
    "--gpu-memory-utilization": ["0.9"], "--kv-cache-memory-bytes": ["1G"],
    "--kv-cache-dtype": ["auto"], "--num-gpu-blocks-override": ["100"],
    "--prefix-caching-hash-algo": ["sha256"], "--prefix-cache-retention-interval": ["10"],
    "--kv-cache-dtype-skip-layers": ["0", "1"], "--mamba-cache-dtype": ["auto"],
    "--mamba-ssm-cache-dtype": ["auto"], "--mamba-block-size": ["256"],
    "--mamba-cache-mode": ["none"], "--kv-offloading-size": ["4"],
    "--kv-offloading-backend": ["native"], "--offload-backend": ["auto"],
    "--cpu-offload-gb": ["0"], "--cpu-offload-params": ["a", "b"], "--offload-group-size": ["0"],
    "--offload-num-in-group": ["1"], "--offload-prefetch-step": ["1"],
    "--offload-params": ["a", "b"], "--limit-mm-per-prompt": ['{"image": 0}'],
    "--media-io-kwargs": ["{}"], "--mm-processor-kwargs": ["{}"],
    "--mm-processor-cache-gb": ["4"], "--mm-processor-cache-type": ["lru"],
    "--mm-hasher-algorithm": ["blake3"], "--mm-shm-cache-max-object-size-mb": ["128"],
    "--mm-encoder-tp-mode": ["weights"], "--mm-encoder-attn-backend": ["x"],
    "--mm-encoder-attn-dtype": ["auto"], "--mm-encoder-fp8-scale-path": ["p"],
    "--mm-encoder-fp8-scale-save-path": ["p"], "--mm-encoder-fp8-scale-save-margin": ["1.1"],
    "--video-pruning-rate": ["0.5"], "--video-pruning-method": ["x"],
    "--mm-tensor-ipc": ["direct_rpc"], "--mm-processor-device": ["auto"],
    "--mm-ipc-gpu-memory-gb": ["1"], "--max-loras": ["1"], "--max-lora-rank": ["16"],
    "--lora-dtype": ["auto"], "--lora-extra-vocab-size": ["256"], "--max-cpu-loras": ["2"],
    "--lora-target-modules": ["q_proj", "v_proj"], "--default-mm-loras": ['{"audio": "p"}'],
    "--show-hidden-metrics-for-version": ["0.10"], "--otlp-traces-endpoint": ["http://x"],
    "--collect-detailed-traces": ["model,worker"], "--per-request-spec-decode-metrics": ["none"],
    "--kv-cache-metrics-sample": ["0.01"], "--jit-monitor-mode": ["warn"],
    "--max-num-batched-tokens": ["8k"], "--max-num-scheduled-tokens": ["2048"],
    "--max-num-seqs": ["256"], "--max-num-partial-prefills": ["1"],
    "--max-long-partial-prefills": ["1"], "--long-prefill-token-threshold": ["0"],
    "--num-lookahead-slots": ["0"], "--num-scheduler-steps": ["8"],
    "--scheduling-policy": ["priority"],
    "--scheduler-cls": ["x.Y"], "--stream-interval": ["1"],
    "--cudagraph-capture-sizes": ["1", "2", "4"], "--cuda-graph-sizes": ["8"],
    "--max-cudagraph-capture-size": ["512"], "--ir-op-priority": ["{}"],
    "--moe-backend": ["auto"], "--linear-backend": ["auto"],
    "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 3}'],
    "--kv-transfer-config": ['{"kv_connector": "X"}'], "--kv-events-config": ["{}"],
    "--ec-transfer-config": ["{}"], "--ec-manager-config": ["{}"],
    "--compilation-config": ['{"cudagraph_mode": "FULL"}'], "-cc": ["3"], "-O": ["3"],
    "-O3": [], "--attention-config": ["{}"], "-ac": ["{}"], "--reasoning-config": ["{}"],
    "--kernel-config": ["{}"], "--additional-config": ['{"ascend": {"x": 1}}'],
    "--structured-outputs-config": ['{"backend": "xgrammar"}'], "--profiler-config": ["{}"],
    "--optimization-level": ["2"], "--performance-mode": ["balanced"],
    "--weight-transfer-config": ["{}"], "--diffusion-config": ["{}"], "-dc": ["{}"],
    "--shutdown-timeout": ["5"], "--gdn-prefill-backend": ["triton"],
    "--kda-prefill-backend": ["auto"], "--spec-method": ["ngram"], "--spec-tokens": ["3"],
    "--spec-model": ["[ngram]"],
    # vLLM's dotted spelling of any JSON flag
    "--speculative-config.method": ["ngram"], "--kv-events-config.topic": ["x"],
    "--compilation-config.cudagraph_mode": ["FULL"], "--hf-overrides.a.b=1": [],
    # the OpenAI front
    "--lora-modules": ["a=b"], "--chat-template": ["{{ x }}"],
    "--chat-template-content-format": ["auto"], "--default-chat-template-kwargs": ["{}"],
    "--response-role": ["assistant"], "--tool-call-parser": ["hermes"],
    "--tool-parser-plugin": [""], "--tool-server": ["demo"], "--log-config-file": ["l.json"],
    "--max-log-len": ["100"], "--cohere-format": ["cmd4"], "--fingerprint-mode": ["full"],
    "--fingerprint-value": ["x"], "--host": ["127.0.0.1"], "--port": ["8000"],
    "--data-parallel-supervisor-port": ["9256"], "--dp-supervisor-probe-interval-s": ["5"],
    "--dp-supervisor-probe-timeout-s": ["5"], "--dp-supervisor-probe-failure-threshold": ["3"],
    "--uds": ["/tmp/s.sock"], "--uvicorn-log-level": ["warning"],
    "--disable-access-log-for-endpoints": ["/health,/metrics"],
    "--allowed-origins": ['["*"]'], "--allowed-methods": ['["*"]'],
    "--allowed-headers": ['["*"]'], "--api-key": ["k"], "--ssl-keyfile": ["k.pem"],
    "--ssl-certfile": ["c.pem"], "--ssl-ca-certs": ["ca.pem"], "--ssl-cert-reqs": ["0"],
    "--ssl-ciphers": ["ECDHE-RSA-AES256-GCM-SHA384"], "--root-path": ["/llm"],
    "--middleware": ["a.b"], "--h11-max-incomplete-event-size": ["4194304"],
    "--h11-max-header-count": ["256"], "--api-server-count": ["1"], "-asc": ["1"],
    "--headless": [], "--config": ["c.yaml"], "--grpc": [],
}  # fmt: skip


def _vllm_argvs() -> list[list[str]]:
    argvs = [[f"--{f}"] for f in VLLM_BOOL_FLAGS + VLLM_STORE_TRUE_FLAGS]
    argvs += [[f"--no-{f}"] for f in VLLM_BOOL_FLAGS]
    return argvs + [[flag, *values] for flag, values in VLLM_VALUE_FLAGS.items()]


def _record(monkeypatch) -> list:
    seen: list = []
    monkeypatch.setattr(api_server, "cmd_serve", lambda args: seen.append(args) or 0)
    return seen


def test_every_vllm_serve_flag_parses(monkeypatch, capsys) -> None:
    seen = _record(monkeypatch)
    failed = []
    for argv in _vllm_argvs():
        try:
            code = cli.main(["serve", "m", *argv])
        except SystemExit as e:
            code = e.code
        if code != 0:
            failed.append((" ".join(argv), capsys.readouterr().err.strip()))
    assert failed == []
    assert len(seen) == len(_vllm_argvs())
    # the whole pasted set at once parses too
    assert cli.main(["serve", "m", *[a for argv in _vllm_argvs()[-40:] for a in argv]]) == 0


def _serve_args(monkeypatch, *argv: str):
    seen = _record(monkeypatch)
    assert cli.main(["serve", "m", *argv]) == 0
    return seen[-1]


def test_flags_parse_to_vllm_values(monkeypatch) -> None:
    args = _serve_args(
        monkeypatch, "--hf-overrides", '{"a": 1}', "-O3", "--max-model-len", "32K",
        "--ignore-patterns", "a", "b", "--hf-token", "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes", "1k", "--middleware", "a.b", "--middleware", "c.d",
    )  # fmt: skip
    assert args.hf_overrides == {"a": 1} and args.optimization_level == "3"
    assert args.max_model_len == 32768 and args.kv_cache_memory_bytes == 1000
    assert args.ignore_patterns == ["a", "b"] and args.hf_token is True
    assert args.enable_prefix_caching is False and args.middleware == ["a.b", "c.d"]
    for bad in (["--hf-overrides", "{x"], ["--max-model-len", "lots"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "m", *bad])
        assert e.value.code == 2


def test_dotted_json_flags_are_vllms_json(monkeypatch) -> None:
    """``--X.a.b V`` is ``--X '{"a": {"b": V}}'`` (V as JSON where it parses), merged over
    the other dotted keys and over ``--X`` given whole, for every flag whose value is JSON."""
    args = _serve_args(
        monkeypatch, "--speculative-config.method", "ngram",
        "--speculative-config.num_speculative_tokens", "4", "--kv-events-config.topic", "x",
        "--kv-events-config.enable_kv_cache_events=true", "--compilation-config.pass_config.a",
        "[1, 2]", "-cc", '{"level": 3, "pass_config": {"b": null}}', "--max-model-len", "64",
    )  # fmt: skip
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 4}
    assert args.kv_events_config == {"topic": "x", "enable_kv_cache_events": True}
    assert args.compilation_config == {"level": 3, "pass_config": {"b": None, "a": [1, 2]}}
    assert args.max_model_len == 64
    spec = EngineArgs.from_cli_args(args).speculative()
    assert spec.method == "ngram" and spec.num_speculative_tokens == 4
    # a dotted key over the flag given whole; text that is not JSON stays text
    args = _serve_args(
        monkeypatch, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--speculative-config.num_speculative_tokens=3", "--speculative-config.model", "[ngram]",
    )  # fmt: skip
    assert json.loads(args.speculative_config) == {
        "method": "ngram", "num_speculative_tokens": 3, "model": "[ngram]",
    }  # fmt: skip


@pytest.mark.parametrize(
    "argv", [["--max-model-len.x", "1"], ["--speculative-config.method"], ["--no-such.x", "1"]]
)
def test_dotted_flags_of_other_flags_are_one_line_errors(capsys, monkeypatch, argv) -> None:
    _record(monkeypatch)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "m", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and argv[0] in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--task", "embed"], "task (--task) 'embed'"),
        (["--runner", "pooling"], "runner (--runner) 'pooling'"),
        (["--convert", "embed"], "convert (--convert)"),
        (["--hf-overrides", '{"num_hidden_layers": 2}'], "hf_overrides (--hf-overrides)"),
        (["--logits-processors", "a.B"], "logits_processors (--logits-processors)"),
        (["--quantization", "awq"], "--quantization"),
        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size (--pipeline-parallel-size)"),
        (["--nnodes", "2"], "nnodes (--nnodes)"),
        (["--structured-outputs-config", '{"disable_any_whitespace": true}'],
         "structured_outputs_config (--structured-outputs-config)"),
        (["--override-generation-config", '{"max_new_tokens": 9}'],
         "override_generation_config: max_new_tokens"),
        (["--enable-lora", "--lora-modules", "sql=/a"], "--lora-modules sql=/a"),
        (["--response-role", "bot"], "--response-role bot"),
        (["--chat-template-content-format", "openai"], "--chat-template-content-format openai"),
        (["--headless"], "--headless"),
        (["--config", "c.yaml"], "--config c.yaml"),
        (["--api-key", "a", "b"], "--api-key"),
        (["--spec-tokens", "3", "--speculative-config", '{"num_speculative_tokens": 4}'],
         "--spec-tokens and speculative_config.num_speculative_tokens"),
    ],
)  # fmt: skip
def test_values_that_cannot_be_honoured_are_one_line_errors(
    tiny_llama, capsys, monkeypatch, argv, named
):
    import uvicorn

    def never_serve(*a, **kw):  # a refusal that failed must not start a real server
        raise ValueError("reached uvicorn")

    monkeypatch.setattr(uvicorn, "Config", never_serve)
    try:
        code = cli.main(["serve", str(tiny_llama), *argv])
    except SystemExit as e:  # a value argparse refuses
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and named in err and err.count("\n") == 1, err


def test_ignored_flags_are_logged_once_in_one_line(tiny_llama, caplog) -> None:
    caplog.set_level(logging.INFO, logger="specdec")
    config._LOGGED_IGNORED.clear()
    args = EngineArgs(
        model=str(tiny_llama), max_model_len=64, enable_expert_parallel=True,
        additional_config={"x": 1}, enable_lora=True, max_parallel_loading_workers=2,
        kv_transfer_config={"kv_connector": "X"}, task="generate", num_scheduler_steps=8,
    )  # fmt: skip
    args.create_engine_config()
    lines = [r.getMessage() for r in caplog.records if "ignored on CPU" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    for name in ("enable_expert_parallel", "additional_config", "enable_lora",
                 "max_parallel_loading_workers", "kv_transfer_config",
                 "num_scheduler_steps"):  # fmt: skip
        assert name in lines[0]
    assert "task" not in lines[0]  # its harmless value is no news
    caplog.clear()
    args.create_engine_config()
    assert not [r for r in caplog.records if "ignored on CPU" in r.getMessage()]
    caplog.clear()
    EngineArgs(model=str(tiny_llama), reasoning_parser="deepseek_r1").create_engine_config()
    notes = [r.getMessage() for r in caplog.records]
    assert any("--reasoning-parser deepseek_r1" in n and "content" in n for n in notes), notes


def test_llm_takes_vllm_keywords(tiny_llama) -> None:
    llm = LLM(
        str(tiny_llama), max_model_len=64, enable_expert_parallel=True,
        additional_config={"ascend": {"x": 1}}, hf_overrides={}, compilation_config=3,
        kv_cache_memory_bytes=1 << 20, spec_method="ngram", spec_tokens=2,
    )  # fmt: skip
    assert llm.engine.spec.method == "ngram" and llm.engine.spec.num_speculative_tokens == 2
    out = llm.generate("the the the", SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ConfigError, match=r"hf_overrides \(--hf-overrides\)"):
        LLM(str(tiny_llama), hf_overrides={"vocab_size": 7})


def test_generation_config_sets_sampling_defaults(tiny_llama, tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True})
    )
    args = EngineArgs(
        model=str(tiny_llama), generation_config=str(tmp_path),
        override_generation_config={"top_k": 5, "repetition_penalty": 1.1},
    )  # fmt: skip
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1}
    assert args.generation_defaults() == want
    assert EngineArgs(model=str(tiny_llama), generation_config="vllm").generation_defaults() == {}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        EngineArgs(
            model=str(tiny_llama), generation_config=str(tmp_path / "x")
        ).generation_defaults()
    llm = LLM(str(tiny_llama), max_model_len=64, override_generation_config={"temperature": 0.0})
    assert llm.get_default_sampling_params().temperature == 0.0


def test_serve_applies_server_flags(monkeypatch, tiny_llama) -> None:
    """--generation-config into the server's sampling defaults (under --temp); --root-path,
    --uds, TLS and the access log into uvicorn; --disable-fastapi-docs and --middleware."""
    import uvicorn

    captured = {}

    class Stop(Exception):
        pass

    def fake_config(app, **kw):
        captured.update(kw, app=app)
        raise Stop

    monkeypatch.setattr(uvicorn, "Config", fake_config)
    args = [
        "serve", str(tiny_llama), "--max-model-len", "64",
        "--override-generation-config", '{"temperature": 0.3, "top_k": 7}', "--temp", "0.9",
        "--root-path", "/llm", "--uds", "/tmp/specdec-test.sock", "--disable-uvicorn-access-log",
        "--disable-fastapi-docs", "--middleware", "starlette.middleware.gzip.GZipMiddleware",
    ]  # fmt: skip
    with pytest.raises(Stop):
        cli.main(args)
    assert captured["root_path"] == "/llm" and captured["uds"] == "/tmp/specdec-test.sock"
    assert captured["access_log"] is False
    app = captured["app"]
    assert app.state.serving.sampling_defaults == {"temperature": 0.9, "top_k": 7}
    from starlette.testclient import TestClient

    client = TestClient(app, base_url="http://localhost")  # no lifespan: the engine does not start
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    assert client.get("/version").status_code == 200
    assert any("GZip" in repr(m) for m in app.user_middleware)
