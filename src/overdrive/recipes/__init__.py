"""What the CLI verbs and the demo run, built on the technique packages and overdrive.train: model specs and
calibration files (``model_spec``), build-an-engine (``build``), quantize-a-model (``quantize``),
sparsify-a-checkpoint (``sparsify``), the QAT and accuracy recipes (``quant``), prune-and-fine-tune
(``sparsity``), and the small datasets and models that ship with overdrive (``data``, ``models``, ``textdata``).

Technique packages (amp, quant, data, sparsity, engine, distributed) and train never import this package.

Example:
    >>> from overdrive.recipes.model_spec import load_model
    >>> type(load_model("digits")).__name__
    'DigitsCNN'
"""
