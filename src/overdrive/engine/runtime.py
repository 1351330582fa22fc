"""A built engine at run time: :class:`Engine` loads and checks an engine file (device, precision, torch,
signature), runs it, saves it signed, and benchmarks it; the device facts an engine is tied to.
"""

from __future__ import annotations

import platform
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from overdrive._utils.device import cpu_isa, resolve_device
from overdrive._utils.errors import UsageError
from overdrive._utils.signing import signing_key
from overdrive._utils.trees import is_plain_dataclass, tensor_leaves
from overdrive.engine import backends, format as fmt
from overdrive.engine.config import PRECISIONS, ShapeProfile, check_all_dynamic_shapes
from overdrive.engine.inputs import random_input, random_inputs
from overdrive.engine.sources import ModelSource

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
       "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
       "bool": torch.bool}


def device_facts(device: torch.device) -> dict[str, Any]:
    """What an engine is tied to: GPU name + compute capability, or the CPU ISA."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "compute_capability": f"{p.major}.{p.minor}"}
    return {"type": "cpu", "isa": cpu_isa(), "machine": platform.machine()}


def describe_device(d: dict[str, Any]) -> str:
    """One line for an engine header's device record (what ``device_facts`` wrote).

    Example:
        >>> describe_device({"type": "cuda", "name": "NVIDIA H200", "compute_capability": "9.0"})
        'NVIDIA H200 (sm 9.0)'
    """
    return f"{d['name']} (sm {d['compute_capability']})" if d["type"] == "cuda" else f"CPU {d.get('machine')} {d.get('isa')}"


def _compile_counters() -> dict[str, int]:
    """Inductor's FX-graph cache counters (hits, misses, bypasses) so far in this process; {} without Inductor."""
    import sys

    if "torch._dynamo" not in sys.modules:  # an onnxruntime load: nothing compiles, and dynamo is not imported
        return {}
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return {k: int(c[f"fxgraph_cache_{k}"]) for k in ("hit", "miss", "bypass")}


class EngineOutput(dict):
    """The outputs of an engine built from a model that returns a mapping (a dict, a Hugging Face ``ModelOutput``),
    by the model's keys, and read as a ``ModelOutput`` reads: ``out["logits"]``, ``out.logits``, ``out[0]`` (by
    position), ``out.to_tuple()``. A tuple or list under a key comes back as a flat tuple of its tensors.

    Example:
        >>> out = EngineOutput.from_flat([["logits", None], ["hidden", 2]], [torch.zeros(1), torch.ones(1), torch.ones(1)])
        >>> out.logits.shape, len(out["hidden"]), out[0] is out["logits"]
        (torch.Size([1]), 2, True)
    """

    @classmethod
    def from_flat(cls, layout: list[list[Any]], outs: list[torch.Tensor]) -> "EngineOutput":
        """Regroup the engine's flat outputs by ``layout`` (the header's ``output_mapping``)."""
        res, i = cls(), 0
        for key, n in layout:
            if n is None:
                res[key] = outs[i]
                i += 1
            else:
                res[key] = tuple(outs[i:i + n])
                i += n
        return res

    def __getitem__(self, k: Any) -> Any:
        if isinstance(k, (int, slice)):
            return self.to_tuple()[k]
        return super().__getitem__(k)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"engine output has no {name!r}; its keys are {list(self)}") from None

    def to_tuple(self) -> tuple[Any, ...]:
        """The values in key order, as ``ModelOutput.to_tuple`` gives them."""
        return tuple(self.values())


