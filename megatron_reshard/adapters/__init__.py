"""RL frameworks' weight-sync plug points over megatron_reshard (docs/ADAPTERS.md).

- ``verl``: verl 0.9.1's checkpoint engine ``megatron_reshard`` (``custom_backend_module=
  megatron_reshard.adapters.verl``).
- ``nemo_rl``: NeMo-RL's ``refit_transport: "megatron_reshard.adapters.nemo_rl:
  MegatronReshardCheckpointEngine"``.
- ``core`` / ``options``: what both share (no framework import).

Each framework module imports its framework; importing this package imports neither.
"""
