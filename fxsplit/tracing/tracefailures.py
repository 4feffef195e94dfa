"""What a failed trace says: why torch.fx or torch.export could not trace the model, where, and what to try."""

from __future__ import annotations

import torch

from fxsplit.tracing.example_inputs import first_line, user_frame

__all__ = ["export_message", "fx_message", "scripted_modules", "scripted_note"]


def scripted_modules(model: torch.nn.Module) -> list[str]:
    """The paths of the ``torch.jit.script`` modules in ``model`` (the outermost of nested ones)."""
    found: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule) and not any(path.startswith(f"{p}.") for p in found):
            found.append(path)
    return found


def scripted_note(scripted: list[str]) -> str:
    names = ", ".join(repr(p) if p else "the model itself" for p in scripted[:3]) + (
        ", ..." if len(scripted) > 3 else ""
    )
    return f"the model holds torch.jit.script modules ({names}), which torch.export cannot call"


def fx_message(error: BaseException, examples: str | None = None) -> str:
    """Why fx failed, where, and what to try; ``examples``: None (no example inputs: export could trace with
    them), ``"given"`` (fx was chosen: export may trace it) or ``"tried"`` (export failed first)."""
    where = user_frame(error)
    export = {
        None: "pass example_inputs=(...) so fxsplit can use torch.export, which handles data-dependent Python; or ",
        "given": "trace with torch.export (trace='export', or 'auto', the default), which handles data-dependent "
        "Python; or ",
        "tried": "",
    }[examples]
    return (
        f"torch.fx.symbolic_trace could not trace the model: {first_line(error)}"
        + (f"\n  at {where}" if where else "")
        + f"\n  fixes: {export}declare the module that fails a leaf (leaf_modules=[...]); or fix the value of a "
        "control-flow argument with concrete_args={...}"
    )


def export_message(error: BaseException, scripted: list[str] | None = None) -> str:
    """Why export failed, where, and what to try; ``scripted``: the paths of the model's ``torch.jit.script``
    modules, which export cannot call."""
    where = user_frame(error)
    hint = ""
    if scripted:
        hint = f"\n  {scripted_note(scripted)}: trace with torch.fx (trace='fx'), which calls them as they are"
    if "Cache" in str(error):
        hint = (
            "\n  this looks like a Hugging Face model returning (or taking) its key/value cache, a cache "
            "object that grows on every call, which a split cannot hold. For generation with an attention "
            "model, set model.generation_config.cache_implementation = 'static' and split "
            "transformers.integrations.executorch.TorchExportableModuleWithStaticCache(model, batch_size=1, "
            "max_cache_len=N) under torch.no_grad() (see examples/generate.py; state-space models such as Mamba "
            "have no static cache there); for one forward without a cache, pass example_kwargs={'use_cache': "
            "False} (and call the split model with use_cache=False)"
        )
    if "GuardOnDataDependentSymNode" in type(error).__name__ + str(error):
        hint += "\n  this is Python control flow on a tensor's value (the line above), which one graph cannot hold; "
        if "expert" in where.rpartition(": ")[2].lower():
            hint += (
                "it looks like a mixture-of-experts layer running the experts its router picked, which depend on "
                "the routing. Compute every expert in one graph instead: Hugging Face models that offer it do with "
                "experts_implementation='grouped_mm' (transformers 5's default) or 'batched_mm', given to "
                "from_pretrained(...) or from_config(...); otherwise run each expert on all tokens and weight "
                "its output by the router's (zero where not picked), or under trace='fx' make the layer a leaf "
                "module (leaf_modules=[...]), which runs as written"
            )
        else:
            hint += (
                "in a model in train() mode it is often random (LayerDrop, stochastic depth): plan it in eval() "
                "mode or switch that feature off (e.g. layerdrop=0 in a Hugging Face config)"
            )
    if "modified inplace" in str(error) and torch.is_grad_enabled():
        hint += (
            "\n  autograd forbids this in-place write, which torch.no_grad() allows: a model you run under "
            "torch.no_grad() traces as it runs when you plan it under torch.no_grad() too (with torch.no_grad(): "
            "fxsplit.fxsplit(...)); to train it, write out of place (x = x.relu() for x.relu_())"
        )
    if "fake tensor in the exported program constant" in str(error):
        hint += (
            "\n  the forward makes a tensor and changes it in a way export cannot record (written through .data, "
            "for one: x.data[...].copy_(...)), so the graph would hold a constant without its values: write to the "
            "tensor itself (x[...] = ..., or build it with torch.cat), or trace with torch.fx (trace='fx'), which "
            "records the write"
        )
    if "Constraints violated" in str(error) or "dynamic_shapes" in str(error):
        hint += (
            "\n  this is about dynamic_shapes: a size you marked variable must stay fixed or equal another; "
            "mark fewer dimensions (dynamic_shapes='batch' marks only the batch)"
        )
    return (
        f"torch.export could not trace the model on the example inputs: {first_line(error)}"
        + (f"\n  at {where}" if where else "")
        + hint
        + "\n  fixes: check example_inputs match forward()'s signature (keyword inputs go in "
        "example_kwargs); try trace='fx' with leaf_modules=[...] around the code torch cannot follow"
    )
