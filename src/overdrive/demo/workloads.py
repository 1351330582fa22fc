"""What each demo run trains and serves: a model, an input size and batch sizes chosen per device.

``--quick`` keeps the tiny digits CNN on 8x8 images (seconds on a laptop; what CI runs). By default a GPU
gets ResNet-18 on the digits upscaled to 224x224, where mixed precision, engines and int8/fp8 have enough
arithmetic to pay; a CPU gets a small ResNet on 32x32 digits, sized so the whole demo stays within a few
minutes on two cores. The transformer stage has its own sizes (:func:`choose_transformer`): a tiny BERT with
``--quick``, MiniLM sizes on a CPU, BERT-base on a GPU.

Example:
    >>> w = choose_workload(torch.device("cpu"), quick=True)
    >>> w.name, w.image_size
    ('digits CNN', 8)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class Workload:
    """One demo run's model and sizes. ``width is None`` is the digits CNN, else a :class:`ResNet`."""

    name: str
    image_size: int
    batch_size: int  # training batch
    infer_batch: int  # engines and inference timing
    epochs: int
    lr: float = 3e-3
    width: int | None = None
    depths: tuple[int, ...] = (2, 2, 2, 2)
    stem: str = "imagenet"

    def make_model(self) -> nn.Module:
        from overdrive.recipes.models import DigitsCNN, ResNet

        return DigitsCNN() if self.width is None else ResNet(self.width, self.depths, self.stem)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (1, self.image_size, self.image_size)

    @property
    def quick(self) -> bool:
        """True for the ``--quick`` workload (the digits CNN)."""
        return self.width is None


def choose_workload(device: torch.device, quick: bool, batch_size: int | None = None,
                    epochs: int | None = None) -> Workload:
    """The workload for ``device``: the digits CNN with ``quick``, else one where the techniques pay."""
    if quick:
        w = Workload("digits CNN", 8, batch_size or 64, 64, epochs or 8)
    elif device.type == "cuda":
        w = Workload("ResNet-18, digits upscaled to 224x224", 224, batch_size or 128, 256, epochs or 12, width=64)
    else:
        w = Workload("ResNet (width 16) on digits upscaled to 32x32", 32, batch_size or 64, 128, epochs or 4,
                     width=16, depths=(1, 1, 1, 1), stem="small")
    return w


@dataclass(frozen=True)
class TransformerWorkload:
    """The transformer stage's encoder and shapes: a Hugging Face ``BertModel`` built from a config (random
    weights: nothing is downloaded), run on ``batch`` rows at each of ``seqs`` tokens.

    Example:
        >>> w = choose_transformer(torch.device("cpu"), quick=True)
        >>> w.hidden, w.layers, w.max_seq
        (64, 2, 32)
    """

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int  # the CPU sizes keep it small: the embedding's size is build time (export, quantization), not speed
    batch: int
    seqs: tuple[int, ...]
    calib_batches: int  # int8/fp8 calibration batches of (batch, max_seq) tokens
    held_out: int  # batches per sequence length for the accuracy check
    repeat: int  # timed calls per row

    @property
    def max_seq(self) -> int:
        return max(self.seqs)

    def make_model(self, seed: int = 0) -> nn.Module:
        """The fp32 encoder in eval mode, on the CPU, the same for one seed (the global RNG is left as it was)."""
        import transformers

        cfg = transformers.BertConfig(hidden_size=self.hidden, num_hidden_layers=self.layers,
                                      num_attention_heads=self.heads, intermediate_size=4 * self.hidden,
                                      vocab_size=self.vocab, max_position_embeddings=512)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return transformers.BertModel(cfg).eval()


def choose_transformer(device: torch.device, quick: bool) -> TransformerWorkload:
    """The transformer stage's sizes: tiny with ``quick``; MiniLM-L6 sizes on a CPU (its int8 build and
    ``torch.compile`` fit in about a minute on two cores); BERT-base at batch 8 and up to 128 tokens on a GPU."""
    if quick:
        return TransformerWorkload("tiny BERT (hidden 64, 2 layers)", 64, 2, 2, 1000, 4, (8, 32), 2, 2, 30)
    if device.type == "cuda":
        return TransformerWorkload("BERT-base (hidden 768, 12 layers)", 768, 12, 12, 30522, 8, (16, 64, 128), 8, 4, 30)
    return TransformerWorkload("MiniLM-sized BERT (hidden 384, 6 layers, vocab 8192)", 384, 6, 12, 8192, 4, (16, 64),
                               2, 2, 5)


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """(N, 1, 8, 8) digits in [0, 1] -> (N, 1, size, size), bilinear (what an upscaled photo of a digit looks like)."""
    if x.shape[-1] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp_(0, 1)


class DeviceBatches:
    """Shuffled (x, y) batches of tensors that already live on the training device: no DataLoader, no
    host-to-device copy per step (what a GPU training loop over an in-memory dataset should do).

    Example:
        >>> b = DeviceBatches(torch.randn(10, 1, 4, 4), torch.arange(10), batch_size=4, seed=0)
        >>> len(b), [tuple(x.shape) for x, _ in b]
        (2, [(4, 1, 4, 4), (4, 1, 4, 4)])
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        self.x, self.y, self.batch_size, self.shuffle, self.drop_last = x, y, batch_size, shuffle, drop_last
        self._g = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.x)
        order = torch.randperm(n, generator=self._g) if self.shuffle else torch.arange(n)
        order = order.to(self.x.device)
        for i in range(len(self)):
            idx = order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x.index_select(0, idx), self.y.index_select(0, idx)
