"""pytorch-quantization's ``calib``: the calibrator classes a quantizer's ``_calibrator`` is an instance of
(the TensorRT samples test ``isinstance(module._calibrator, calib.MaxCalibrator)``)."""

from overdrive.quant.calibrators import HistogramCalibrator, MaxCalibrator

__all__ = ["MaxCalibrator", "HistogramCalibrator"]
