# source: NVIDIA ModelOpt docs "PTQ for PyTorch models": config = copy.deepcopy(mtq.INT8_DEFAULT_CFG), edit quant_cfg wildcard patterns ("*lm_head*": {"enable": False}, a sensitive layer kept in float), def forward_loop(model) over a calibration DataLoader, model = mtq.quantize(model, config, forward_loop), mtq.print_quant_summary(model), then evaluate the fake-quantized model
# library: modelopt.torch.quantization
# group: quant
# device: written device-agnostic (device = "cuda" if available else "cpu")
"""ModelOpt INT8 PTQ of a tiny decoder LM with an edited preset, checked against the float model."""
import copy

import torch
import torch.nn as nn

# was: import modelopt.torch.quantization as mtq
import overdrive.quant.modelopt as mtq

device = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB, D = 64, 32


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.mlp = MLP()

    def forward(self, x):
        h = self.input_layernorm(x)
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, 4, D // 4).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.o_proj(a)
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([DecoderLayer(), DecoderLayer()])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def train_briefly(model):
    """A "pretrained" model: a few steps on a repeating-pattern language."""
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        start = torch.randint(0, VOCAB, (16, 1), generator=g)
        seq = (start + torch.arange(17) * 3) % VOCAB
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


if __name__ == "__main__":
    torch.manual_seed(0)
    model = train_briefly(TinyLM()).to(device).eval()
    float_model = copy.deepcopy(model)

    g = torch.Generator().manual_seed(1)
    calib_set = [(torch.randint(0, VOCAB, (1,), generator=g) + torch.arange(16) * 3) % VOCAB for _ in range(32)]
    data_loader = torch.utils.data.DataLoader(torch.stack(calib_set), batch_size=8)

    # Define forward_loop: the calibration data through the model
    def forward_loop(model):
        for batch in data_loader:
            model(batch.to(device))

    config = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    config["quant_cfg"]["*lm_head*"] = {"enable": False}
    config["quant_cfg"]["*layers.1.mlp.down_proj*"] = {"enable": False}  # a sensitive layer stays in float
    model = mtq.quantize(model, config, forward_loop)
    mtq.print_quant_summary(model)

    test = torch.stack([(torch.tensor([s]) + torch.arange(16) * 3) % VOCAB for s in range(0, VOCAB, 4)]).to(device)
    with torch.no_grad():
        ref, out = float_model(test), model(test)
    assert not torch.equal(ref, out)  # the model is quantized
    # int8 weights per channel, int8 activations per tensor: logits within 5% of float (relative L2), and the
    # next-token predictions agree on >= 95% of positions
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95
    assert not model.lm_head.input_quantizer.enabled and not model.lm_head.weight_quantizer.enabled
    assert not model.layers[1].mlp.down_proj.weight_quantizer.enabled
    assert model.layers[0].mlp.down_proj.input_quantizer.amax is not None  # calibrated by forward_loop
