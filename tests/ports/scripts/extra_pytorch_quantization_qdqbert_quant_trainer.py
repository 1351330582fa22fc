# source: Hugging Face examples/research_projects/quantization-qdqbert (quant_trainer.py + the QDQBert model): argparse quant args, set_default_quantizers (QuantDescriptor(num_bits=args.aprec, calib_method="histogram"), weights axis=(0,)) before the model is built, matmul_{q,k,v,a}_input_quantizer = TensorQuantizer(QuantLinear.default_quant_desc_input) in self-attention, enable_calibration / finish_calibration over named_modules ending in "_quantizer" with _calibrator, load_calib_amax("percentile", percentile=...), configure_model: set_quantizer_by_name(..., _disabled=True) with hasattr checks, recalibrate_weights with pytorch_quantization.utils.reduce_amax(keepdims=True) assigned to _weight_quantizer._amax and set(axis), fuse_qkv (_amax.fill_), clip_gelu (_amax.data.clamp_), print_quant_summary (isinstance pytorch_quantization.nn.TensorQuantizer), then QAT
# library: pytorch-quantization
# group: quant
# count: extra
# device: written device-agnostic (model.to(device) where quant_trainer calls model.cuda()); a 2-layer BERT-like encoder built here stands in for QDQBertForSequenceClassification
"""The qdqbert quant_trainer flow: histogram calibration, per-channel weights, amax surgery, QAT."""
import argparse
import logging
import math
import re

import torch
import torch.nn as nn

# was: import pytorch_quantization
import overdrive.quant.pytorch_quantization as pytorch_quantization
# was: import pytorch_quantization.nn as quant_nn
import overdrive.quant.pytorch_quantization.nn as quant_nn
# was: from pytorch_quantization import calib
from overdrive.quant.pytorch_quantization import calib
# was: from pytorch_quantization.tensor_quant import QuantDescriptor
from overdrive.quant.pytorch_quantization.tensor_quant import QuantDescriptor

logger = logging.getLogger(__name__)
device = "cuda" if torch.cuda.is_available() else "cpu"
name_width = 50
VOCAB, D, HEADS = 40, 32, 4


# ---------------------------------------------------------------- quant_trainer.py
def add_arguments(parser):
    group = parser.add_argument_group("quant_trainer arguments")
    group.add_argument("--wprec", type=int, default=8, help="weight precision")
    group.add_argument("--aprec", type=int, default=8, help="activation precision")
    group.add_argument("--quant-per-tensor", action="store_true", help="per tensor weight scaling")
    group.add_argument("--quant-disable", action="store_true", help="disable all quantizers")
    group.add_argument("--quant-disable-embeddings", action="store_true", help="disable all embeddings quantizers")
    group.add_argument("--quant-disable-keyword", type=str, nargs="+", help="disable quantizers by keyword")
    group.add_argument("--calibrator", default="max", help="which quantization range calibrator to use")
    group.add_argument("--percentile", default=None, type=float, help="percentile for PercentileCalibrator")
    group.add_argument("--fuse-qkv", action="store_true", help="use the same scale factor for qkv")
    group.add_argument("--clip-gelu", metavar="N", type=float, help="clip gelu output maximum value to N")
    group.add_argument("--recalibrate-weights", action="store_true", help="recalibrate weight amaxes")


def set_default_quantizers(args):
    if args.calibrator == "max":
        calib_method = "max"
    elif args.calibrator == "percentile":
        if args.percentile is None:
            raise ValueError("Specify --percentile when using percentile calibrator")
        calib_method = "histogram"
    elif args.calibrator == "mse":
        calib_method = "histogram"
    else:
        raise ValueError(f"Invalid calibrator {args.calibrator}")
    input_desc = QuantDescriptor(num_bits=args.aprec, calib_method=calib_method)
    weight_desc = QuantDescriptor(num_bits=args.wprec, axis=(None if args.quant_per_tensor else (0,)))
    quant_nn.QuantLinear.set_default_quant_desc_input(input_desc)
    quant_nn.QuantLinear.set_default_quant_desc_weight(weight_desc)


