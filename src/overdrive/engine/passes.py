"""Graph passes on the exported program before Inductor compiles it.

``drop_constant_attention_masks``: an attention mask that the model builds from constants (Hugging Face
models build an all-ones padding mask when no ``attention_mask`` is given, and keep it while tracing) is
folded away when it masks nothing: an additive float mask of zeros, or a boolean mask of all True. Eager
Hugging Face drops such a mask at run time (``torch.all(mask == 1)``, a data-dependent check that export
cannot keep), so without this pass the engine ran a masked attention kernel that eager does not.
The result is exact: ``softmax(s + 0) == softmax(s)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.node import Node, map_arg

aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention.default
_MASK_POS = 3  # (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False)

# ops whose value is a function of their arguments' values and shapes only (no randomness, no state):
# tensor creation (ones, full, arange: Hugging Face 5.x builds its all-True mask as arange(s) >= 0), views and
# layout, indexing, dtype conversion, plus every ATen op tagged pointwise (checked below)
_CONSTANT_OPS = {
    aten.ones.default, aten.zeros.default, aten.full.default, aten.scalar_tensor.default,
    aten.ones_like.default, aten.zeros_like.default, aten.full_like.default,
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.tril.default, aten.triu.default,
    aten.lift_fresh_copy.default, aten.index.Tensor, aten.cat.default, aten.stack.default,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.expand.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.slice.Tensor, aten.select.int,
    aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other, aten._to_copy.default, aten.type_as.default,
    aten.sym_size.int, aten.sym_numel.default,
}
# arithmetic on sizes (symbolic when the profile is dynamic)
_SIZE_FUNCS = {getattr(torch, f) for f in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum")
               if hasattr(torch, f)}


def _value_free(op: Any) -> bool:
    """Whether ``op`` computes from values and shapes alone, deterministically."""
    if op in _CONSTANT_OPS or op in _SIZE_FUNCS or getattr(op, "__module__", None) in ("operator", "_operator"):
        return True
    tags = getattr(op, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _constant_subgraph(mask: Node, user_inputs: set[str], leaves: dict[str, torch.Tensor]) -> list[Node] | None:
    """The nodes ``mask`` is computed from, in graph order, if none of them reads a user input's values
    (reading its size is fine); None otherwise."""
    seen: dict[Node, None] = {}
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        if n.op == "placeholder":
            if n.name not in user_inputs and n.name not in leaves:
                return None
            continue
        if n.op != "call_function" or not _value_free(n.target):
            return None
        if n.target is aten.sym_size.int:
            stack.append(n.args[0])  # the size of a user input: allowed
            continue
        stack.extend(n.all_input_nodes)
    for n in seen:  # a user input may be read for its size only
        if n.op == "placeholder" and n.name in user_inputs:
            if any(u in seen and u.target is not aten.sym_size.int for u in n.users):
                return None
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
          aten.t.default, aten.transpose.int, aten.permute.default, aten.alias.default, aten.detach.default}


def _written_placeholders(graph: torch.fx.Graph) -> set[str]:
    """Placeholders that an in-place op in the graph writes, directly or through views of them."""
    out = set()
    for p in graph.nodes:
        if p.op != "placeholder":
            continue
        stack, seen = [p], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            for u in n.users:
                schema = getattr(u.target, "_schema", None)
                if schema is not None and schema.is_mutable:
                    out.add(p.name)
                elif u.target in _VIEWS:
                    stack.append(u)
    return out


def _evaluate(nodes: list[Node], env: dict[str, Any]) -> Any:
    vals: dict[Node, Any] = {}
    for n in nodes:
        if n.op == "placeholder":
            vals[n] = env[n.name]
        else:
            args = map_arg(n.args, vals.__getitem__)
            kwargs = map_arg(n.kwargs, vals.__getitem__)
            vals[n] = n.target(*args, **kwargs)
    return vals[nodes[-1]]


def _masks_nothing(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    if value.dtype == torch.bool:
        return bool(value.all())
    return value.is_floating_point() and not bool(value.any())


def constant_inputs(ep: Any) -> dict[str, torch.Tensor]:
    """The placeholders of ``ep`` whose values are fixed at build time (parameters, buffers the forward never writes,
    lifted constants), by placeholder name.

    Example:
        >>> ep = torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
        >>> sorted(constant_inputs(ep))
        ['p_bias', 'p_weight']
    """
    sig = ep.graph_signature
    leaves: dict[str, torch.Tensor] = {}
    state = ep.state_dict
    mutated = set(sig.buffers_to_mutate.values())  # a buffer the forward writes holds another value at run time
    written = _written_placeholders(ep.graph_module.graph)  # ... also when export kept the in-place op
    for name, target in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items():
        value = state.get(target, ep.constants.get(target))  # non-persistent buffers live in constants
        if isinstance(value, torch.Tensor) and target not in mutated and name not in written:
            leaves[name] = value
    for name, target in sig.inputs_to_lifted_tensor_constants.items():
        if target in ep.constants and isinstance(ep.constants[target], torch.Tensor):
            leaves[name] = ep.constants[target]
    return leaves


def drop_constant_attention_masks(ep: Any, corner_inputs: list[tuple[torch.Tensor, ...]]) -> list[str]:
    """Remove attention masks that are built from constants and mask nothing, in place.

    A mask qualifies when it reads no user input's values (sizes are fine) and evaluates, for each input
    tuple in ``corner_inputs`` (the shape profile's min, opt and max shapes), to zeros (additive float) or
    all True (boolean). Returns the names of the attention nodes changed.

    Example:
        >>> ep = torch.export.export(model, (ids,))                        # doctest: +SKIP
        >>> drop_constant_attention_masks(ep, [(ids,)])                     # doctest: +SKIP
        ['scaled_dot_product_attention', 'scaled_dot_product_attention_1', ...]
    """
    gm = ep.graph_module
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_inputs = [n.name for n in placeholders if n.name in set(sig.user_inputs)]
    leaves = constant_inputs(ep)
    changed: list[str] = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask = node.args[_MASK_POS] if len(node.args) > _MASK_POS else node.kwargs.get("attn_mask")
        if not isinstance(mask, Node):
            continue
        nodes = _constant_subgraph(mask, set(user_inputs), leaves)
        if nodes is None:
            continue
        try:
            with torch.no_grad():
                empty = all(_masks_nothing(_evaluate(nodes, {**leaves, **dict(zip(user_inputs, xs))}))
                            for xs in corner_inputs)
        except Exception:  # an op that does not evaluate outside the graph: leave the mask as it is
            continue
        if not empty:
            continue
        if len(node.args) > _MASK_POS:
            node.args = node.args[:_MASK_POS] + (None,) + node.args[_MASK_POS + 1:]
        else:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        changed.append(node.name)
    if changed:
        _drop_dead(gm.graph)
        gm.recompile()
    return changed


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Dead-code elimination that also drops the metadata asserts left on dead values (export adds
    ``_assert_tensor_metadata`` after dtype conversions; they are side-effecting, so plain DCE keeps them)."""
    asserts = {aten._assert_tensor_metadata.default}
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n.op != "call_function" or n.users:
                continue
            if n.target in asserts:
                src = n.args[0]
                if isinstance(src, Node) and set(src.users) == {n}:
                    graph.erase_node(n)
                    changed = True
            elif not n.is_impure():
                graph.erase_node(n)
                changed = True


# dropout ops as export leaves them in an eval-mode model: (input, p, train); identities when not training or p == 0
_DROPOUTS = {getattr(aten, name).default for name in ("dropout", "feature_dropout", "alpha_dropout",
                                                      "feature_alpha_dropout") if hasattr(aten, name)}


def drop_inference_dropout(ep: Any) -> int:
    """Remove the dropout nodes that compute the identity (``train`` False or ``p`` 0), in place; returns how many.

    ``torch.export`` of an eval-mode model keeps ``aten.dropout(x, p, False)`` (timm's ``Mlp`` has one between its
    GELU and ``fc2``, Hugging Face models after attention and every MLP). Inductor drops it when it compiles, but the
    pattern passes before it saw a node between a GEMM's epilogue and the next layer's quantize, so a ViT's fc1 could
    not write fc2's 8-bit input and the layer timing judged it in the slower float-output form. Dropout in a model
    exported in training mode (``train`` True, ``p`` > 0) is left as it is.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)).eval()
        >>> drop_inference_dropout(torch.export.export(m, (torch.randn(2, 4),)))
        1
    """
    graph = ep.graph_module.graph
    done = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _DROPOUTS:
            continue
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        if not isinstance(p, (int, float)) or not isinstance(train, bool) or (train and p != 0):
            continue
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
        done += 1
    if done:
        graph.lint()
        ep.graph_module.recompile()
    return done


def fuse_gemm_gelu(ep: Any) -> list[str]:
    """Fold ``gelu(linear(x, w, b))`` into one GEMM with a GELU epilogue (``aten._addmm_activation``), in place.

    Inductor runs cuBLAS for the GEMM and the GELU as a separate Triton pass over the (tokens, 4 x hidden)
    activation (on the H200, BERT-base bs256: 1.76 of 12.2 GPU ms, ``engine_profile.md``). cuBLASLt can
    apply bias and GELU in the GEMM's epilogue; Inductor calls ``_addmm_activation`` as an extern kernel.
    On CUDA that epilogue is the tanh form of GELU (at most 5e-4 from the erf form, below fp16/bf16
    rounding at these magnitudes); on CPU ATen computes the erf form. Returns the names of the GELU nodes
    folded. Only erf-form GELUs (``approximate="none"``, BERT's and ViT's) after linears whose output feeds
    the GELU alone, with a 1-D bias and a 2-D weight, qualify.

    Example:
        >>> ep = torch.export.export(mlp, (x,))                     # doctest: +SKIP
        >>> fuse_gemm_gelu(ep)                                       # doctest: +SKIP
        ['gelu']
    """
    gm = ep.graph_module
    graph = gm.graph
    fused: list[str] = []
    for gelu in list(graph.nodes):
        if gelu.op != "call_function" or gelu.target is not aten.gelu.default:
            continue
        if gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none") != "none":
            continue  # the tanh form: ATen's CPU epilogue computes the erf form, so it would not match there
        lin = gelu.args[0]
        if not (isinstance(lin, Node) and lin.target is aten.linear.default and len(lin.users) == 1
                and len(lin.args) == 3 and isinstance(lin.args[2], Node)):
            continue
        x, w, b = lin.args
        xv, wv, bv = (getattr(n, "meta", {}).get("val") for n in (x, w, b))
        if xv is None or wv is None or bv is None or wv.dim() != 2 or bv.dim() != 1 or xv.dim() < 2:
            continue
        n_out, k = wv.shape
        with graph.inserting_before(gelu):
            lead = [d if isinstance(d, int) else graph.call_function(aten.sym_size.int, (x, i))
                    for i, d in enumerate(xv.shape[:-1])]
            x2 = x if xv.dim() == 2 else graph.call_function(aten.reshape.default, (x, [-1, k]))
            wt = graph.call_function(aten.t.default, (w,))
            y2 = graph.call_function(aten._addmm_activation.default, (b, x2, wt), {"use_gelu": True})
            y = y2 if xv.dim() == 2 else graph.call_function(aten.view.default, (y2, [*lead, n_out]))
        gelu.replace_all_uses_with(y)
        graph.erase_node(gelu)
        graph.erase_node(lin)
        fused.append(gelu.name)
    if fused:
        graph.eliminate_dead_code()
        refresh_values(gm)
    return fused


def refresh_values(gm: torch.fx.GraphModule) -> None:
    """Recompile a rewritten graph module and propagate fake values (``meta["val"]``: shape, dtype, layout) through
    it from its placeholders', so the new nodes carry them (later passes read them, and saving needs them)."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm.recompile()
    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)


def node_value(n: Any) -> Any:
    """The fake tensor (``meta["val"]``) of an FX node; None for anything else or a node without one."""
    return n.meta.get("val") if isinstance(n, Node) else None


def rename_output(ep: Any, old: str, new: str) -> None:
    """Point the exported program's output specs that named node ``old`` at ``new`` (the node replacing it)."""
    for spec in ep.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) == old:
            spec.arg.name = new
