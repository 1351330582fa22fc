"""Coverage sweep of overdrive's ONNX importer against the models users export.

Tiny randomly initialised models (no downloads): Hugging Face BERT, DistilBERT, RoBERTa, GPT-2, T5 encoder, Llama, ViT,
ConvNeXt, ResNet, MobileNetV2, Swin, Whisper encoder, torchvision-style CNN blocks, LSTM and GRU. Each is
exported with the TorchScript exporter (opset 17) and the dynamo exporter (opset 18), batch axis dynamic (and the
sequence axis of the text models), imported with ``overdrive.engine.onnx.import_onnx`` and compared with ONNX
Runtime (ORT_ENABLE_BASIC) and with eager PyTorch at batch 1 and 3 (the export used batch 2; text models at 12
and 7 tokens). ``--export`` also runs ``torch.export`` on the imported module with those dims dynamic (what the
inductor backend does) and checks it at batch 3 (7 tokens).

    python benchmarks/engine_onnx_sweep.py --export            # this 2-core CPU: ~2 minutes
    python benchmarks/engine_onnx_sweep.py bert swin --ts      # some models, one exporter
Writes benchmarks/results/engine_onnx_sweep.json and .md (when every model is run).
"""
from __future__ import annotations

import io
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from _common import device_facts, write_results  # noqa: E402

from overdrive.engine.onnx import import_onnx  # noqa: E402

warnings.filterwarnings("ignore")


class Outs(nn.Module):
    """HF model called by name, returning a tuple of tensors."""

    def __init__(self, m: nn.Module, names: list[str], keys: list[str]) -> None:
        super().__init__()
        self.m, self.names, self.keys = m, names, keys

    def forward(self, x0, x1=None):
        o = self.m(**dict(zip(self.names, (x0, x1))))
        return tuple(o[k] for k in self.keys)


