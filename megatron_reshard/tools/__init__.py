"""Tooling around the library, never imported by a training job or a vLLM worker: the
``megatron-reshard`` CLI (``cli``), the CPU demo and its two-world launcher (``demo``,
``e2e``, ``run_config``, ``worlds``), the benchmarks (``bench``), and the full-size presets
and cluster-scale simulator behind ``megatron-reshard plan`` (``plan_cli``, ``presets``,
``plan_inputs``, ``simulate``, ``plot``)."""
