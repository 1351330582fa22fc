"""An engine's layers as trtexec reports them (``--exportLayerInfo`` JSON, ``--dumpLayerInfo`` text): the graph its
runtime takes (ONNX Runtime's nodes, or the exported program Inductor compiles), with each layer's tensors, weights
and, for an int8/fp8 build, where the build placed it. :func:`layer_info` gives the JSON
(``overdrive.engine.layer_info(engine)``), :func:`format_layer_info` the text.
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_layer_info", "layer_info"]


def _tensor_facts(node: Any) -> dict[str, Any]:
    """A graph value as trtexec's detailed layer information names one: name, dimensions and data type."""
    val = node.meta.get("val") if hasattr(node, "meta") else None
    facts: dict[str, Any] = {"Name": node.name}
    if hasattr(val, "shape") and hasattr(val, "dtype"):
        facts["Dimensions"] = [int(d) if str(d).isdigit() else str(d) for d in val.shape]
        facts["Datatype"] = str(val.dtype).removeprefix("torch.")
    return facts


def _is_assert(node: Any) -> bool:
    """A check torch.export leaves in the graph (``aten._assert_tensor_metadata``): no layer, no reader."""
    return "_assert_tensor_metadata" in str(node.target)


def _program_layers(ep: Any, input_names: list[str], output_names: list[str]) -> list[dict[str, Any]]:
    """The layers of an exported program, as Inductor compiles it: the ops of one leaf module (a Linear, a fused
    convolution, an int8 GEMM) make one layer named by the module's path in the user's model; an op of the model's
    own forward (a functional GELU, the input casts) is a layer of its own named by its node."""
    sig = ep.graph_signature
    weights = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **getattr(sig, "inputs_to_lifted_tensor_constants", {})}
    renamed = {**dict(zip(sig.user_inputs, input_names)), **dict(zip(sig.user_outputs, output_names))}

    def model_stack(node: Any) -> list[tuple[str, str]]:
        """The node's modules from the user's model down (the engine's own I/O wrappers left out)."""
        stack = (node.meta.get("nn_module_stack") or {}).values()
        return [(p, str(c)) for p, c in stack if not str(c).startswith("overdrive.engine.")]

    # the user's model's path in the program (``model`` below the engine's I/O cast; '' when exported bare)
    root = next((st[0][0] for n in ep.graph.nodes if (st := model_stack(n))), "")

    def relative(path: str) -> str:
        return path[len(root) + 1:] if root and path.startswith(root + ".") else path

    def where(node: Any) -> tuple[str | None, str | None]:
        """(path, class) of the node's innermost module inside the user's model, or (None, None)."""
        users = model_stack(node)
        if len(users) < 2:  # only the model's root: an op of its own forward
            return None, None
        path, cls = users[-1]
        return relative(path), cls.rsplit(".", 1)[-1]

    groups: list[tuple[str | None, str | None, list[Any]]] = []
    for node in ep.graph.nodes:
        if node.op != "call_function" or _is_assert(node):
            continue
        path, cls = where(node)
        if path is not None and groups and groups[-1][0] == path:
            groups[-1][2].append(node)
        else:
            groups.append((path, cls, [node]))
    layers = []
    for path, cls, nodes in groups:
        inside = set(nodes)
        ins, outs, wts = [], [], []
        for n in nodes:
            for a in n.all_input_nodes:
                if a in inside or a in ins:
                    continue
                if a.op == "placeholder" and a.name in weights:
                    wts.append(relative(weights[a.name]))
                else:
                    ins.append(a)
            if any(u not in inside and not _is_assert(u) for u in n.users):
                outs.append(n)
        op = str(nodes[0].target).removesuffix(".default")
        name = path if path is not None else nodes[0].name
        layer: dict[str, Any] = {"Name": name, "LayerType": cls or op,
                                 "Inputs": [{**_tensor_facts(a), "Name": renamed.get(a.name, a.name)} for a in ins],
                                 "Outputs": [{**_tensor_facts(o), "Name": renamed.get(o.name, o.name)} for o in outs
                                             if o.op != "output"]}
        if wts:
            layer["Weights"] = wts
        layer["Ops"] = sorted({str(n.target).removesuffix(".default") for n in nodes})
        layers.append(layer)
    return layers


