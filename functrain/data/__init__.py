"""Data: each rank's part of a dataset, resumable positions, evaluation gathering.

:func:`shard` gives each rank its disjoint part of a dataset (:mod:`.loader`), picking one
source per kind of data (:mod:`.sources` map-style, :mod:`.arrays` in-memory columns,
:mod:`.streams` iterables); :func:`gather_for_eval` collects evaluation outputs once per
sample (:mod:`.gather`); :class:`ImageFolder` reads a folder of images (:mod:`.image_folder`, Pillow). The collectives it needs are a detail (``functrain.distributed.comm``).
"""
from .gather import gather_for_eval
from .image_folder import ImageFolder
from .loader import BatchInfo, ShardedLoader, shard

__all__ = ["shard", "ShardedLoader", "BatchInfo", "gather_for_eval", "ImageFolder"]
