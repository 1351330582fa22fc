"""Every example in every verb's --help works as written: each parses (flags, types and ranges), and those
that need no GPU, no network and no dataset download run here on CPU against small stand-ins for the files
they name (model.onnx, mypkg/models.py, calib.pt, ...), in a fresh folder. An example added to a --help
must be listed below, run or parse-only with the reason, so none goes untried."""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import click
import pytest
import torch

from overdrive.cli.main import cli, main


def _commands(cmd: click.Command, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    out = [(path, cmd)]
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            out += _commands(cmd.get_command(ctx, name), (*path, name))  # type: ignore[arg-type]
    return out


def help_examples() -> list[str]:
    """The command lines of the Example(s): blocks of every --help, continuation lines joined."""
    found: list[str] = []
    for _, cmd in _commands(cli):
        block, cur = False, ""
        for line in (cmd.help or "").splitlines():
            s = line.strip()
            if s in ("Example:", "Examples:"):
                block = True
                continue
            if not block or not (s.startswith("overdrive ") or s == "overdrive" or cur):
                continue
            cur = f"{cur} {s}".strip()
            if cur.endswith("\\"):
                cur = cur[:-1].rstrip()
                continue
            found.append(cur)
            cur = ""
    return list(dict.fromkeys(found))


def argv(example: str) -> list[str]:
    """The arguments after `overdrive`, without a trailing `# comment` or `> file` redirection."""
    words = shlex.split(example, comments=True)
    assert words[0] == "overdrive", example
    return words[1:words.index(">")] if ">" in words else words[1:]


# Examples that run here (exit 0), in this order in one folder: later ones use what earlier ones wrote.
RUN = [
    "overdrive env                 # versions, GPUs and usable backends",
    "overdrive env --json > env.json",
    "overdrive build --onnx model.onnx --save-engine model.engine --shapes input:1x3x224x224",
    "overdrive exec --load-engine model.engine",
    "overdrive compare model.engine mypkg.models:make_model   # at the engine's opt shapes; mypkg/ in this folder",
    "overdrive compare model.onnx model_int8.onnx --shapes input:4x3x224x224 --atol 1e-1",
    "overdrive compare a.onnx b.onnx --inputs batch.npz   # or batch.pt: a tensor, a list or a dict name -> tensor",
    "overdrive compare model.engine mypkg.models:make_model --checkpoint trained.pt   # the engine's own weights",
    "overdrive sparsify --model digits --allow-untrained --out digits.sparse24.pt --input-shape 1,1,8,8",
    "overdrive sparsify --model mypkg.models:build --checkpoint trained.pt --out model.sparse24.pt",
    "overdrive quantize --model mypkg.models:build --calib-data calib.pt --config fp8 --export m.onnx",
    "overdrive quantize --model mypkg.models:mlp --calib-data tabular.npy --input-shape 1,16 --save mlp_int8.pt",
    "overdrive quantize --model mypkg.models:tagger --calib-data tokens.npz --input-shape input_ids:1x32",
    "overdrive sparsify --model mypkg.models:tagger --allow-untrained --out tagger.sparse24.pt "
    "--input-shape input_ids:1x32,attention_mask:1x32",
    "overdrive data tokenize corpus/ -t tokenizer.json --max-length 512 -o tokens.npz --json",
]
# Examples that run here but take more than a few seconds on 2 cores (marked slow).
RUN_SLOW = [
    "overdrive quantize --config int8 --method entropy --export digits_int8.onnx --save digits_int8.pt",
    "overdrive launch --nproc-per-node 2 -m mypkg.train --lr 0.1",
    "overdrive data make-dataset imgs -n 512 --processes 2   # 5000 for a longer benchmark",
    "overdrive data make-dataset imgs -n 512 --processes 2",
    "overdrive data bench imgs --workers 0 --workers 2 --batch-size 64",
    "overdrive data bench imgs --workers 2 --batch-size 64 --json bench.json   # or an ImageFolder: train/",
    # after make-dataset: imgs/ holds class subfolders of JPEGs
    "overdrive quantize --model mypkg.models:build --calib-data imgs/ --input-shape 1,3,224,224 --calib-batches 2",
    "overdrive build --model mypkg.models:build --int8 --calib imgs/ --calib-samples 64 --shapes x:1x3x224x224 "
    "--save-engine m_int8.engine",
]
PARSE_ONLY = {  # example -> why it is only parsed here
    "overdrive run model.onnx --trt --onnxrt --atol 1e-3 --rtol 1e-3": "tests/cli/test_run_verb.py runs the verb",
    "overdrive run model.onnx --trt --onnxrt --input-shapes input:[1,3,224,224] --save-inputs in.npz":
        "tests/cli/test_run_verb.py runs the verb",
    "overdrive run model.onnx --trt --onnxrt --fp16 --atol 1e-2 --load-inputs in.npz": "needs a GPU for fp16",
    "overdrive demo                # the whole path on the digits dataset": "minutes; tests/demo run its stages",
    "overdrive demo": "minutes; tests/demo run its stages",
    "overdrive demo --quick": "minutes with the distributed and data stages; tests/demo run its stages",
    "overdrive demo --device cuda --json results.json": "needs a GPU",
    "overdrive demo --device cuda --report demo_report --json results.json": "needs a GPU",
    "overdrive build --onnx bert.onnx --int8 --int8-activations dynamic --save-engine bert_int8.engine "
    "--min-shapes input_ids:1x1,attention_mask:1x1 --max-shapes input_ids:8x128,attention_mask:8x128":
        "needs a BERT export; tests/engine build dynamic int8 BERT engines",
    "overdrive build --model torchvision.models:resnet50 --fp16 --device cuda --shapes x:256x3x224x224 "
    "--saveEngine rn50_fp16.engine --timing-cache rn50.cache": "needs a GPU and torchvision",
    "overdrive compare model_fp16.engine model.onnx --atol 1e-2 --rtol 1e-2": "an fp16 engine needs a GPU",
    "overdrive exec --loadEngine rn50_fp16.engine --duration 10 --percentile 50,99 --json summary.json":
        "needs the GPU engine above",
    "overdrive exec --loadEngine model.engine --loadInputs input:x.bin --exportOutput out.json --iterations 1":
        "needs a raw x.bin; tests/cli/test_exec_io.py runs --loadInputs and --exportOutput",
    "overdrive doctor --master-addr 10.0.0.1 --master-port 29500 --node-rank 1": "reaches another machine",
    "overdrive doctor --bandwidth 8 --max-bytes 4294967296 --ops all_reduce --json": "8 ranks, 4 GiB: a GPU node's",
    "overdrive launch --nproc-per-node 8 --max-restarts 2 train.py --epochs 90": "8 ranks of a real training script",
    "overdrive launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node gpu train.py":
        "two machines with GPUs",
    "overdrive launch --nproc-per-node 4 --timeout 3600 train.py   # a hung rank cannot hold the job":
        "4 ranks of a real training script",
}

MODELS_PY = '''import torch
from torch import nn


class Net(nn.Module):  # (B, 3, 224, 224) -> (B, 16); 2:4-prunable layer shapes
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 4, stride=16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def make_model():
    torch.manual_seed(0)
    return Net().eval()


build = make_model


class Tagger(nn.Module):  # (B, T) token ids -> (B, T, 16)
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(100, 16), nn.Linear(16, 16)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        return self.fc(h if attention_mask is None else h * attention_mask.unsqueeze(-1))


def mlp():  # (B, 16) -> (B, 16)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def tagger():
    torch.manual_seed(0)
    return Tagger()
'''
TRAIN_PY = '''import argparse

import torch
import torch.distributed as dist

from overdrive import distributed as odist

ap = argparse.ArgumentParser()
ap.add_argument("--lr", type=float)
args = ap.parse_args()
env = odist.init(device="cpu")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == env.world_size and args.lr == 0.1
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the examples name, small: mypkg/models.py, model.onnx (dynamic batch, input 'input'), its
    copies, batch.npz, calib.pt, tabular.npy, tokens.npz and trained.pt (mypkg's weights), imgs/ (an empty folder: make-dataset fills it),
    corpus/ and tokenizer.json."""
    import numpy as np

    root = tmp_path_factory.mktemp("examples")
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "models.py").write_text(MODELS_PY)
    (root / "mypkg" / "train.py").write_text(TRAIN_PY)
    (root / "imgs").mkdir()  # data make-dataset fills it (the bench examples read it)
    ns: dict = {}
    exec(MODELS_PY, ns)  # noqa: S102 - the test's own model
    model = ns["make_model"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), str(root / "model.onnx"), input_names=["input"],
                          output_names=["logits"], dynamic_axes={"input": {0: "batch"}}, dynamo=False)
    for name in ("model_int8.onnx", "a.onnx", "b.onnx"):
        (root / name).write_bytes((root / "model.onnx").read_bytes())
    np.savez(root / "batch.npz", input=np.random.default_rng(0).standard_normal((2, 3, 224, 224), dtype=np.float32))
    torch.save(torch.randn(16, 3, 224, 224), root / "calib.pt")
    np.save(root / "tabular.npy", np.random.default_rng(1).standard_normal((64, 16), dtype=np.float32))
    np.savez(root / "tokens.npz", input_ids=np.random.default_rng(2).integers(1, 100, (16, 32)))
    torch.save(model.state_dict(), root / "trained.pt")
    (root / "corpus").mkdir()  # data tokenize: a folder of text files and a tokenizer.json
    (root / "corpus" / "a.txt").write_text("the cat sat\non the mat\n")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(root / "tokenizer.json"))
    return root


def test_every_example_is_listed() -> None:
    assert sorted(help_examples()) == sorted([*RUN, *RUN_SLOW, *PARSE_ONLY])


@pytest.mark.parametrize("example", help_examples())
def test_example_parses(example: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsed by the verb (types, ranges, required options, existing paths) without running it."""
    monkeypatch.chdir(folder)
    args = [a.replace("/tmp/", str(folder) + "/") for a in argv(example)]  # /tmp/imgs: made in the folder
    for a in args:
        if a.startswith(str(folder)):
            Path(a).mkdir(exist_ok=True)
    cmd: click.Command = cli
    name = "overdrive"
    while isinstance(cmd, click.Group) and args:
        sub = cmd.get_command(click.Context(cmd), args[0])
        assert sub is not None, example
        cmd, name, args = sub, args[0], args[1:]
    if isinstance(cmd, click.Group):
        return
    with cmd.make_context(name, args):
        pass


def _run(example: str, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(folder)
    if "make-dataset" in example:  # it writes into a new or empty folder only (two examples write imgs/)
        import shutil

        shutil.rmtree(folder / "imgs", ignore_errors=True)
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in __import__("sys").path if p))  # launched ranks
    try:
        code = main(argv(example))
    except SystemExit as exc:  # launch and doctor exit with their status
        code = exc.code
    out = capsys.readouterr()
    assert code == 0, f"{example}\n{out.out[-2000:]}\n{out.err[-2000:]}"


@pytest.mark.parametrize("example", RUN)
def test_example_runs(example: str, folder: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    _run(example, folder, monkeypatch, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("example", RUN_SLOW)
def test_slow_example_runs(example: str, folder: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    from overdrive.distributed import launch

    # the launch example runs as written (no --timeout); bounded here, so a rank stuck in gloo's shutdown under a
    # loaded suite fails this test in minutes (launch's OverdriveError) instead of holding the suite
    run = launch._run
    monkeypatch.setattr(launch, "_run", lambda cmd, env, timeout_s: run(cmd, env, 300 if timeout_s is None else timeout_s))
    _run(example, folder, monkeypatch, capsys)
