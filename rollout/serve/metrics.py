"""``GET /metrics``: the engine's state in Prometheus' text format (version 0.0.4), written by hand.

Names follow vLLM's (``vllm:num_requests_running`` is ``rollout:num_requests_running`` here), so a
dashboard built for vLLM needs only its prefix changed. The values are read from the engine without
its lock: each is one read of a counter or a queue length, and a scrape may see them a step apart.
"""

from __future__ import annotations

from rollout import ContinuousBatchingManager

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The engine's metrics, by name without the ``rollout:`` prefix: (Prometheus type, help text).
_ENGINE_METRICS = {
    "num_requests_running": ("gauge", "Requests admitted to the engine (holding KV blocks)."),
    "num_requests_waiting": ("gauge", "Requests queued, not yet admitted."),
    "generation_tokens_total": ("counter", "Tokens sampled since the server started."),
    "prompt_tokens_total": ("counter", "Prompt tokens computed (prefix-cache hits excluded)."),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV-cache blocks held by requests (0 to 1)."),
    "prefix_cache_hits_total": ("counter", "KV blocks taken from the prefix cache."),
    "num_preemptions_total": ("counter", "Requests preempted for lack of KV blocks."),
}


def _metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {value}" for labels, value in samples]
    return lines


def render(manager: ContinuousBatchingManager, model_name: str, finished: dict[str, int]) -> str:
    """The metrics page.

    Args:
        manager: the server's manager (a destroyed one reports only the finished requests).
        model_name: the ``model_name`` label of every sample.
        finished: choices ended so far, by finish reason.

    Returns:
        Prometheus text, one ``# HELP``/``# TYPE`` pair per metric.
    """
    label = f'{{model_name="{model_name}"}}'
    lines: list[str] = []
    if manager.state != "destroyed":
        engine = manager.engine
        stats = engine.stats
        used = 1.0 - engine.block_manager.num_free_blocks / max(engine.num_blocks, 1)
        values = {
            "num_requests_running": len(engine.scheduler.running),
            "num_requests_waiting": len(engine.scheduler.waiting),
            "generation_tokens_total": stats.num_generated_tokens,
            "prompt_tokens_total": stats.num_prompt_tokens_computed,
            "kv_cache_usage_perc": round(used, 6),
            "prefix_cache_hits_total": stats.num_prefix_cache_hit_blocks,
            "num_preemptions_total": stats.num_preemptions,
        }
        for name, (kind, help_) in _ENGINE_METRICS.items():
            lines += _metric(f"rollout:{name}", kind, help_, [(label, values[name])])
    lines += _metric(
        "rollout:weight_version", "gauge", "Weight updates recorded by the engine.", [(label, manager.weight_version)]
    )
    samples = [(f'{{model_name="{model_name}",finished_reason="{r}"}}', n) for r, n in sorted(finished.items())]
    lines += _metric("rollout:request_success_total", "counter", "Choices ended, by finish reason.", samples)
    return "\n".join(lines) + "\n"
