"""The engine arguments ``specdec serve`` reads (the rest of its flags are the server's own)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.config.arg_spec import SERVER, _arg


@dataclass
class ServerArgs:
    """What the server reports: per-request speculative figures, the throughput log line."""

    per_request_spec_decode_metrics: str | None = _arg(
        None,
        "serve: each response's speculative figures in vLLM's shape, its top-level "
        "metrics.speculative_decoding ('summary'; 'detailed' gives the summary: per-step lists "
        "are not kept; 'none': off)",
        choices=("none", "summary", "detailed"),
        kind=SERVER,
    )
    disable_log_stats: bool = _arg(
        False,
        "serve: no periodic throughput log line; LLM: no get_metrics()",
        type=bool,
        kind=SERVER,
    )
