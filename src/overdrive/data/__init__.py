"""GPU image pipeline and fast tokenization: ``ImageLoader`` (nvJPEG decode + per-sample crops on
the GPU, or CPU workers), ``tokenize`` (a fast tokenizer across processes, cached on disk).

Example:
    >>> from overdrive import data
    >>> cfg = data.LoaderConfig(batch_size=64, size=160)
    >>> # loader = data.ImageLoader("train/", batch_size=64, device="cuda", pipeline="auto")
"""

from overdrive.data.api import (
    IMAGENET_EVAL,
    IMAGENET_TRAIN,
    PRESETS,
    ImageLoader,
    LoaderConfig,
    LoaderStats,
    TokenizedTexts,
    bench,
    make_sample_dataset,
    measure,
    prune_token_cache,
    shard_indices,
    read_texts,
    tokenize,
)

__all__ = [
    # images
    "ImageLoader", "LoaderConfig", "LoaderStats", "IMAGENET_TRAIN", "IMAGENET_EVAL", "PRESETS", "shard_indices",
    "bench", "measure", "make_sample_dataset",
    # text
    "tokenize", "TokenizedTexts", "read_texts", "prune_token_cache",
]
