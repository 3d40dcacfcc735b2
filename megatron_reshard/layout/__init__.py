"""How a tensor is laid out over ranks: the vocabulary below every other package.

``placements`` names a layout (``MeshInfo``, ``PaddedShard``, ``BlockShard`` and torch's
``Shard`` / ``Replicate``); ``geometry`` turns a layout into boxes: which region of the
global tensor each rank holds. Torch only.
"""
