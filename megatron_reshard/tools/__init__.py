"""Tooling around the library (not imported by a training job or a vLLM worker): model
presets at full size and the cluster-scale refit simulator behind ``megatron-reshard plan``."""
