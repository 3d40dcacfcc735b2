"""The real-vLLM tests: vLLM's CPU-only environment is set before any test module imports
vLLM (vLLM resolves its platform when ``vllm.distributed`` is first imported).

The marker ``vllm_range`` selects the subset that also runs against the oldest vLLM of the
supported range (``make test-vllm-oldest``); the newest runs every test here."""

from megatron_reshard.testing.vllm_models import set_vllm_cpu_environment

set_vllm_cpu_environment()


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm_range: also run against the oldest supported vLLM "
                                       "(one layout per family, FP8, MLA, the plugin loading)")