def configure_model(model, args, calib=False):
    logger.info("Configuring Model for Quantization")
    logger.info(f"using quantization package {pytorch_quantization.__file__}")
    if not calib:
        if args.quant_disable_embeddings:
            set_quantizer_by_name(model, ["embeddings"], which="weight", _disabled=True)
        if args.quant_disable:
            set_quantizer_by_name(model, [""], _disabled=True)
        if args.quant_disable_keyword:
            set_quantizer_by_name(model, args.quant_disable_keyword, _disabled=True)
        if args.recalibrate_weights:
            recalibrate_weights(model)
        if args.fuse_qkv:
            fuse_qkv(model, args)
    if args.clip_gelu:
        clip_gelu(model, args.clip_gelu)
    print_quant_summary(model)


def enable_calibration(model):
    logger.info("Enabling Calibration")
    for name, module in model.named_modules():
        if name.endswith("_quantizer"):
            if module._calibrator is not None:
                module.disable_quant()
                module.enable_calib()
            else:
                module.disable()
            logger.info(f"{name:80}: {module}")


def finish_calibration(model, args):
    logger.info("Loading calibrated amax")
    for name, module in model.named_modules():
        if name.endswith("_quantizer"):
            if module._calibrator is not None:
                if isinstance(module._calibrator, calib.MaxCalibrator):
                    module.load_calib_amax()
                else:
                    module.load_calib_amax("percentile", percentile=args.percentile)
                module.enable_quant()
                module.disable_calib()
            else:
                module.enable()
    model.to(device)
    print_quant_summary(model)


def fuse_qkv(model, args):
    def fuse3(qq, qk, qv):
        for mod in [qq, qk, qv]:
            if not hasattr(mod, "_amax"):
                print("          WARNING: NO AMAX BUFFER")
                return
        q = qq._amax.detach().item()
        k = qk._amax.detach().item()
        v = qv._amax.detach().item()
        amax = max(q, k, v)
        qq._amax.fill_(amax)
        qk._amax.fill_(amax)
        qv._amax.fill_(amax)
        logger.info(f"          q={q:5.2f} k={k:5.2f} v={v:5.2f} -> {amax:5.2f}")

    for name, mod in model.named_modules():
        if name.endswith(".attention.self"):
            logger.info(f"FUSE_QKV: {name:{name_width}}")
            fuse3(mod.matmul_q_input_quantizer, mod.matmul_k_input_quantizer, mod.matmul_v_input_quantizer)
            if args.quant_per_tensor:
                fuse3(mod.query._weight_quantizer, mod.key._weight_quantizer, mod.value._weight_quantizer)


def clip_gelu(model, maxval):
    for name, mod in model.named_modules():
        if name.endswith(".output.dense") and not name.endswith("attention.output.dense"):
            amax_init = mod._input_quantizer._amax.data.detach().item()
            mod._input_quantizer._amax.data.detach().clamp_(max=maxval)
            amax = mod._input_quantizer._amax.data.detach().item()
            logger.info(f"CLIP_GELU: {name:{name_width}} amax: {amax_init:5.2f} -> {amax:5.2f}")


def recalibrate_weights(model):
    for name, mod in model.named_modules():
        if hasattr(mod, "_weight_quantizer"):
            if not hasattr(mod.weight_quantizer, "_amax"):
                print("RECALIB: {name:{name_width}} WARNING: NO AMAX BUFFER")
                continue
            # e.g. a 4D tensor quantized per axis 0 should reduce over (1,2,3)
            axis_set = set() if mod._weight_quantizer.axis is None else set(mod._weight_quantizer.axis)
            reduce_axis = set(range(len(mod.weight.size()))) - axis_set
            amax = pytorch_quantization.utils.reduce_amax(mod.weight, axis=reduce_axis, keepdims=True).detach()
            logger.info(f"RECALIB: {name:{name_width}} {mod._weight_quantizer._amax.flatten()} -> {amax.flatten()}")
            mod._weight_quantizer._amax = amax


def print_quant_summary(model):
    count = 0
    for name, mod in model.named_modules():
        if isinstance(mod, pytorch_quantization.nn.TensorQuantizer):
            print(f"{name:80} {mod}")
            count += 1
    print(f"{count} TensorQuantizers found in model")


