"""The training loop that later techniques plug into: model, optimizer, data, amp policy.

Example:
    >>> import torch
    >>> from overdrive.train import Trainer
    >>> model = torch.nn.Linear(4, 3)
    >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="O0", progress=False)
    >>> data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    >>> result = trainer.fit(data, epochs=1)
    >>> from overdrive.train import EarlyStopping
    >>> result = trainer.fit(data, max_epochs=5, early_stopping=EarlyStopping(monitor="loss", patience=1))
    >>> from overdrive.train import TrainConfig
    >>> trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), TrainConfig(policy="O0", progress=False))
"""

from overdrive.train.checkpoint import load_checkpoint, save_checkpoint
from overdrive.train.config import TrainConfig
from overdrive.train.early_stopping import EarlyStopping
from overdrive.train.loop import EpochStats, FitResult, Trainer, evaluate, memory_mib

__all__ = [
    "Trainer", "TrainConfig", "FitResult", "EpochStats", "EarlyStopping", "evaluate", "memory_mib", "save_checkpoint",
    "load_checkpoint",
]
