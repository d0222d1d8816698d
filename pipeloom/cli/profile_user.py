"""The user's ``FILE.py:FUNCTION`` for ``pipeloom profile``: loading it, building the model, its inputs and
target by the convention in :mod:`pipeloom.cli.profile`, and its errors as one line naming the file."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import inspect
import io
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from pipeloom.cli.errors import UsageError, UserCodeError
from pipeloom.errors import PipeloomError

__all__ = [
    "check_batch",
    "load_function",
    "loss_function",
    "made_up_target",
    "model_and_inputs",
    "names",
    "pieces",
    "user_code",
]


@contextlib.contextmanager
def user_code(path: str, doing: str) -> Iterator[None]:
    """Turn an exception raised by the user's code while ``doing`` into one :class:`UserCodeError`
    line naming ``path`` (and its line where the traceback passes through it). pipeloom's own
    errors pass through unchanged. What the code prints to stderr meanwhile (torch.fx prints its
    own traceback of a failing generated forward) is kept for the verbose part."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except (PipeloomError, KeyboardInterrupt) as error:
        cause = error.__cause__
        if isinstance(cause, Exception) and not isinstance(cause, PipeloomError):  # the user's model failed
            raise _user_error(path, cause, doing, printed, text=str(error)) from error
        sys.stderr.write(printed.getvalue())
        raise
    except Exception as error:  # noqa: BLE001 (any exception of the user's code is reported, not ours)
        raise _user_error(path, error, doing, printed) from error


def _lines_in(path: str, error: BaseException | None) -> list[int]:
    """The lines of ``path`` that ``error``'s traceback passes through."""
    if not isinstance(error, Exception) or isinstance(error, PipeloomError):
        return []
    where = Path(path).resolve()
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
             if frame.lineno is not None and Path(frame.filename).resolve() == where]
    if isinstance(error, SyntaxError) and error.lineno is not None:
        lines.append(error.lineno)
    return lines


def _user_error(path: str, error: BaseException, doing: str, printed: io.StringIO, *,
                text: str | None = None) -> UserCodeError:
    """One :class:`UserCodeError` line naming ``path`` (and its line) for ``error`` (or ``text``, pipeloom's
    own account of it, which names the fix), the traceback for ``--verbose``."""
    lines = _lines_in(path, error)
    place = f"{path}:{lines[-1]}" if lines else path
    if text is None:
        text = f"{_error_text(error)} (while {doing}; fix it in your file)"
    else:
        text = f"{text} (while {doing})"
    trace = printed.getvalue() + "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return UserCodeError(f"{place}: {text}\n{trace}")


