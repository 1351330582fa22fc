# source: NVIDIA DeepLearningExamples Tacotron2/WaveGlow inference (load_and_setup_model: load_state_dict, remove_weightnorm, eval(), `if amp_run: model, _ = amp.initialize(model, [], opt_level="O3")`), and the WaveGlow inference scripts' `waveglow, _ = amp.initialize(waveglow, [], opt_level="O3")`; inference through the models' own infer() methods under torch.no_grad()
# library: apex.amp
# group: amp
# device: written device-agnostic (device = "cuda" if available else "cpu"); WaveGlow's torch.cuda.HalfTensor(...).normal_() noise is torch.randn(..., dtype=spect.dtype, device=spect.device)
"""Inference-only amp: O3 (everything in the half dtype) with an empty optimizer list, two chained models."""
import copy

import torch
import torch.nn as nn

# was: from apex import amp
from overdrive.apex import amp

device = "cuda" if torch.cuda.is_available() else "cpu"


class TinyTacotron(nn.Module):
    def __init__(self, n_symbols=20, n_mel=8):
        super().__init__()
        self.embedding = nn.Embedding(n_symbols, 16)
        self.encoder = nn.Conv1d(16, 16, 3, padding=1)
        self.norm = nn.BatchNorm1d(16)
        self.decoder = nn.Linear(16, n_mel)

    def infer(self, inputs):
        x = self.embedding(inputs).transpose(1, 2)  # (B, 16, T)
        x = torch.relu(self.norm(self.encoder(x)))
        return self.decoder(x.transpose(1, 2)).transpose(1, 2)  # (B, n_mel, T)


class TinyWaveGlow(nn.Module):
    def __init__(self, n_mel=8, n_remaining_channels=4):
        super().__init__()
        self.n_remaining_channels = n_remaining_channels
        self.cond = nn.utils.weight_norm(nn.Conv1d(n_mel, 2 * n_remaining_channels, 1))
        self.WN = nn.utils.weight_norm(nn.Conv1d(n_remaining_channels, n_remaining_channels, 3, padding=1))

    def infer(self, spect, sigma=1.0):
        g = torch.Generator(device=spect.device).manual_seed(0)
        audio = torch.randn(spect.size(0), self.n_remaining_channels, spect.size(2), generator=g,
                            device=spect.device, dtype=torch.float32).to(spect.dtype)
        audio = sigma * audio
        log_s, b = self.cond(spect).chunk(2, dim=1)
        audio = torch.tanh(self.WN(audio)) * torch.exp(log_s) + b
        return audio.flatten(1)

    @staticmethod
    def remove_weightnorm(model):
        waveglow = model
        for m in (waveglow.cond, waveglow.WN):
            nn.utils.remove_weight_norm(m)
        return waveglow


def load_and_setup_model(model_name, state_dict, amp_run):
    model = TinyTacotron() if model_name == "Tacotron2" else TinyWaveGlow()
    model.load_state_dict(state_dict)
    if model_name == "WaveGlow":
        model = model.remove_weightnorm(model)
    model.to(device)
    model.eval()
    if amp_run:
        model, _ = amp.initialize(model, [], opt_level="O3")
    return model


if __name__ == "__main__":
    torch.manual_seed(0)
    trained = {"Tacotron2": TinyTacotron(), "WaveGlow": TinyWaveGlow()}
    with torch.no_grad():  # give the BatchNorm some running statistics, as a trained checkpoint has
        trained["Tacotron2"].norm.running_mean.normal_(0, 0.1)
        trained["Tacotron2"].norm.running_var.uniform_(0.5, 1.5)
    checkpoints = {name: copy.deepcopy(m.state_dict()) for name, m in trained.items()}

    sequences = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(3)).to(device)
    outputs = {}
    for amp_run in (False, True):
        tacotron2 = load_and_setup_model("Tacotron2", checkpoints["Tacotron2"], amp_run)
        waveglow = load_and_setup_model("WaveGlow", checkpoints["WaveGlow"], amp_run)
        with torch.no_grad():
            mel = tacotron2.infer(sequences)
            audios = waveglow.infer(mel, sigma=0.6)
        outputs[amp_run] = (mel, audios.float(), tacotron2, waveglow)

    mel16, audio16, tacotron2, waveglow = outputs[True]
    half = mel16.dtype
    assert half in (torch.float16, torch.bfloat16)  # O3: the whole pipeline ran in the half dtype
    assert all(p.dtype == half for p in list(tacotron2.parameters()) + list(waveglow.parameters()))
    mel32, audio32 = outputs[False][0], outputs[False][1]
    # half-precision rounding through two models: relative error of the waveform < 5e-2
    rel = ((audio16 - audio32).norm() / audio32.norm()).item()
    assert rel < 5e-2, rel
    assert torch.isfinite(audio16).all()