def _onnx_layers(data: bytes, output_names: list[str]) -> list[dict[str, Any]]:
    """The layers of an ONNX Runtime engine: the nodes of the graph it runs (ONNX Runtime's fusions applied at
    build), weights (initializers) apart from the activations each layer reads."""
    import onnx

    model = onnx.load_from_string(data)
    inits = {i.name for i in model.graph.initializer}
    renamed = dict(zip((o.name for o in model.graph.output), output_names))
    layers = []
    for i, node in enumerate(model.graph.node):
        layer: dict[str, Any] = {"Name": node.name or f"{node.op_type}_{i}", "LayerType": node.op_type,
                                 "Inputs": [{"Name": renamed.get(t, t)} for t in node.input if t and t not in inits],
                                 "Outputs": [{"Name": renamed.get(t, t)} for t in node.output if t]}
        wts = [t for t in node.input if t in inits]
        if wts:
            layer["Weights"] = wts
        layers.append(layer)
    return layers


def layer_info(engine: Any) -> dict[str, Any]:
    """trtexec's ``--exportLayerInfo`` JSON for an engine (as with ``--profilingVerbosity=detailed``): ``Layers``,
    one object each (``Name``, ``LayerType``, ``Inputs`` / ``Outputs`` with ``Dimensions`` and ``Datatype`` where
    known, ``Weights``, the ``Ops`` it holds, and ``Precision``: where an int8/fp8 build placed it), and
    ``Bindings``; ``Fusions``, the graph rewrites of the build, where it made any. The layers are those the engine's
    runtime takes: ONNX Runtime's graph (its fusions applied), or the exported program that Inductor compiles (which
    fuses pointwise ops into its kernels at load; ``exec --dumpProfile`` names those kernels).

    Example:
        >>> # info = layer_info(Engine.load("model.engine")); [l["Name"] for l in info["Layers"]]
    """
    from overdrive.engine.runtime import fusions_summary

    h = engine.header
    outputs = [o["name"] for o in h["outputs"]]
    if "onnx" in engine.sections:
        layers = _onnx_layers(engine.sections["onnx"], outputs)
    elif "exported_program" in engine.sections:
        from overdrive.engine.sources import load_exported

        ep = load_exported(engine.sections["exported_program"], "engine section 'exported_program'")
        layers = _program_layers(ep, list(engine.input_names), outputs)
    else:
        layers = []
    placed = engine.info.get("layers") or {}
    for layer in layers:
        if layer["Name"] in placed:
            layer["Precision"] = placed[layer["Name"]]
    out: dict[str, Any] = {"Layers": layers, "Bindings": [*engine.input_names, *outputs]}
    fusions = fusions_summary(h.get("backend_meta") or {})
    if fusions:
        out["Fusions"] = fusions.removeprefix("fusions: ")
    return out


def format_layer_info(info: dict[str, Any], backend: str) -> str:
    """trtexec's ``--dumpLayerInfo`` block from :func:`layer_info`: one line per layer (name, type, where an
    int8/fp8 build placed it, inputs -> outputs), then the bindings and the build's fusions.

    Example:
        >>> print(format_layer_info({"Layers": [{"Name": "fc", "LayerType": "Gemm", "Inputs": [{"Name": "x"}],
        ...                                      "Outputs": [{"Name": "y", "Dimensions": [2, 4]}]}],
        ...                          "Bindings": ["x", "y"]}, "onnxruntime"))
        [I] Layer Information (onnxruntime, 1 layers):
        [I] fc (Gemm): x -> y[2x4]
        [I] Bindings: x, y
    """
    def tensor(t: dict[str, Any]) -> str:
        dims = t.get("Dimensions")
        return t["Name"] + (f"[{'x'.join(str(d) for d in dims)}]" if dims is not None else "")

    lines = [f"[I] Layer Information ({backend}, {len(info['Layers'])} layers):"]
    for layer in info["Layers"]:
        where = f" [{layer['Precision']}]" if layer.get("Precision") else ""
        ins = ", ".join(tensor(t) for t in layer["Inputs"]) or "-"
        outs = ", ".join(tensor(t) for t in layer["Outputs"]) or "-"
        lines.append(f"[I] {layer['Name']} ({layer['LayerType']}){where}: {ins} -> {outs}")
    lines.append(f"[I] Bindings: {', '.join(info['Bindings'])}")
    if info.get("Fusions"):
        lines.append(f"[I] Fusions: {info['Fusions']}")
    return "\n".join(lines)
