"""The public verbs of overdrive.data, in one place."""

from overdrive.data.auto import bench, measure
from overdrive.data.config import IMAGENET_EVAL, IMAGENET_TRAIN, PRESETS, LoaderConfig
from overdrive.data.loader import ImageLoader, LoaderStats, shard_indices
from overdrive.data.samples import make_sample_dataset
from overdrive.data.tokenize import TokenizedTexts, tokenize

__all__ = ["ImageLoader", "LoaderConfig", "LoaderStats", "IMAGENET_TRAIN", "IMAGENET_EVAL", "PRESETS", "shard_indices",
           "bench", "measure", "make_sample_dataset", "tokenize", "TokenizedTexts"]
