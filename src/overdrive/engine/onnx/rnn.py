"""The ONNX recurrent ops (LSTM, GRU, RNN) of overdrive's importer, as torch's fused cells.

Example:
    >>> sorted(OPS)
    ['GRU', 'LSTM', 'RNN']
"""

from __future__ import annotations

import torch

from overdrive._utils.errors import UsageError
from overdrive.engine.onnx.values import Op, OpModule, Value, _tensor


def recurrent(kind: str) -> Op:
    """ONNX LSTM / GRU / RNN as torch's fused ``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` (cuDNN on CUDA):
    ONNX's gate blocks reordered into PyTorch's (LSTM i,o,f,c -> i,f,c,o; GRU z,r,h -> r,z,h), its W/R/B split per
    direction, ``layout`` 0 (sequence first) or 1 (batch first), forward / reverse / bidirectional. What torch's
    cells cannot compute is named: other activations, ``clip``, ``input_forget``, peepholes, per-row
    ``sequence_lens``, GRU with linear_before_reset=0. Outputs Y (seq, dirs, batch, hidden) (layout 1: batch, seq,
    dirs, hidden), Y_h (and LSTM's Y_c)."""
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind]
    order = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}[kind]  # PyTorch's gate k is ONNX's block order[k]
    default_acts = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}[kind]

    def run(m: OpModule, ins: list[Value], a: dict) -> list[Value]:
        ins = ins + [None] * (8 - len(ins))
        x, w, r, b, seq_lens, h0 = ins[:6]
        c0, peep = (ins[6], ins[7]) if kind == "LSTM" else (None, None)
        direction = a.get("direction", "forward")
        direction = direction.decode() if isinstance(direction, bytes) else direction
        acts = [v.decode() if isinstance(v, bytes) else v for v in a.get("activations", [])]
        relu = kind == "RNN" and bool(acts) and set(acts) == {"Relu"}  # torch's rnn_relu
        if relu:
            acts = []
        bad = [f"activations {acts}" if acts and acts != default_acts * (2 if direction == "bidirectional" else 1)
               else "", "clip" if "clip" in a else "", "input_forget" if int(a.get("input_forget", 0)) else "",
               "peepholes (P)" if peep is not None else "",
               "linear_before_reset=0" if kind == "GRU" and not int(a.get("linear_before_reset", 0)) else ""]
        if any(bad):
            raise UsageError(f"ONNX {kind} with {', '.join(x for x in bad if x)} has no torch.{kind.lower()} form; "
                             "export the model with PyTorch's nn.LSTM / nn.GRU defaults, or use the onnxruntime backend")
        x = _tensor(x)
        batch_first = int(a.get("layout", 0)) == 1
        if seq_lens is not None:  # accepted where every row runs the whole sequence, known when the graph is built
            if isinstance(seq_lens, torch.Tensor):  # a graph input or computed: rows could stop early, unseen here
                raise UsageError(f"ONNX {kind} with sequence_lens computed at run time: per-row lengths are not "
                                 "supported; export without them (pad the sequences), or use the onnxruntime backend")
            lens = _tensor(seq_lens)
            if bool((lens != x.shape[1 if batch_first else 0]).any()):
                raise UsageError(f"ONNX {kind} with per-row sequence_lens {lens.tolist()}: not supported; pad the "
                                 "sequences, or use the onnxruntime backend")
        w, r = _tensor(w, x), _tensor(r, x)
        dirs, hidden = w.shape[0], int(a["hidden_size"])
        b = _tensor(b, x) if b is not None else torch.zeros(dirs, 2 * gates * hidden, dtype=x.dtype, device=x.device)

        def blocks(t: torch.Tensor) -> torch.Tensor:  # (gates*hidden, ...) in ONNX's order -> PyTorch's
            return torch.cat([t[k * hidden:(k + 1) * hidden] for k in order])

        params: list[torch.Tensor] = []
        for d in range(dirs):
            params += [blocks(w[d]), blocks(r[d]), blocks(b[d, :gates * hidden]), blocks(b[d, gates * hidden:])]
        if direction == "reverse":  # one direction, run backwards: flip the sequence in and out
            x = x.flip(1 if batch_first else 0)
        n = x.shape[0 if batch_first else 1]
        zeros = torch.zeros(dirs, n, hidden, dtype=x.dtype, device=x.device)
        hx = _tensor(h0, x) if h0 is not None else zeros
        if batch_first and h0 is not None:  # layout 1: initial states (batch, dirs, hidden)
            hx = hx.transpose(0, 1)
        bidir = direction == "bidirectional"
        if kind == "LSTM":
            cx = _tensor(c0, x) if c0 is not None else zeros
            if batch_first and c0 is not None:
                cx = cx.transpose(0, 1)
            y, h, c = torch.lstm(x, (hx, cx), params, True, 1, 0.0, False, bidir, batch_first)
        else:
            fn = torch.gru if kind == "GRU" else torch.rnn_relu if relu else torch.rnn_tanh
            y, h = fn(x, hx, params, True, 1, 0.0, False, bidir, batch_first)
            c = None
        if direction == "reverse":
            y = y.flip(1 if batch_first else 0)
        if batch_first:  # (batch, seq, dirs*hidden) -> (batch, seq, dirs, hidden); states (batch, dirs, hidden)
            y = y.reshape(y.shape[0], y.shape[1], dirs, hidden)
            h, c = h.transpose(0, 1), (c.transpose(0, 1) if c is not None else None)
        else:  # (seq, batch, dirs*hidden) -> (seq, dirs, batch, hidden)
            y = y.reshape(y.shape[0], y.shape[1], dirs, hidden).transpose(1, 2)
        return [y, h] + ([c] if c is not None else [])

    return run


OPS: dict[str, Op] = {kind: recurrent(kind) for kind in ("LSTM", "GRU", "RNN")}
# sequence_lens (input 4) read on the host: an initializer of any length stays there, so its values are checked
# when the graph is built
HOST_INPUTS = {kind: (4,) for kind in OPS}
