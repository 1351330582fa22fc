"""``overdrive build``: build an engine once for one device and precision (trtexec's flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from overdrive.cli.common import (check_calib_cache, check_device, check_distinct, check_json_target, check_output,
                                  check_torchscript,
                                  join_repeated, json_option, layer_info_options, progress_option, spec_file,
                                  trtexec_noops, write_json)


def _check_scripted_backend(backend: str, device: str, precision: str) -> None:
    """Refuse, before any work, a --torchscript build with a dynamic profile that ONNX Runtime cannot make: the
    TorchScript->ONNX export fixes shapes, so the module itself goes to ONNX Runtime (CPU, fp32/tf32/int8), which
    takes a TorchScript module as the Python API does (``Builder().build(torch.jit.load(path))``, where ``auto``
    picks it and says why); Inductor's torch.export cannot take one.

    Example:
        >>> _check_scripted_backend("auto", "cpu", "fp32")  # auto: the build picks onnxruntime
    """
    from overdrive._utils.device import resolve_device
    from overdrive._utils.errors import UsageError

    fix = ("use --shapes for a static build (any backend), or build from the Python model with --model "
           "file.py:factory")
    if backend not in ("auto", "onnxruntime"):
        raise UsageError(f"--torchscript with --min/--opt/--max-shapes builds on the onnxruntime backend only, not "
                         f"--backend {backend} (its export cannot take a TorchScript module); {fix}")
    where = resolve_device(device)
    if where.type != "cpu" or precision not in ("fp32", "tf32", "int8"):
        raise UsageError(f"--torchscript with --min/--opt/--max-shapes builds on the onnxruntime backend (CPU, "
                         f"fp32/tf32/int8 only), not {precision} on {where.type}; {fix}")


def _build_scripted(path: str, save_engine: str, calib: str | None, profiles: list[Any], **options: Any) -> Any:
    """Build and save an engine from the TorchScript module at ``path`` with dynamic ``profiles`` (ONNX Runtime)."""
    import torch

    from overdrive.engine.api import Builder
    from overdrive._utils.files import require_file
    from overdrive.engine.sources import from_module
    from overdrive.recipes.build import build_config
    from overdrive.recipes.calibration import load_calibration

    require_file(path, "TorchScript file")
    try:
        scripted = torch.jit.load(path, map_location="cpu").eval()
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError with the archive's C++ trace
        from overdrive._utils.errors import UsageError

        raise UsageError(f"--torchscript {path}: not a loadable TorchScript file ({str(exc).strip().splitlines()[0]});"
                         " save it with torch.jit.save(torch.jit.trace(model, example), path)") from exc
    src = from_module(scripted)
    batches = load_calibration(calib, "--calib", input_names=src.input_names).batches if calib else None
    accept = options.pop("accept_low_accuracy")
    cfg = build_config(profiles=profiles, **options)
    engine = Builder(cfg, on_low_accuracy="warn" if accept else "raise").build(
        src, calib=batches, onnx_path=str(Path(save_engine).with_suffix(".onnx")))
    engine.save(save_engine)
    return engine


def _no_tf32_note(precision: str, device: str) -> str:
    """The line that answers trtexec's ``--noTF32`` (TensorRT's fp32 layers may use TF32 unless it is given): here
    fp32 builds run IEEE fp32 always; a tf32 build with it asks for two things at once and is refused.

    Example:
        >>> _no_tf32_note("fp32", "cpu")[:60]
        '--noTF32 has no effect here: fp32 builds already run IEEE fp'
    """
    from overdrive._utils.device import resolve_device
    from overdrive._utils.errors import UsageError

    if precision == "tf32":
        raise UsageError("--noTF32 and --precision tf32 ask for opposite fp32 math; give --precision fp32 (IEEE fp32, "
                         "which --noTF32 asks for) or drop --noTF32")
    if precision == "fp32":
        return ("--noTF32 has no effect here: fp32 builds already run IEEE fp32 (no TF32) on cuBLAS, cuDNN and "
                "oneDNN; TF32 is --precision tf32")
    if resolve_device(device).type == "cpu":
        return f"--noTF32 has no effect here: a CPU {precision} engine's fp32 layers run IEEE fp32 (oneDNN) already"
    return (f"--noTF32: the fp32 layers of this CUDA {precision} engine run IEEE fp32 (no TF32 in cuBLAS or cuDNN; "
            "BuildConfig(allow_tf32=False))")


def _optimization_level(level: int | None, max_autotune: bool) -> bool:
    """Whether the build tunes as --max-autotune, given trtexec's ``--builderOptimizationLevel`` (0-5, default 3:
    above it, TensorRT spends build time on more tactics, which is what Inductor's max-autotune does) and
    ``--max-autotune``; a level of 3 or below beside --max-autotune asks for both and is refused.

    Example:
        >>> _optimization_level(5, False), _optimization_level(3, False), _optimization_level(None, True)
        (True, False, True)
    """
    if level is None:
        return max_autotune
    if level <= 3 and max_autotune:
        from overdrive._utils.errors import UsageError

        raise UsageError(f"--builderOptimizationLevel {level} and --max-autotune disagree (levels 4 and 5 are "
                         "max-autotune); give one of them")
    if level > 3:
        click.echo(f"[I] --builderOptimizationLevel {level}: tunes as --max-autotune (Inductor times more kernel "
                   "choices at build; minutes)", err=True)
        return True
    click.echo(f"[I] --builderOptimizationLevel {level}: the default build (levels 4 and 5 tune as --max-autotune)",
               err=True)
    return False


def _size(n: int) -> str:
    """An engine's size for the build line: MB, or kB below one (a small engine read "0.00 MB").

    Example:
        >>> _size(4835), _size(25_600_000)
        ('4.8 kB', '25.60 MB')
    """
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


@click.command("build")
@click.option("--onnx", default=None, metavar="FILE", help="Build from an ONNX model.")
@click.option("--model", default=None, metavar="PKG.MODULE:FACTORY",
              help="Build from a PyTorch model factory, with literal arguments if it takes any: "
                   "'file.py:make_model(num_classes=10)'.")
@click.option("--torchscript", default=None, metavar="FILE", help="Build from TorchScript (torch.jit.save): --shapes go through ONNX (any backend); "
                   "--min/--opt/--max-shapes build the module on onnxruntime (CPU, fp32/int8).")
@click.option("--exported", default=None, metavar="FILE.pt2", help="Build from a torch.export archive.")
@click.option("--save-engine", "--saveEngine", "save_engine", required=True, metavar="FILE", help="Where to write the engine.")
@click.option("--precision", default="fp32", show_default=True, help="fp32, tf32, fp16, bf16, int8, fp8 or best.")
@click.option("--fp16", "flag_fp16", is_flag=True, help="Same as --precision fp16 (trtexec spelling).")
@click.option("--bf16", "flag_bf16", is_flag=True, help="Same as --precision bf16.")
@click.option("--int8", "flag_int8", is_flag=True, help="Same as --precision int8.")
@click.option("--fp8", "flag_fp8", is_flag=True, help="Same as --precision fp8.")
@click.option("--best", "flag_best", is_flag=True,
              help="Same as --precision best: build fp16 and bf16 (CUDA) or fp32 (CPU), plus int8/fp8 with --calib, "
                   "time each and keep the fastest.")
@click.option("--shapes", multiple=True, callback=join_repeated,
              help="Static shapes, e.g. input:8x3x224x224 (--exported: default the archive's example inputs).")
@click.option("--min-shapes", "--minShapes", "min_shapes", multiple=True, callback=join_repeated, help="Dynamic profile minimum shapes.")
@click.option("--opt-shapes", "--optShapes", "opt_shapes", multiple=True, callback=join_repeated, help="Dynamic profile optimal shapes.")
@click.option("--max-shapes", "--maxShapes", "max_shapes", multiple=True, callback=join_repeated, help="Dynamic profile maximum shapes.")
@click.option("--backend", default="auto", show_default=True,
              help="auto, inductor or onnxruntime build an engine. tensorrt builds none: it writes the ONNX file and "
                   "exits with the trtexec command that builds the TensorRT plan from it.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--max-autotune", "--maxAutotune", "max_autotune", is_flag=True, help="Inductor max-autotune (minutes of tuning).")
@click.option("--aot/--no-aot", default=None,
              help="Store an AOTInductor package (torch >= 2.12): the default for CPU builds there, opt-in on CUDA.")
@click.option("--int8-activations", "int8_activations", type=click.Choice(["static", "dynamic"]), default=None,
              help="int8 activation scales: static (calibrated per tensor on --calib) or dynamic (per token at run "
                   "time, no --calib; CPU). Default: dynamic on CPU without --calib for models of Linear layers, "
                   "else static.")
@click.option("--layer-precision", "layer_precision", type=click.Choice(["timed", "all"]), default="timed",
              show_default=True,
              help="int8/fp8 from a PyTorch model: timed keeps a layer float where its int8/fp8 GEMM is slower when "
                   "timed at build (as TensorRT's tactic choice does); all keeps every supported layer low precision.")
@click.option("--lowp-linears", "lowp_linears", type=click.Choice(["timed", "cublas"]), default="timed",
              show_default=True,
              help="int8/fp8 Linear layers on CUDA with --layer-precision timed: timed runs each on the Triton kernel "
                   "(its activation and the next quantize fused), cuBLAS's GEMM or float, whichever times fastest; "
                   "cublas leaves the Triton kernel out.")
@click.option("--calib", default=None, metavar="FILE.pt", help="Calibration batches for int8/fp8 (the one format of quantize --calib-data): torch.save of a tensor "
              "(N, ...), a list of batches, [(input_ids, attention_mask), ...], a dict of name -> tensor (N, ...) or a "
              "list of such dicts (list(loader): keys that are no engine input, as labels, are left out with a warning); "
              ".npy (one input) or .npz (inputs by name, np.savez(f, input_ids=ids, attention_mask=mask)); or a folder of "
              "images (class subfolders or flat; resized and center-cropped to the --shapes H and W), or a .txt file, "
              "one sample per line (the docstrings model only).")
@click.option("--calib-samples", default=512, show_default=True, type=click.IntRange(min=1),
              help="The most images (or text lines) read from a --calib folder (or .txt), evenly spaced in sorted order.")
@click.option("--calib-normalize", default=None, metavar="imagenet|none|MEAN:STD",
              help="Normalization of --calib images after scaling to [0, 1]: imagenet (mean 0.485,0.456,0.406, std "
                   "0.229,0.224,0.225; the default unless a timm model's pretrained_cfg gives its own), none, or "
                   "MEAN:STD, e.g. 0.5,0.5,0.5:0.5,0.5,0.5.")
@click.option("--checkpoint", default=None, metavar="FILE.pt",
              help="Weights for the --model factory's model, read weights-only: a state_dict, an overdrive Trainer "
                   "checkpoint, or the .sparse24.pt that overdrive sparsify writes.")
@click.option("--accept-low-accuracy", "accept_low_accuracy", is_flag=True,
              help="Save an int8/fp8 engine even when its outputs on the --calib data fall below cosine 0.99 to the "
                   "float model (by default such a build exits 1 and saves nothing).")
@click.option("--timing-cache", "--timingCacheFile", "timing_cache", default=None, metavar="FILE",
              help="Inductor compile cache kept across builds: loaded first if FILE exists, rewritten after "
                   "(no effect on onnxruntime). Written signed with your key; an unsigned or foreign file is refused.")
@click.option("--trust-timing-cache", is_flag=True,
              help="Load a --timing-cache file not signed with your key (it unpickles): only one you trust.")
@click.option("--input-io-formats", "--inputIOFormats", "input_io_formats", default=None, metavar="TYPE:LAYOUT,...",
              help="Input binding types and layouts, e.g. fp16:hwc (default fp32:chw); inductor backend.")
@click.option("--output-io-formats", "--outputIOFormats", "output_io_formats", default=None, metavar="TYPE:LAYOUT",
              help="Output binding type, e.g. fp16:chw (default fp32:chw); inductor backend.")
@click.option("--freezing/--no-freezing", default=None,
              help="Inductor freezing: weights as constants, BatchNorm folded into convolutions (default: on for CUDA).")
@click.option("--gemm-gelu/--no-gemm-gelu", "gemm_gelu", default=None,
              help="Fold GELU after a Linear into the GEMM's epilogue (cuBLASLt on CUDA, tanh-form GELU within "
                   "5e-4 of erf); inductor backend (default: on for CUDA builds, off on CPU).")
@click.option("--conv-fusion/--no-conv-fusion", "conv_fusion", default=None,
              help="Run convolution (+BatchNorm) (+residual add) + ReLU as one cuDNN call (fp16/bf16 layers); "
                   "inductor backend (default: on for CUDA builds with static shapes, off for dynamic ones and on CPU).")
@click.option("--sibling-gemms/--no-sibling-gemms", "sibling_gemms", default=None,
              help="Run Linears that read one input (Q/K/V, gate/up) as one GEMM where it times faster; inductor "
                   "backend, with freezing (default: on for CUDA builds, off on CPU). Given, int8/fp8 builds also "
                   "group such Linear layers on their Triton kernel (not on by default).")
@click.option("--quantize-residuals", "quantize_residuals", is_flag=True,
              help="int8/fp8 CNNs on CUDA, for a model calibrated without residual-add quantizers (the build's own "
                   "calibration has them, and then residuals are read in 8 bits anyway): a residual add whose input "
                   "is also quantized for a convolution reads that 8-bit tensor, which adds 8-bit rounding to the "
                   "residual (inductor backend).")
@click.option("--builder-optimization-level", "--builderOptimizationLevel", "optimization_level", default=None,
              type=click.IntRange(0, 5), metavar="0-5",
              help="trtexec's (default 3): 4 and 5 spend build time on more kernel choices as --max-autotune does "
                   "(inductor backend); 0-3 build as the default. onnxruntime builds apply every graph optimization "
                   "at any level.")
@click.option("--no-tf32", "--noTF32", "no_tf32", is_flag=True,
              help="trtexec's: IEEE fp32 math, no TF32. fp32 builds here always run IEEE fp32 (TF32 is --precision "
                   "tf32, with which this is refused); with it, the fp32 layers of fp16/bf16/int8/fp8 engines run IEEE "
                   "fp32 on CUDA too (TF32 without it).")
@layer_info_options("after the build")
@trtexec_noops(("--workspace", False, "overdrive sets no builder memory limit"),
               ("--memPoolSize", False, "overdrive sets no builder memory pools"),
               ("--skipInference", True, "overdrive build runs no inference after building; time it with overdrive exec"),
               ("--explicitBatch", True, "every engine's batch dim is explicit"),
               # the run flags of trtexec's build-and-run lines: the build runs nothing, exec takes them
               *((f, True, f"overdrive build runs no inference; give {f} to overdrive exec") for f in
                 ("--useCudaGraph", "--noDataTransfers", "--useSpinWait", "--separateProfileRun", "--dumpProfile")),
               *((f, False, f"overdrive build runs no inference; give {f} to overdrive exec") for f in
                 ("--iterations", "--duration", "--warmUp")),
               *((f, False, "overdrive build runs no inference, and overdrive exec times one stream from one thread")
                 for f in ("--streams", "--infStreams")),
               ("--threads", True, "overdrive build runs no inference, and overdrive exec times one stream from one "
                "thread"),
               ("--stronglyTyped", True, "layers compute in the --precision given (default fp32; a model of half "
                "weights is cast to it, with a warning): give --fp16 or --bf16 to build a half model in its own type"),
               ("--versionCompatible", True, "an inductor engine loads only under the torch version that built it (an "
                "onnxruntime engine is an ONNX graph); rebuild it after a torch upgrade"),
               ("--profilingVerbosity", False, "--dumpLayerInfo / --exportLayerInfo give every layer in detail; "
                "overdrive exec --dumpProfile / --exportProfile name every kernel the run records"))
@json_option("the engine info")
@progress_option()
def command(onnx: str | None, model: str | None, torchscript: str | None, exported: str | None, save_engine: str,
            precision: str, flag_fp16: bool, flag_bf16: bool, flag_int8: bool, flag_fp8: bool, flag_best: bool,
            shapes: str | None, min_shapes: str | None, opt_shapes: str | None, max_shapes: str | None, backend: str,
            device: str, max_autotune: bool, aot: bool | None, int8_activations: str | None, layer_precision: str,
            calib: str | None, calib_samples: int, calib_normalize: str | None, checkpoint: str | None, accept_low_accuracy: bool, timing_cache: str | None,
            trust_timing_cache: bool, input_io_formats: str | None, output_io_formats: str | None, freezing: bool | None,
            gemm_gelu: bool | None, conv_fusion: bool | None,
            sibling_gemms: bool | None, quantize_residuals: bool, lowp_linears: str, optimization_level: int | None,
            no_tf32: bool, dump_layer_info: bool, export_layer_info: str | None, json_path: str | None,
            no_progress: bool) -> None:
    """Build an engine from ONNX, TorchScript, a torch.export archive or a PyTorch factory, and save it.

    \b
    Examples:
      overdrive build --onnx model.onnx --save-engine model.engine --shapes input:1x3x224x224
      overdrive build --onnx bert.onnx --int8 --int8-activations dynamic --save-engine bert_int8.engine \\
          --min-shapes input_ids:1x1,attention_mask:1x1 --max-shapes input_ids:8x128,attention_mask:8x128
      overdrive build --model torchvision.models:resnet50 --fp16 --device cuda \\
          --shapes x:256x3x224x224 --saveEngine rn50_fp16.engine --timing-cache rn50.cache
      overdrive build --model mypkg.models:build --int8 --calib imgs/ --calib-samples 64 \\
          --shapes x:1x3x224x224 --save-engine m_int8.engine
    """
    from overdrive.engine.runtime import describe_device
    from overdrive.recipes.build import build_config, build_engine

    check_json_target(json_path)
    check_device("--device", device)
    check_output("--save-engine", save_engine)  # refuse now, not after the build
    check_output("--timing-cache", timing_cache)
    check_output("--export-layer-info", export_layer_info)
    check_distinct([("--save-engine", save_engine), ("--timing-cache", timing_cache), ("--json", json_path),
                    ("--export-layer-info", export_layer_info)],
                   [("--onnx", onnx), ("--torchscript", torchscript), ("--exported", exported),
                    ("--model", spec_file(model)), ("--checkpoint", checkpoint), ("--calib", calib)])
    from overdrive._utils.signing import signing_key

    signing_key(create=True)  # a bad OVERDRIVE_SIGNING_KEY fails now, not after the build
    flags = [p for p, f in (("fp16", flag_fp16), ("bf16", flag_bf16), ("int8", flag_int8), ("fp8", flag_fp8), ("best", flag_best)) if f]
    from overdrive._utils.progress import status

    chosen = flags[-1] if flags else precision
    given = click.get_current_context().get_parameter_source("precision") == click.core.ParameterSource.COMMANDLINE
    if flags and given and precision != chosen:
        # trtexec's flags combine (--fp16 --int8: int8 where it pays); --precision names one: both was a silent choice
        from overdrive._utils.errors import UsageError

        raise UsageError(f"--precision {precision} and --{chosen} ask for different precisions; give one of them")
    if no_tf32:
        click.echo(f"[I] {_no_tf32_note(chosen, device)}", err=True)
    allow_tf32 = not no_tf32 or chosen == "fp32"  # fp32 builds are IEEE already; the others honour it on CUDA
    max_autotune = _optimization_level(optimization_level, max_autotune)
    check_calib_cache("--calib", calib)  # trtexec's --calib file, pasted
    if calib and chosen not in ("int8", "fp8", "best"):  # before the build: what the user meant may be --int8
        click.echo(f"[I] --calib has no effect here: only int8/fp8 builds calibrate, and this one is {chosen} "
                   "(add --int8 or --fp8 to use it)", err=True)
    check_torchscript("--torchscript", torchscript)  # a torch.save(model) pickle, named now
    from overdrive.engine.config import profiles_from_shapes

    profiles = profiles_from_shapes(shapes, min_shapes, opt_shapes, max_shapes)
    # bad --precision / --backend / I/O formats are refused before any file is read (build_engine checks them again)
    build_config(precision=chosen, backend=backend, device=device, int8_activations=int8_activations,
                 layer_precision=layer_precision, quantize_residuals=quantize_residuals, lowp_linears=lowp_linears,
                 input_io_formats=input_io_formats, output_io_formats=output_io_formats, allow_tf32=allow_tf32)
    dynamic_ts = bool(torchscript) and not (onnx or model or exported or checkpoint) and any(not p.static for p in profiles)
    if dynamic_ts:
        _check_scripted_backend(backend, device, chosen)
    source = onnx or model or torchscript or exported
    import warnings

    with warnings.catch_warnings(), status(f"building {save_engine} from {source} (export, compile, check)", enabled=not no_progress and json_path != "-"):
        # the library's warning for compile_mode off Inductor: said below, by the flag given
        warnings.filterwarnings("ignore", message=r"BuildConfig\(compile_mode=", category=UserWarning)
        if dynamic_ts:
            engine = _build_scripted(
                torchscript, save_engine, calib, profiles, precision=chosen, backend=backend, device=device,
                max_autotune=max_autotune, aot=aot, int8_activations=int8_activations, layer_precision=layer_precision,
                accept_low_accuracy=accept_low_accuracy, timing_cache=timing_cache,
                trust_timing_cache=trust_timing_cache, freezing=freezing, gemm_gelu=gemm_gelu,
                conv_fusion=conv_fusion, sibling_gemms=sibling_gemms, quantize_residuals=quantize_residuals,
                lowp_linears=lowp_linears, input_io_formats=input_io_formats, output_io_formats=output_io_formats)
        else:
            engine = build_engine(onnx=onnx, model=model, torchscript=torchscript, exported=exported, save_engine=save_engine,
                                  precision=chosen, shapes=shapes, min_shapes=min_shapes,
                                  opt_shapes=opt_shapes, max_shapes=max_shapes, backend=backend, device=device,
                                  max_autotune=max_autotune, aot=aot, int8_activations=int8_activations,
                                  layer_precision=layer_precision, calib=calib, accept_low_accuracy=accept_low_accuracy, checkpoint=checkpoint,
                                  timing_cache=timing_cache,
                                  trust_timing_cache=trust_timing_cache, freezing=freezing, input_io_formats=input_io_formats, output_io_formats=output_io_formats, gemm_gelu=gemm_gelu,
                                  conv_fusion=conv_fusion, sibling_gemms=sibling_gemms,
                                  quantize_residuals=quantize_residuals, lowp_linears=lowp_linears,
                                  allow_tf32=allow_tf32,
                                  calib_samples=calib_samples, calib_normalize=calib_normalize)
    info = engine.info
    from overdrive.engine.runtime import fusions_summary

    if json_path is not None:
        write_json(info, json_path)
    if json_path != "-":
        click.echo(f"[I] built {save_engine}: backend {info['backend']} ({info['backend_reason']}), precision "
                        f"{info['precision']}, device {describe_device(info['device'])}, {_size(info['size_bytes'])} in {info['build_s']:.1f} s")
        if info.get("int8"):
            from overdrive.engine.int8 import summary as int8_summary

            click.echo(f"[I] {int8_summary(info['int8'])}")
        if info.get("layers"):
            from overdrive.engine.layer_choice import placement_summary

            click.echo(f"[I] {placement_summary(info['layers'])}")
        if info.get("whole_engine"):  # the int8/fp8 engine timed whole against its float twin
            whole = info["whole_engine"]
            click.echo(f"[I] whole engine: {whole['why']}; kept {whole['kept']}")
        if info.get("float_build"):  # no low-precision layer left: the model's own float build
            click.echo(f"[I] {info['float_build']}")
        fusions = fusions_summary(engine.header.get("backend_meta", {}))
        if fusions:
            click.echo(f"[I] {fusions}")
        if info.get("build_phases_s"):
            from overdrive.engine.runtime import phases_summary

            click.echo(f"[I] {phases_summary(info['build_phases_s'])}")
        if info.get("accuracy"):
            from overdrive.engine.accuracy import summary

            click.echo(f"[I] accuracy {summary(info['accuracy'])}")
        best = info.get("best")
        if best:
            tried = ", ".join(f"{p} {v:.3f} ms" if isinstance(v, float) else f"{p} {v}" for p, v in best["candidates_ms"].items())
            untried = "".join(f"; {p} not tried: {why}" for p, why in best["not_tried"].items())
            click.echo(f"[I] --best timed {tried} (median per call): kept {best['chosen']}{untried}")
        tc = info.get("timing_cache")
        if tc:
            loaded = f"loaded {tc['loaded_bytes']:,} bytes" if tc["loaded"] else "not found, started a new one"
            reused = f", reused {tc['reused_layer_timings']} layer timing(s)" if tc.get("reused_layer_timings") else ""
            click.echo(f"[I] timing cache {tc['path']}: {loaded}{reused}, saved {tc.get('saved_bytes', 0):,} bytes")
    if max_autotune and info["backend"] != "inductor":
        flag = "--max-autotune" if optimization_level is None else f"--builderOptimizationLevel {optimization_level}"
        click.echo(f"[I] {flag} had no effect: it tunes Inductor's kernels, and this engine is {info['backend']}'s "
                   "(its graph optimizations run at their highest level always); add --backend inductor to tune",
                   err=True)
    if dump_layer_info or export_layer_info:
        from overdrive.engine.layers import format_layer_info, layer_info

        layers = layer_info(engine)
        if export_layer_info:
            write_json(layers, export_layer_info)
        if dump_layer_info:  # on stderr when stdout carries --json -
            click.echo(format_layer_info(layers, info["backend"]), err=json_path == "-")