def _error_text(error: BaseException) -> str:
    """``TypeName: the message's first line``, or the type alone for an error without a message."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


def load_function(target: str):
    """``(module, function)`` for ``FILE.py:FUNCTION``; UsageError naming what is wrong."""
    path_text, _, name = target.rpartition(":")
    if not path_text or not name:
        raise UsageError(f"{target!r}: write FILE.py:FUNCTION, e.g. examples/train_gpt.py:build_model")
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"{target!r}: no file {path_text!r}")
    spec = importlib.util.spec_from_file_location(f"pipeloom_profiled_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{target!r}: {path_text!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        with user_code(path_text, f"importing {path_text}"):
            spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"{target!r}: {path_text} defines no function {name!r}")
    return module, function


def _keywords(pairs: list[str]) -> dict:
    keywords = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--arg {pair!r}: write KEY=VALUE, e.g. --arg layers=8")
        try:
            keywords[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            keywords[key] = text
    return keywords


def _first_module(model, args: argparse.Namespace):
    """``(name, module)`` of the first module the model calls: from a torch.fx trace as the runtime makes
    it; where torch.fx cannot trace the model, its input embeddings (Hugging Face's
    ``get_input_embeddings``) or else its first embedding or linear module."""
    from torch import nn

    from pipeloom.runtime import ModelTraceError
    from pipeloom.runtime.model.tracing import trace_model

    if isinstance(model, (list, tuple, nn.ModuleList)):  # pieces given as modules: the first one starts
        return _first_module(model[0], args)
    try:
        traced = trace_model(model, tracer="fx", leaf_modules=names(args.leaf_modules) or ())
    except ModelTraceError:
        embeddings = getattr(model, "get_input_embeddings", None)
        found = embeddings() if callable(embeddings) else None
        if isinstance(found, nn.Module):
            return next((n for n, m in model.named_modules() if m is found), "input embeddings"), found
        return next(((n, m) for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.Linear))),
                    ("", model))
    reader = _input_reader(model, traced.graph)
    if reader is not None:
        return reader, model.get_submodule(reader)
    first = next((str(node.target) for node in traced.graph.nodes if node.op == "call_module"), None)
    return (first, model.get_submodule(first)) if first is not None else ("", model)


def _input_reader(model, graph) -> str | None:
    """The module that first reads the model's first input (its other uses, ``ids.size(1)``, passed over): a module
    called on it, or the embedding whose weight a lookup reads it with (a tied embedding is traced into, as
    ``F.embedding``; the weight may be registered on the head first); None if neither."""
    import torch.nn.functional as F
    from torch import nn

    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    for user in inputs[0].users if inputs else ():
        if user.op == "call_module":
            return str(user.target)
        weight = user.args[1] if user.op == "call_function" and user.target is F.embedding else None
        if weight is not None and weight.op == "get_attr":
            tensor = dict(model.named_parameters(remove_duplicate=False)).get(str(weight.target))
            return next((name for name, module in model.named_modules()
                         if isinstance(module, nn.Embedding) and tensor is not None and module.weight is tensor), None)
    return None


def _made_up_inputs(model, args: argparse.Namespace):
    """Inputs for the first module the model calls: token ids (Embedding) or noise (Linear)."""
    import torch
    from torch import nn

    first, module = _first_module(model, args)
    if isinstance(module, nn.Embedding):
        if args.seq is None:
            raise UsageError(f"the model starts with an embedding ({first}); give --seq S for its token inputs")
        return torch.randint(module.num_embeddings, (args.batch, args.seq))
    if isinstance(module, nn.Linear):
        shape = (args.batch,) + ((args.seq,) if args.seq else ()) + (module.in_features,)
        return torch.randn(shape)
    raise UsageError(f"cannot make inputs for a model starting with {type(module).__name__}; return (model, "
                     f"inputs) from the function, or define example_inputs(model, batch, seq) in the file")


def model_and_inputs(module, function, args: argparse.Namespace):
    """``(model, inputs, target)`` by the FUNCTION convention (:mod:`pipeloom.cli.profile`'s docstring)."""
    keywords = _keywords(args.arg)
    signature = inspect.signature(function)
    try:
        signature.bind(**keywords)
    except TypeError as error:
        parameters = signature.parameters
        unknown = sorted(set(keywords) - set(parameters)) or sorted(keywords)
        takes = ", ".join(parameters) or "nothing"
        raise UsageError(f"{args.target} cannot take {unknown} ({error}); it takes: {takes}") from None
    file = args.target.rpartition(":")[0]
    with user_code(file, f"calling {args.target}"):
        built = function(**keywords)
    parts = built if isinstance(built, tuple) else (built,)
    if not parts or not _is_model(parts[0]) or len(parts) > 3:
        raise UsageError(f"{args.target} must return a model (or its pieces as a list of modules), (model, inputs) "
                         f"or (model, inputs, target); got {type(built).__name__}")
    model, inputs, target = (list(parts) + [None, None])[:3]
    if inputs is None:
        maker = getattr(module, "example_inputs", None)
        if callable(maker):
            with user_code(file, "calling example_inputs"):
                made = maker(model, batch=args.batch, seq=args.seq)
            inputs, target = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
        else:
            with user_code(file, "tracing the model to make up inputs"):
                inputs = _made_up_inputs(model, args)
    return model, inputs, target


def _is_model(value) -> bool:
    """A module, or pieces given as a non-empty list of modules."""
    from torch import nn

    if isinstance(value, list):
        return bool(value) and all(isinstance(m, nn.Module) for m in value)
    return isinstance(value, nn.Module)


def loss_function(module, args: argparse.Namespace):
    """The ``--loss NAME`` function of FILE (None without ``--loss``)."""
    if args.loss is None:
        return None
    loss = getattr(module, args.loss, None)
    if not callable(loss):
        raise UsageError(f"--loss {args.loss!r}: {args.target.rpartition(':')[0]} defines no such function")
    return loss


def made_up_target(model, inputs, loss=None, loss_name: str = ""):
    """Class targets for the model's output (its first tensor: a Hugging Face output's logits): integers
    below its last dimension, one per other position; with ``loss`` (``--loss loss_name``), a UsageError where it
    fails on them (profiling had blamed the model's last piece)."""
    import warnings

    import torch
    import torch.utils._pytree as pytree
    from torch import nn

    with torch.no_grad():
        if isinstance(model, (list, nn.ModuleList)):  # pieces as modules: each takes the one before's output
            out = model[0](*(inputs if isinstance(inputs, tuple) else (inputs,)))
            for piece in model[1:]:
                out = piece(out)
        else:
            out = model(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    first = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise UsageError("cannot make up a target: the model's output holds no tensor with a class dimension; "
                         "return (model, inputs, target) from the function")
    target = torch.randint(first.size(-1), first.shape[:-1])
    if loss is not None:
        try:
            with warnings.catch_warnings():  # its own, said again when it runs in the profile
                warnings.simplefilter("ignore")
                loss(out, target)
        except (RuntimeError, ValueError, IndexError, TypeError) as error:  # shapes or dtypes the ids do not fit
            # (any other fault is the loss's own: said by user_code with its file and line)
            raise UsageError(f"--loss {loss_name} fails on the model's output {tuple(first.shape)} and the made-up "
                             f"target, class ids {tuple(target.shape)} ({_error_text(error)}); return "
                             "(model, inputs, target) from the function, or give a loss that takes class ids") \
                from None
    return target


def names(text: str | None) -> list[str]:
    """``a,b,c`` as names (none for None)."""
    return [name.strip() for name in text.split(",") if name.strip()] if text else []


def pieces(args: argparse.Namespace) -> list[str] | None:
    """``--pieces a,b,c`` as names (None: the profiler's default pieces)."""
    return names(args.pieces) or None


def check_batch(inputs, samples: int, what: str) -> None:
    """UsageError unless the inputs' first tensor holds ``samples`` samples (``what`` names the option)."""
    import torch

    first = next((t for t in (inputs if isinstance(inputs, tuple) else (inputs,))
                  if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if first is None or first.size(0) != samples:
        held = "no tensor" if first is None else f"{first.size(0)} samples"
        raise UsageError(f"the inputs hold {held} but {what} is {samples}; make the function's inputs match {what}")
