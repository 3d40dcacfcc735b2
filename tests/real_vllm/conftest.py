"""The real-vLLM tests: vLLM's CPU-only environment is set before any test module imports
vLLM (vLLM resolves its platform when ``vllm.distributed`` is first imported)."""

from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment

set_vllm_cpu_environment()