def set_quantizer(name, mod, quantizer, k, v):
    quantizer_mod = getattr(mod, quantizer, None)
    if quantizer_mod is not None:
        assert hasattr(quantizer_mod, k)
        setattr(quantizer_mod, k, v)
    else:
        logger.warning(f"{name} has no {quantizer}")


def set_quantizers(name, mod, which="both", **kwargs):
    for k, v in kwargs.items():
        if which in ["input", "both"]:
            set_quantizer(name, mod, "_input_quantizer", k, v)
        if which in ["weight", "both"]:
            set_quantizer(name, mod, "_weight_quantizer", k, v)


def set_quantizer_by_name(model, names, **kwargs):
    for name, mod in model.named_modules():
        if hasattr(mod, "_input_quantizer") or hasattr(mod, "_weight_quantizer"):
            for n in names:
                if re.search(n, name):
                    set_quantizers(name, mod, **kwargs)
        elif name.endswith("_quantizer"):
            for n in names:
                if re.search(n, name):
                    for k, v in kwargs.items():
                        setattr(mod, k, v)


# ---------------------------------------------------------------- a QDQBert-like model
class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = (quant_nn.QuantLinear(D, D) for _ in range(3))
        self.matmul_q_input_quantizer = quant_nn.TensorQuantizer(quant_nn.QuantLinear.default_quant_desc_input)
        self.matmul_k_input_quantizer = quant_nn.TensorQuantizer(quant_nn.QuantLinear.default_quant_desc_input)
        self.matmul_v_input_quantizer = quant_nn.TensorQuantizer(quant_nn.QuantLinear.default_quant_desc_input)
        self.matmul_a_input_quantizer = quant_nn.TensorQuantizer(quant_nn.QuantLinear.default_quant_desc_input)

    def heads(self, x):
        b, t, _ = x.shape
        return x.view(b, t, HEADS, D // HEADS).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        scores = torch.matmul(self.matmul_q_input_quantizer(q), self.matmul_k_input_quantizer(k).transpose(-1, -2))
        probs = torch.softmax(scores / math.sqrt(D // HEADS), dim=-1)
        ctx = torch.matmul(self.matmul_a_input_quantizer(probs), self.matmul_v_input_quantizer(v))
        return ctx.transpose(1, 2).reshape(x.shape)


class Output(nn.Module):
    def __init__(self, d_in):
        super().__init__()
        self.dense, self.LayerNorm = quant_nn.QuantLinear(d_in, D), nn.LayerNorm(D)

    def forward(self, h, x):
        return self.LayerNorm(self.dense(h) + x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.self, self.output = SelfAttention(), Output(D)

    def forward(self, x):
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = quant_nn.QuantLinear(D, 4 * D)

    def forward(self, x):
        return nn.functional.gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.intermediate, self.output = Attention(), Intermediate(), Output(4 * D)

    def forward(self, x):
        x = self.attention(x)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList([Layer(), Layer()])


class BertForSequenceClassification(nn.Module):
    def __init__(self, num_labels=2):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, D)
        self.encoder = Encoder()
        self.classifier = quant_nn.QuantLinear(D, num_labels)

    def forward(self, input_ids):
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.classifier(x[:, 0])


def dataset(seed, n):
    """Label 1 when token 7 occurs in the sequence (token 0 is [CLS])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, VOCAB, (n, 12), generator=g)
    ids[:, 0] = 0
    y = torch.arange(n) % 2
    pos = torch.randint(1, 12, (n,), generator=g)
    ids[y == 1, pos[y == 1]] = 7
    return torch.utils.data.TensorDataset(ids, y)


def train(model, loader, lr, epochs, max_steps=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for step, (ids, y) in enumerate(loader):
            if max_steps is not None and step >= max_steps:
                break
            opt.zero_grad()
            nn.functional.cross_entropy(model(ids.to(device)), y.to(device)).backward()
            opt.step()
    model.eval()


def evaluate(model, loader):
    with torch.no_grad():
        logits = torch.cat([model(ids.to(device)) for ids, _ in loader])
    labels = torch.cat([y for _, y in loader]).to(device)
    return (logits.argmax(1) == labels).float().mean().item(), logits


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # run_quant_qa.py is run twice: --do_calib (calibrate, save), then fine-tuning with the surgery flags
    args = parser.parse_args(["--calibrator", "percentile", "--percentile", "99.99"])
    qat_args = parser.parse_args(["--calibrator", "percentile", "--percentile", "99.99", "--recalibrate-weights",
                                  "--fuse-qkv", "--clip-gelu", "10.0", "--quant-disable-keyword", "classifier"])
    set_default_quantizers(args)

    torch.manual_seed(0)
    train_loader = torch.utils.data.DataLoader(dataset(0, 256), batch_size=32, shuffle=True,
                                               generator=torch.Generator().manual_seed(0))
    test_loader = torch.utils.data.DataLoader(dataset(1, 128), batch_size=64)

    # fine-tune the float model first: quantizers off (quant_trainer's --quant-disable)
    model = BertForSequenceClassification().to(device)
    set_quantizer_by_name(model, [""], _disabled=True)
    train(model, train_loader, lr=3e-3, epochs=2)
    float_acc, float_logits = evaluate(model, test_loader)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    # run_quant_qa.py --do_calib: a fresh model with the fine-tuned weights, calibrated on a few batches
    model = BertForSequenceClassification().to(device)
    model.load_state_dict(state)
    model.eval()
    configure_model(model, args, calib=True)
    with torch.no_grad():
        enable_calibration(model)
        for i, (ids, _) in enumerate(train_loader):
            model(ids.to(device))
            if i >= 1:
                break
        finish_calibration(model, args)
    torch.save(model.state_dict(), "calibrated.pt")

    # the fine-tuning run: a fresh model, the calibrated checkpoint, the quant_trainer surgery
    model = BertForSequenceClassification().to(device)
    model.load_state_dict(torch.load("calibrated.pt"))
    model.eval()
    configure_model(model, qat_args)
    ptq_acc, ptq_logits = evaluate(model, test_loader)

    attn = model.encoder.layer[0].attention.self
    amaxes = [attn.matmul_q_input_quantizer.amax, attn.matmul_k_input_quantizer.amax, attn.matmul_v_input_quantizer.amax]
    assert all(torch.equal(a, amaxes[0]) for a in amaxes), amaxes  # fuse_qkv
    assert model.encoder.layer[0].output.dense._input_quantizer.amax.item() <= 10.0  # clip_gelu
    assert isinstance(attn.query._input_quantizer._calibrator, calib.HistogramCalibrator)
    assert isinstance(attn.query._weight_quantizer._calibrator, calib.MaxCalibrator)
    # recalibrate_weights: max |w| per output row
    wq = attn.query._weight_quantizer
    torch.testing.assert_close(wq.amax.flatten(), attn.query.weight.detach().abs().amax(dim=1), rtol=0, atol=0)
    assert model.classifier._input_quantizer._disabled and model.classifier._weight_quantizer._disabled
    assert float_acc > 0.9, float_acc
    assert ptq_acc >= float_acc - 0.05, (ptq_acc, float_acc)
    rel = ((ptq_logits - float_logits).norm() / float_logits.norm()).item()
    assert 0 < rel < 0.1, rel

    # QAT: fine-tune with the quantizers on at a small learning rate
    train(model, train_loader, lr=1e-4, epochs=1, max_steps=4)
    qat_acc, _ = evaluate(model, test_loader)
    assert qat_acc >= float_acc - 0.05, (qat_acc, float_acc)
    torch.save(model.state_dict(), "qat_model.pt")

    # a fresh model loads the QAT checkpoint, amax included, and computes the same logits
    restored = BertForSequenceClassification().to(device)
    set_quantizer_by_name(restored, qat_args.quant_disable_keyword, _disabled=True)
    restored.load_state_dict(torch.load("qat_model.pt"))
    restored.eval()
    with torch.no_grad():
        ids = next(iter(test_loader))[0].to(device)
        torch.testing.assert_close(restored(ids), model(ids), rtol=0, atol=0)