def _randomize_bn(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    return m.eval()


def text(kind: str):
    import transformers as tf

    V, T = 100, 12
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64)
    if kind == "bert":
        m = tf.BertModel(tf.BertConfig(**common))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "roberta":
        m = tf.RobertaModel(tf.RobertaConfig(**common, pad_token_id=1))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "distilbert":
        m = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                                   max_position_embeddings=64))
        keys = ["last_hidden_state"]
    elif kind == "gpt2":
        m = tf.GPT2Model(tf.GPT2Config(bos_token_id=1, eos_token_id=2, vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False))
        keys = ["last_hidden_state"]
    elif kind == "llama":
        m = tf.LlamaModel(tf.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                         use_cache=False))
        keys = ["last_hidden_state"]
    elif kind == "t5enc":
        m = tf.T5EncoderModel(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                          relative_attention_num_buckets=8, relative_attention_max_distance=16))
        keys = ["last_hidden_state"]
    m = m.eval()
    names = ["input_ids", "attention_mask"]

    def inputs(b, t=T):
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(2, V, (b, t), generator=g)
        mask = torch.ones(b, t, dtype=torch.int64)
        mask[-1, t // 2:] = 0  # padding in the last row
        return (ids, mask)

    return Outs(m, names, keys), names, inputs, {n: {0: "batch", 1: "sequence"} for n in names}


def vision(kind: str):
    import transformers as tf

    S = 32
    if kind == "vit":
        m = tf.ViTModel(tf.ViTConfig(image_size=S, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "convnext":
        m = tf.ConvNextModel(tf.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], image_size=S))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "resnet":
        m = tf.ResNetModel(tf.ResNetConfig(embedding_size=8, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                           layer_type="bottleneck"))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "mobilenetv2":
        m = tf.MobileNetV2Model(tf.MobileNetV2Config(image_size=S, depth_multiplier=0.35))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "swin":
        m = tf.SwinModel(tf.SwinConfig(image_size=S, patch_size=2, embed_dim=16, depths=[1, 2], num_heads=[2, 4],
                                       window_size=4))
        keys = ["last_hidden_state", "pooler_output"]
    elif kind == "whisper_enc":
        cfg = tf.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                               decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64, num_mel_bins=16,
                               max_source_positions=20, vocab_size=100, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        m = tf.WhisperModel(cfg).get_encoder()
        _randomize_bn(m)
        name = "input_features"

        def inputs(b):
            return (torch.randn(b, 16, 40, generator=torch.Generator().manual_seed(b)),)

        return Outs(m.eval(), [name], ["last_hidden_state"]), [name], inputs, {name: {0: "batch"}}
    m = _randomize_bn(m)
    name = "pixel_values"

    def inputs(b):
        return (torch.randn(b, 3, S, S, generator=torch.Generator().manual_seed(b)),)

    return Outs(m, [name], keys), [name], inputs, {name: {0: "batch"}}


# ---- hand-written torchvision-style blocks -------------------------------------------------------------
class SE(nn.Module):
    def __init__(self, c, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1), act

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * self.act(self.fc2(F.relu(self.fc1(s))))


class Blocks(nn.Module):
    """Depthwise-separable conv, SE (hardsigmoid / sigmoid+SiLU), hardswish, adaptive pools, interpolate,
    concat skips, ConvTranspose, GroupNorm, InstanceNorm."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
                                nn.Conv2d(16, 24, 1, bias=False), nn.BatchNorm2d(24))
        self.se1 = SE(24, nn.Hardsigmoid())
        self.se2 = SE(24, nn.Sigmoid())
        self.silu = nn.SiLU()
        self.down = nn.Conv2d(24, 32, 3, 2, 1)
        self.gn = nn.GroupNorm(4, 32)
        self.inorm = nn.InstanceNorm2d(32, affine=True)
        self.up = nn.ConvTranspose2d(32, 16, 4, 2, 1)
        self.up2 = nn.ConvTranspose2d(16, 8, 3, 2, 1, output_padding=1, groups=2)
        self.head = nn.Linear(16 + 24 + 8 + 32, 10)
        self.mish = nn.Mish()
        self.elu = nn.ELU()
        self.gelu_t = nn.GELU(approximate="tanh")

    def forward(self, x):
        h = self.stem(x)                                    # (B, 16, 16, 16)
        d = self.se2(self.se1(self.dw(h)))                  # (B, 24, 16, 16)
        d = self.silu(d)
        y = self.gn(self.down(d))                           # (B, 32, 8, 8)
        y = self.elu(self.inorm(y))
        u = self.up(y)                                      # (B, 16, 16, 16)
        cat = torch.cat([u + h, d], 1)                      # (B, 40, 16, 16)
        n = F.interpolate(y, scale_factor=2, mode="nearest")
        bl = F.interpolate(y, size=(16, 16), mode="bilinear", align_corners=False)
        ac = F.interpolate(y, scale_factor=2, mode="bilinear", align_corners=True)
        z = self.mish(n + bl) * self.gelu_t(ac)                            # (B, 32, 16, 16)
        u2 = self.up2(u)                                    # (B, 8, 32, 32)
        p = torch.cat([F.adaptive_avg_pool2d(cat, (1, 1)).flatten(1), F.adaptive_max_pool2d(u2, 1).flatten(1),
                       F.adaptive_avg_pool2d(z, 1).flatten(1)], 1)
        q = F.adaptive_avg_pool2d(cat, (2, 2)).mean((2, 3)) + F.max_pool2d(cat, 3, 2, 1, ceil_mode=True).amax((2, 3))
        return self.head(p), q


class RNNs(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(16, 24, num_layers=2, batch_first=True,
                                                          bidirectional=True)

    def forward(self, x):
        return self.rnn(x)[0]


def handmade(kind: str):
    if kind == "cnn_blocks":
        m = _randomize_bn(Blocks())

        def inputs(b):
            return (torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(b)),)
    else:
        m = RNNs(kind).eval()

        def inputs(b):
            return (torch.randn(b, 7, 16, generator=torch.Generator().manual_seed(b)),)
    return m, ["x"], inputs, {"x": {0: "batch"}}


MODELS = {k: (lambda k=k: text(k)) for k in ("bert", "distilbert", "roberta", "gpt2", "t5enc", "llama")}
MODELS.update({k: (lambda k=k: vision(k)) for k in ("vit", "convnext", "resnet", "mobilenetv2", "swin", "whisper_enc")})
MODELS.update({k: (lambda k=k: handmade(k)) for k in ("cnn_blocks", "lstm", "gru")})


def _dims(names, axes):
    """torch.export dynamic shapes for the named axes: one Dim per axis name, shared by the inputs that have it."""
    dims = {"batch": torch.export.Dim("batch", min=1, max=64), "sequence": torch.export.Dim("sequence", min=2, max=64)}
    return tuple({d: dims[label] for d, label in axes[n].items()} for n in names)


def _run_inputs(inputs, axes, names, b):
    """The inputs at batch ``b``: text models at 12 tokens for batch 1 and 7 for batch 3 (a length not exported)."""
    seq = any(1 in axes[n] for n in names)
    return inputs(b, 7) if seq and b == 3 else inputs(b)


def export(m, names, example, axes, exporter):
    with torch.no_grad():
        if exporter == "ts17":
            buf = io.BytesIO()
            torch.onnx.export(m, example, buf, dynamo=False, input_names=names, dynamic_axes=axes, opset_version=17)
            return buf.getvalue()
        dyn = _dims(names, axes)
        prog = torch.onnx.export(m, example, dynamo=True, input_names=names, dynamic_shapes=dyn, opset_version=18,
                                 verbose=False)
        return prog.model_proto.SerializeToString()


def run_one(name: str, exporter: str) -> dict:
    torch.manual_seed(0)
    import onnxruntime as ort

    res = {"model": name, "exporter": exporter}
    m, names, inputs, axes = MODELS[name]()
    t0 = time.time()
    try:
        onx = export(m, names, inputs(2), axes, exporter)
    except Exception as e:  # noqa: BLE001
        res.update(result="export failed", error=f"{type(e).__name__}: {str(e)[:300]}")
        return res
    res["export_s"] = round(time.time() - t0, 1)
    m.eval()  # the TorchScript exporter puts the wrapper back in train mode, recursively
    import onnx

    ops = sorted({n.op_type for n in onnx.load_from_string(onx).graph.node})
    res["ops"] = ops
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(onx, so, providers=["CPUExecutionProvider"])
    onames = [i.name for i in sess.get_inputs()]
    try:
        mod = import_onnx(onx)
    except Exception as e:  # noqa: BLE001
        res.update(result="import failed", error=f"{type(e).__name__}: {str(e)[:300]}")
        return res
    worst = 0.0
    worst_abs = 0.0
    for b in (1, 3):
        xs = _run_inputs(inputs, axes, names, b)
        refs = sess.run(None, {n: x.numpy() for n, x in zip(onames, xs)})
        try:
            with torch.no_grad():
                outs = mod(*xs)
        except Exception as e:  # noqa: BLE001
            res.update(result=f"run failed (batch {b})", error=f"{type(e).__name__}: {str(e)[:400]}")
            return res
        outs = outs if isinstance(outs, tuple) else (outs,)
        with torch.no_grad():
            eag = m(*xs)
        eag = eag if isinstance(eag, tuple) else (eag,)
        res["max_rel_eager"] = max(res.get("max_rel_eager", 0.0), max(
            float((o - e).abs().max() / e.abs().max().clamp_min(1e-6)) for o, e in zip(outs, eag)))
        if len(outs) != len(refs):
            res.update(result="output count", error=f"{len(outs)} vs {len(refs)}")
            return res
        for o, r in zip(outs, refs):
            if tuple(o.shape) != r.shape:
                res.update(result="shape mismatch", error=f"batch {b}: {tuple(o.shape)} vs {r.shape}")
                return res
            err = float(np.abs(o.double().numpy() - r.astype(np.float64)).max()) if r.size else 0.0
            scale = float(np.abs(r).max()) if r.size else 1.0
            worst_abs = max(worst_abs, err)
            worst = max(worst, err / max(scale, 1e-6))
    res["max_abs"] = worst_abs
    res["max_rel"] = worst  # max |a - b| / max |b|, over outputs and batch sizes 1 and 3
    res["result"] = "ok" if worst <= 1e-4 else "MISMATCH"
    if "--export" in sys.argv:  # the imported module under torch.export with a dynamic batch
        try:
            ep = torch.export.export(mod, inputs(2), dynamic_shapes=(_dims(names, axes),))
            xs = _run_inputs(inputs, axes, names, 3)
            got = ep.module()(*xs)
            got = got if isinstance(got, tuple) else (got,)
            ref = mod(*xs)
            ref = ref if isinstance(ref, tuple) else (ref,)
            e = max(float((a - b).abs().max()) for a, b in zip(got, ref))
            res["torch_export"] = "ok" if e < 1e-4 else f"diff {e:.2e}"
        except Exception as e:  # noqa: BLE001
            res["torch_export"] = f"FAILED {type(e).__name__}: {str(e)[:300]}"
    return res


def main() -> None:
    flags = {"--export", "--ts", "--dynamo"}
    if "-h" in sys.argv or "--help" in sys.argv:  # it used to run the whole sweep and rewrite the results
        print(__doc__.strip() + f"\n\nmodels: {' '.join(MODELS)}\nflags: {' '.join(sorted(flags))}")
        return
    bad = [a for a in sys.argv[1:] if (a.startswith("-") and a not in flags) or (not a.startswith("-") and a not in MODELS)]
    if bad:
        sys.exit(f"engine_onnx_sweep.py: unknown argument(s) {' '.join(bad)}; models: {' '.join(MODELS)}; "
                 f"flags: {' '.join(sorted(flags))}")
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(MODELS)
    exporters = ["ts17"] if "--ts" in sys.argv else ["dynamo18"] if "--dynamo" in sys.argv else ["ts17", "dynamo18"]
    rows = []
    for n in names:
        for ex in exporters:
            try:
                r = run_one(n, ex)
            except Exception:  # noqa: BLE001 - one model's failure is a row, not the end of the sweep
                r = {"model": n, "exporter": ex, "result": "sweep crash", "error": traceback.format_exc()[-600:]}
            print(json.dumps(r), flush=True)
            r["n_ops"] = len(r.pop("ops", []))
            for k in ("max_rel", "max_rel_eager"):
                if k in r:
                    r[k] = f"{r[k]:.1e}"
            if "error" in r:
                r["error"] = r["error"].split(";")[0].replace("|", "/")
            rows.append(r)
    if len(names) == len(MODELS) and len(exporters) == 2:
        cols = ["model", "exporter", "result", "max_rel", "max_rel_eager", "torch_export", "n_ops", "export_s", "error"]
        notes = ["max_rel: max |import - ORT| / max |ORT| over outputs, batch 1 and 3; max_rel_eager: the same "
                 "against eager PyTorch", "torch_export: torch.export of the imported module, dynamic batch (and sequence for the text models)"]
        write_results("engine_onnx_sweep", device_facts(torch.device("cpu")), rows, cols, notes)


if __name__ == "__main__":
    main()
