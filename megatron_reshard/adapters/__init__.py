"""RL frameworks' weight-sync plug points over megatron_reshard (docs/ADAPTERS.md).

- ``verl``: verl 0.9.1's checkpoint engine ``megatron_reshard`` (``custom_backend_module=
  megatron_reshard.adapters.verl``).
- ``nemo_rl``: NeMo-RL's ``refit_transport: "megatron_reshard.adapters.nemo_rl:
  MegatronReshardCheckpointEngine"``.
- ``hand_off``: how a worker gives the engines the models they work on (``handoff``).
- ``core`` / ``options`` / ``topology`` / ``server_end``: what both share (no framework
  import).

Each framework module imports its framework; importing this package imports neither.
"""

from megatron_reshard.adapters.handoff import clear_hand_off, hand_off

__all__ = ["hand_off", "clear_hand_off"]