class Engine:
    """A built engine: call it, save it, load it, benchmark it.

    Example:
        >>> # engine = Engine.load("model.engine"); y = engine(torch.randn(1, 1, 8, 8)); engine.info["precision"]
    """

    def __init__(self, header: dict[str, Any], sections: dict[str, bytes], runner: Any, device: torch.device,
                 build_s: float | None = None, load_s: float | None = None,
                 load_compile: dict[str, int] | None = None, trust: dict[str, Any] | None = None) -> None:
        self.header, self.sections, self.runner, self.device = header, sections, runner, device
        # built here: trusted; loaded: what authenticate() found and whether its native sections were used
        self.trust = trust if trust is not None else {"signature": "built here", "trusted": True, "mode": "full"}
        self.build_s, self.load_s = build_s, load_s
        self.load_compile = load_compile  # Inductor graph-cache hits / misses / bypasses during the load
        self.profiles = [ShapeProfile.from_dict(i) for i in header["inputs"]]
        self.input_names = [p.name for p in self.profiles]
        self.input_dtypes = [_DT.get(i["dtype"], torch.float32) for i in header["inputs"]]
        self.input_layouts = [i.get("layout", "chw") for i in header["inputs"]]

    @property
    def info(self) -> dict[str, Any]:
        """Bindings, shapes, precision, backend and device, as stored in the file header."""
        h = self.header
        return {"backend": h["backend"], "backend_reason": h.get("backend_reason"), "precision": h["precision"],
                "device": h["device"], "torch": h["torch"], "cuda": h["cuda"], "source": h.get("source"),
                "inputs": h["inputs"], "outputs": h["outputs"], "build_s": h.get("build_s"), "load_s": self.load_s,
                "load_compile": self.load_compile,
                "runtime": getattr(self.runner, "via", h["backend"]), "size_bytes": sum(len(b) for b in self.sections.values()),
                "timing_cache": h.get("timing_cache"), "best": h.get("best"), "accuracy": h.get("accuracy"),
                "int8": h.get("int8"), "layers": (h.get("backend_meta") or {}).get("layers"),
                "whole_engine": (h.get("backend_meta") or {}).get("whole_engine"),
                "float_build": (h.get("backend_meta") or {}).get("float_build"),
                "build_phases_s": (h.get("backend_meta") or {}).get("build_phases_s"), "trust": self.trust}

    def save(self, path: str | Path) -> None:
        """Write the engine atomically, signed with the user's key (overdrive._utils.signing; the default key
        file is created on first use). An engine loaded without trust is saved unsigned: saving must not turn
        a file from elsewhere into one this user's key vouches for."""
        key = signing_key(create=True) if self.trust.get("trusted") else None
        if key is None:
            warnings.warn(f"saving an engine that was loaded untrusted ({self.trust.get('why')}) unsigned; rebuild it "
                          "with `overdrive build` to get a signed engine", stacklevel=2)
        fmt.EngineFile(self.header, self.sections).save(path, key)

    @classmethod
    def load(cls, path: str | Path, device: str | None = None, precision: str | None = None,
             trust: bool = False) -> Engine:
        """Load and check an engine; refuses another device kind/GPU, precision or torch build.

        An engine signed with this user's key loads whole. Any other (unsigned, signed elsewhere, or edited
        after signing) loads in safe mode: its program is compiled again from the ``torch.export`` section,
        read weights-only, and its AOTInductor library and compile cache are ignored (a slower first call,
        nothing from the file runs). ``trust=True`` (``--trust``) loads such an engine whole: only for engines
        from a source you trust. ``engine.info["trust"]`` says which happened.

        Example:
            >>> # Engine.load("model.engine").info["trust"]  # {'signature': 'signed', 'trusted': True, 'mode': 'full'}
        """
        return cls._open(fmt.read(path), str(path), device, precision, trust)

    @classmethod
    def _open(cls, ef: fmt.EngineFile, path: str, device: str | None, precision: str | None, trust: bool,
              record: dict[str, Any] | None = None) -> Engine:
        """:meth:`load` from an engine file in memory. ``record``: the trust record of the engine this one is a
        copy of (unpickled or deep-copied), kept as it was instead of checking a signature."""
        h = ef.header
        status, why = fmt.authenticate(h) if record is None else (record.get("signature"), record.get("why"))
        trusted = status == "signed" or trust
        built = h["device"]
        if precision is not None and precision not in PRECISIONS:
            from overdrive._utils.errors import did_you_mean

            raise UsageError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}"
                             f"{did_you_mean(precision, PRECISIONS, list_up_to=0)}. It only checks the engine's own "
                             f"precision, fixed at build ({h['precision']} for {path}): leave it out to load the "
                             "engine as built")
        if precision == "best" and not h.get("best"):
            raise UsageError(f"{path} was built for precision {h['precision']}, not with --best; load it without a "
                             "precision, or rebuild with --best")
        if precision is not None and precision != "best" and precision != h["precision"]:
            raise UsageError(f"{path} was built for precision {h['precision']}, not {precision}: an engine runs only at "
                             f"the precision it was built with; rebuild with --precision {precision}")
        if built["type"] == "cuda" and not torch.cuda.is_available() and device in (None, "auto"):
            raise UsageError(f"{path} was built for {describe_device(built)} and there is no CUDA GPU here; "
                             "rebuild it on this machine with --device cpu")
        dev = resolve_device(device or built["type"])
        here = device_facts(dev)
        if here["type"] != built["type"] or (built["type"] == "cuda" and here["compute_capability"] != built["compute_capability"]):
            raise UsageError(f"{path} was built for {describe_device(built)} but would run on {describe_device(here)}; engines are tied "
                             f"to the device they were built for: rebuild with `overdrive build --device {dev.type}` here")
        if h["backend"] == "inductor" and h["torch"].split("+")[0] != torch.__version__.split("+")[0]:
            raise UsageError(f"{path} was built with torch {h['torch']} but this is torch {torch.__version__}; Inductor "
                             "engines hold torch-version-specific programs: rebuild the engine with this torch")
        native_ok = True
        if built["type"] == "cpu" and (built.get("machine") != here.get("machine") or built.get("isa") != here.get("isa")):
            native_ok = False  # native code compiled for another CPU can crash here (illegal instruction)
            if h["backend"] == "inductor":
                warnings.warn(f"{path} was built for {describe_device(built)}, this is {describe_device(here)}: its "
                              "native code is not used; the program is compiled again for this CPU (a slower first "
                              "call). Rebuild the engine here to skip that", stacklevel=2)
        has_native = h["backend"] == "inductor" and bool({"aoti_package", "compile_cache"} & set(ef.sections))
        if not trusted and has_native:
            warnings.warn(f"{path}: {why}, so it loads in safe mode: compiled again from its exported program (weights "
                          "only), its AOTInductor library and compile cache unused (a slower first call). Rebuild it "
                          "with `overdrive build` here to get a signed engine, or load with --trust (trust=True) if "
                          "you trust where it came from", stacklevel=2)
        mode = "full" if (trusted and native_ok) or not has_native else ("recompiled" if trusted else "safe")
        t0 = time.perf_counter()
        before = _compile_counters()
        runner = backends.get(h["backend"]).load(ef.sections, h, dev, trusted=trusted, native_ok=native_ok)
        eng = cls(h, ef.sections, runner, dev,
                  trust={"signature": status, "why": why, "trusted": trusted, "mode": mode} if record is None
                  else dict(record))
        # Load time includes the first call: for Inductor that is when the program compiles (from the cache).
        eng.runner(*random_inputs(eng.profiles, ModelSource(input_names=eng.input_names,
                                                            input_dtypes=dict(zip(eng.input_names, eng.input_dtypes))), dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        eng.load_s = time.perf_counter() - t0
        after = _compile_counters()
        eng.load_compile = {k: after[k] - before.get(k, 0) for k in after} if after else None
        return eng

    def check_inputs(self, inputs: tuple[torch.Tensor, ...] = (), named: dict[str, torch.Tensor] | None = None,
                     move: bool = True) -> list[torch.Tensor]:
        """Order, validate against the profiles, cast and move the inputs. A positional ``@dataclass`` argument (an
        engine built from a model taking one) gives its tensors in field order, as the build took them."""
        if any(is_plain_dataclass(x) for x in inputs):
            inputs = tuple(t for x in inputs for t in (tensor_leaves(x) if is_plain_dataclass(x) else (x,)))
        if named:
            if inputs:
                raise UsageError("pass inputs either by position or by name, not both")
            missing = [n for n in self.input_names if n not in named]
            unknown = [n for n in named if n not in self.input_names]
            if missing or unknown:
                raise UsageError(f"engine inputs are {self.input_names}: missing {missing}, unknown {unknown}")
            inputs = tuple(named[n] for n in self.input_names)
        if len(inputs) != len(self.input_names):
            raise UsageError(f"engine takes {len(self.input_names)} input(s) {self.input_names}, got {len(inputs)}")
        out = []
        for x, p, dt, layout in zip(inputs, self.profiles, self.input_dtypes, self.input_layouts):
            x = torch.as_tensor(x)
            # the binding's layout (no copy when it is already): a compiled program (AOTInductor above all) reads its
            # inputs at the strides it was built for, so a transposed, sliced or expanded view gave wrong numbers
            if layout in ("hwc", "hwc8") and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            else:
                x = x.contiguous()
            if x.dim() != len(p.min):
                raise UsageError(f"input {p.name!r} has {x.dim()} dims {tuple(x.shape)} but the engine's input has "
                                 f"{len(p.min)} (profile min {p.min} max {p.max}); reshape it, or rebuild the engine "
                                 "for that rank")
            if not p.contains(tuple(x.shape)):
                raise UsageError(f"input {p.name!r} has shape {tuple(x.shape)}, outside the engine's profile min {p.min} "
                                 f"max {p.max}; rebuild with --min-shapes/--max-shapes covering it")
            if x.is_floating_point() != dt.is_floating_point:
                fix = f".to(torch.{str(dt).removeprefix('torch.')})"
                frac = x.is_floating_point() and bool((x != x.round()).any())
                if frac:  # a cast would truncate it (an additive float mask of -0.5): the engine was built wrong
                    raise UsageError(f"input {p.name!r} holds fractional {x.dtype} values but the engine was built "
                                     f"with it as {dt} (an integer input by its name); casting would truncate them: "
                                     "rebuild from an example input of its dtype (Builder(cfg).build(model, "
                                     "example_inputs))")
                raise UsageError(f"input {p.name!r} is {x.dtype} but the engine expects {dt}; pass it as {dt} "
                                 f"(x{fix}{', token ids or indices as integers' if not dt.is_floating_point else ''})")
            out.append(x.to(self.device, dt) if move else x.to(dtype=dt))
        for group in self.header.get("backend_meta", {}).get("shared_dims", []):  # dims the program needs equal
            sizes = {f"{n}[{d}]": out[self.input_names.index(n)].shape[d] for n, d in group if n in self.input_names}
            if len(set(sizes.values())) > 1:
                raise UsageError(f"inputs {', '.join(f'{k}={v}' for k, v in sizes.items())} must be equal: the model "
                                 "uses one size for these dims (e.g. the sequence length of input_ids and attention_mask)")
        return out

    def run(self, *inputs: torch.Tensor, **named: torch.Tensor) -> list[torch.Tensor]:
        """All outputs as a list (copies: safe to keep across calls, also under CUDA graphs)."""
        xs = self.check_inputs(inputs, named)
        copied = getattr(self.runner, "copied", None)  # a runner whose outputs a concurrent call can overwrite
        return copied(*xs) if copied is not None else [o.clone() for o in self.runner(*xs)]

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and ``copy.deepcopy``) as the engine file's header and sections; unpickling loads them again as
        :meth:`load` does (device, precision and torch checks, a new runner), so a copy shares no runtime state
        and works in another process (``DataLoader`` workers started with ``spawn``). It keeps the trust record:
        unpickling runs code anyway, so only unpickle engines from a source you trust.

        Example:
            >>> # engine2 = pickle.loads(pickle.dumps(engine)); copy.deepcopy(engine)
        """
        return (_unpickle_engine, (self.header, self.sections, str(self.device), dict(self.trust), self.build_s))

    def __call__(self, *inputs: torch.Tensor, **named: torch.Tensor) -> Any:
        """The outputs as the model gave them: one tensor, a tuple, or (for a model returning a dict or a Hugging Face
        ``ModelOutput``) an :class:`EngineOutput` by the same keys."""
        outs = self.run(*inputs, **named)
        layout = self.header.get("output_mapping")
        if layout:
            return EngineOutput.from_flat(layout, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def random_inputs(self, shapes: dict[str, tuple[int, ...]] | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Inputs at the profiles' opt shapes (or ``shapes``), on the CPU, for exec and compare."""
        names = [p.name for p in self.profiles]
        unknown = sorted(set(shapes or {}) - set(names))
        if unknown:  # a misspelt --shapes name would otherwise run silently at the opt shapes
            raise UsageError(f"--shapes names input {', '.join(map(repr, unknown))}, which this engine does not have; "
                             f"its inputs are {', '.join(map(repr, names))}")
        check_all_dynamic_shapes(self.profiles, shapes)
        g = torch.Generator().manual_seed(seed)
        out = []
        for p, dt, layout in zip(self.profiles, self.input_dtypes, self.input_layouts):
            shape = tuple((shapes or {}).get(p.name, p.opt))
            x = random_input(p.name, shape, dt, g).to(dt)
            out.append(x.contiguous(memory_format=torch.channels_last) if layout == "hwc" and x.dim() == 4 else x)
        return tuple(out)

    def benchmark(self, **kwargs: Any) -> dict[str, Any]:
        """trtexec-style timing; see :func:`overdrive.engine.benchmark.benchmark` for the arguments."""
        from overdrive.engine.benchmark import benchmark

        return benchmark(self, **kwargs)


def _unpickle_engine(header: dict[str, Any], sections: dict[str, bytes], device: str, trust: dict[str, Any],
                     build_s: float | None) -> Engine:
    """An engine again from what :meth:`Engine.__reduce__` pickled."""
    eng = Engine._open(fmt.EngineFile(header, sections), f"pickled {header.get('backend')} engine", device, None,
                       bool(trust.get("trusted")), record=trust)
    eng.build_s = build_s
    return eng


def phases_summary(phases: dict[str, float]) -> str:
    """One line from ``engine.info["build_phases_s"]``: where the build's seconds went, each step's parts (the keys
    ``step.part``) in brackets after it.

    Example:
        >>> phases_summary({"calibrate": 2.04, "layer_timing": 40.0, "layer_timing.tune": 31.5, "compile": 20.2})
        'build phases: calibrate 2.0 s, layer_timing 40.0 s (tune 31.5), compile 20.2 s'
    """
    parts = []
    for step, s in phases.items():
        if "." in step:
            continue
        subs = ", ".join(f"{k.partition('.')[2]} {v:.1f}" for k, v in phases.items() if k.startswith(step + "."))
        parts.append(f"{step} {s:.1f} s" + (f" ({subs})" if subs else ""))
    return "build phases: " + ", ".join(parts)


def fusions_summary(meta: dict[str, Any]) -> str | None:
    """One line from ``header["backend_meta"]``: the graph rewrites a build made (trtexec's layer fusions), or None
    when it made none.

    Example:
        >>> fusions_summary({"conv_relu_fused": 17, "stem_channels_padded": 1,
        ...                  "lowp_conv": {"folded": 51, "quantized_out": 50, "dual_out": 0, "quantized_residuals": 15}})
        'fusions: conv+ReLU (cuDNN) 17, stem padded to 4 channels 1, int8/fp8 conv epilogues 51 (quantized outputs 50, dual outputs 0, 8-bit residuals 15)'
    """
    parts = [f"{label} {meta[k]}" for k, label in (("conv_relu_fused", "conv+ReLU (cuDNN)"),
                                                   ("stem_channels_padded", "stem padded to 4 channels"),
                                                   ("sibling_gemms_fused", "sibling GEMM groups"),
                                                   ("gemm_gelu_fused", "GEMM+GELU"),
                                                   ("attention_masks_dropped", "constant attention masks dropped"),
                                                   ("residual_quantizers_dropped",
                                                    "residual quantizers no kernel reads dropped"))
             if meta.get(k)]
    lowp = meta.get("lowp_conv") or {}
    if lowp.get("folded") or lowp.get("quantized_out"):
        res = f", 8-bit residuals {lowp['quantized_residuals']}" if lowp.get("quantized_residuals") else ""
        parts.append(f"int8/fp8 conv epilogues {lowp.get('folded', 0)} (quantized outputs {lowp.get('quantized_out', 0)}, "
                     f"dual outputs {lowp.get('dual_out', 0)}{res})")
    if lowp.get("sibling_groups"):
        parts.append(f"int8/fp8 sibling GEMM groups {lowp['sibling_groups']}")
    return "fusions: " + ", ".join(parts) if parts else None
