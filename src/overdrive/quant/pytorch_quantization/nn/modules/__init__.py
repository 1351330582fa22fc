"""pytorch-quantization's ``nn.modules`` paths: ``_utils`` (``QuantMixin``, ``QuantInputMixin``,
``pop_quant_desc_in_kwargs`` for custom quantized modules), ``tensor_quantizer``, ``quant_linear``, ``quant_conv``,
``quant_pooling``; each holds the classes of :mod:`overdrive.quant.pytorch_quantization.nn`.

Example:
    >>> from overdrive.quant.pytorch_quantization.nn.modules import _utils as quant_nn_utils
    >>> quant_nn_utils.QuantMixin.default_quant_desc_weight.axis is None
    True
"""
