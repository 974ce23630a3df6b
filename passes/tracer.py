"""The fx tracer of ``passes.capture``: ``torch.fx.Tracer`` with two shortcuts that give the same graph.

- Parameter names from a table: the stock tracer searches every parameter of the model for each
  parameter a traced (non-leaf) module reads (llama-140b: 161 norms x 723 parameters, a fifth of its
  trace).
- Repeated module calls (``replay=True``): a call of a module that repeats one already traced copies
  that call's nodes instead of running ``forward`` again (llama-140b: 80 identical layers, 5 851
  nodes; the trace ~0.6 -> ~0.25 s). A call *repeats* a traced one when the module is of the same
  class with the same state, module for module below it (every attribute that is not a submodule,
  parameter or buffer: plain values by value, other objects by identity; parameters and buffers by
  shape, stride, dtype, device and grad flag; no hooks), it is called alike (the same argument
  structure, the same literals, proxies in the same places and aliasing), and everything the copy
  names is named as tracing would name it (each submodule, parameter and buffer by its first path
  under the root, none of its submodules called before, none of its parameters read before). The
  traced call must itself be self-contained: its nodes read only each other and the call's inputs,
  name only the module's own submodules, parameters and buffers, leave the module's state as it was,
  and return proxies of its nodes or inputs and literals. Copied nodes are created in the same order
  through the same graph, so they get the names, module stacks and scopes tracing gives them.

What cannot be seen from there is assumed: that ``forward`` reads nothing else that changes between
calls (globals, a counter). The runtime's capture does not replay (``passes.capture``); planning's
does, and ``tests/test_analysis_speed_front.py`` checks the graphs equal, node for node, on the zoo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Tracer"]

_LITERALS = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_STATE_SKIP = frozenset({"_parameters", "_buffers", "_modules"})


class _NoReplay(Exception):
    pass


@dataclass(frozen=True, eq=False)
class _Template:
    """One traced call: its module path, nodes, the call's input nodes in order, the output's structure,
    and the module calls it counted (path relative to the module -> count)."""

    path: str
    depth: int                             # entries of the module stack at the call, its own included
    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    out_spec: Any
    out_leaves: tuple[Any, ...]            # ("N", node) or ("L", literal)
    calls: tuple[tuple[str, int], ...]
    scopes: tuple[tuple[str, Any], ...]    # per node: (module path relative to the module, module type)
    cached: tuple[bool, ...]               # per node: a get_attr kept in the parameter proxy cache


def _literal(v: Any) -> tuple:
    if v is None or v is Ellipsis or isinstance(v, _LITERALS):
        return (type(v), v)
    if isinstance(v, (tuple, list, frozenset, set)):
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return (type(v), tuple(_literal(x) for x in items))
    raise _NoReplay


def _state_value(v: Any) -> tuple:
    try:
        return _literal(v)
    except _NoReplay:
        return ("id", id(v))


def _tensor(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _rel(path: str, prefix: str) -> str:
    return path[len(prefix) + 1:] if path != prefix else ""


def _join(prefix: str, rel: str) -> str:
    return f"{prefix}.{rel}" if rel else prefix


class Tracer(fx.Tracer):
    """``fx.Tracer`` with the module docstring's shortcuts (``replay``: repeated module calls)."""

    def __init__(self, *args, replay: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.replay = replay
        self.replayed = 0       # module calls copied by the last ``trace``

    # -- parameter names -------------------------------------------------------------------------
    def trace(self, root, concrete_args=None):
        self._param_names: dict[int, str] = {}
        self._buffer_names: dict[int, str] = {}
        self._templates: dict[tuple, _Template | None] = {}
        self._proxy_cache: dict | None = None
        self._repeated: set[type] = set()
        self.replayed = 0
        if isinstance(root, nn.Module):
            for name, p in root.named_parameters():
                self._param_names.setdefault(id(p), name)
            for name, b in root.named_buffers():
                self._buffer_names.setdefault(id(b), name)
            seen: set[type] = set()
            for m in root.modules():
                if type(m) in seen:
                    self._repeated.add(type(m))
                seen.add(type(m))
        return super().trace(root, concrete_args)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        self._proxy_cache = parameter_proxy_cache
        name = self._param_names.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if name is None or self.param_shapes_constant:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    # -- repeated module calls ---------------------------------------------------------------------
    def call_module(self, m, forward, args, kwargs):
        if not self.replay or type(m) not in self._repeated or self.check_mutable_operations \
                or self.record_stack_traces or fx.traceback.has_preserved_node_meta():
            return super().call_module(m, forward, args, kwargs)
        try:
            path = self.path_of_module(m)
            if self.is_leaf_module(m, path):
                return super().call_module(m, forward, args, kwargs)
            sig, inputs = self._signature(m, path, args, kwargs)
        except (_NoReplay, NameError):
            return super().call_module(m, forward, args, kwargs)
        if sig in self._templates:
            tpl = self._templates[sig]
            if tpl is not None and self._fresh(m, path):
                return super().call_module(m, lambda *a, **k: self._replay(tpl, path, inputs), args, kwargs)
            return super().call_module(m, forward, args, kwargs)
        if not self._fresh(m, path):
            return super().call_module(m, forward, args, kwargs)
        record: dict = {}
        out = super().call_module(m, lambda *a, **k: self._record(record, m, path, inputs, forward, a, k),
                                  args, kwargs)
        self._templates[sig] = record.get("template")
        return out

    def _signature(self, m: nn.Module, path: str, args, kwargs) -> tuple[tuple, tuple[fx.Node, ...]]:
        """(what the call's nodes depend on, the call's input nodes in order); ``_NoReplay`` where an
        argument or the state is not described that far."""
        leaves, spec = tree_flatten((args, kwargs))
        inputs: list[fx.Node] = []
        desc = []
        for x in leaves:
            if type(x) is fx.Proxy:          # not a lazy Attribute proxy: its node would be made now
                if x.tracer is not self:
                    raise _NoReplay
                if x.node not in inputs:
                    inputs.append(x.node)
                desc.append(("P", inputs.index(x.node)))
            elif isinstance(x, fx.Proxy):
                raise _NoReplay
            else:
                desc.append(("L", _literal(x)))
        return (type(m), _module_state(m), repr(spec), tuple(desc)), tuple(inputs)

    def _fresh(self, m: nn.Module, path: str) -> bool:
        """Whether a copy of a call of ``m`` names what tracing would: every submodule, parameter and
        buffer below ``m`` by its first path, none of its submodules called before (``m`` itself
        once, by the call being made), none of its parameters read before."""
        for rel, sub in m.named_modules(remove_duplicate=False):
            if self.submodule_paths is None or self.submodule_paths.get(sub) != _join(path, rel):
                return False
            for k, v in vars(sub).items():
                if isinstance(v, torch.Tensor) and self.tensor_attrs.get(v) != _join(path, _join(rel, k)):
                    return False
        cache = self._proxy_cache or {}
        for rel, p in m.named_parameters(remove_duplicate=False):
            name = _join(path, rel)
            if self._param_names.get(id(p)) != name or name in cache:
                return False
        for rel, b in m.named_buffers(remove_duplicate=False):
            if self._buffer_names.get(id(b)) != _join(path, rel):
                return False
        prefix = path + "."
        return self.num_calls.get(path, 0) == 0 and not any(k.startswith(prefix) for k in self.num_calls)

    def _record(self, record: dict, m: nn.Module, path: str, inputs, forward, args, kwargs):
        """Run ``forward`` and keep its nodes as a ``_Template`` in ``record`` where they are
        self-contained (module docstring)."""
        depth = len(self.module_stack)
        before_len = len(self.graph.nodes)
        before_calls = dict(self.num_calls)
        before_state = _module_state(m)
        before_cache = set(self._proxy_cache or ())
        out = forward(*args, **kwargs)
        try:
            record["template"] = self._template(m, path, depth, inputs, out, before_len, before_calls,
                                                before_state, before_cache)
        except _NoReplay:
            pass
        return out

    def _template(self, m, path, depth, inputs, out, before_len, before_calls, before_state,
                  before_cache) -> _Template:
        count = len(self.graph.nodes) - before_len
        nodes: list[fx.Node] = []
        for n in reversed(self.graph.nodes):
            if len(nodes) == count:
                break
            nodes.append(n)
        nodes.reverse()
        known = set(nodes) | set(inputs)
        prefix = path + "."
        for n in nodes:
            if n.op not in ("call_function", "call_method", "call_module", "get_attr"):
                raise _NoReplay
            if n.op in ("call_module", "get_attr") and not str(n.target).startswith(prefix):
                raise _NoReplay
            if any(a not in known for a in n.all_input_nodes):
                raise _NoReplay
            if set(n.meta) - {"nn_module_stack"}:
                raise _NoReplay
        if _module_state(m) != before_state:
            raise _NoReplay
        calls = []
        for k, v in self.num_calls.items():
            if k != path and before_calls.get(k, 0) != v:
                if not k.startswith(prefix) or before_calls.get(k, 0) != 0:
                    raise _NoReplay
                calls.append((_rel(k, path), v))
        leaves, spec = tree_flatten(out)
        out_leaves = []
        for x in leaves:
            if type(x) is fx.Proxy and x.tracer is self and x.node in known:
                out_leaves.append(("N", x.node))
            elif isinstance(x, fx.Proxy):
                raise _NoReplay
            else:
                _literal(x)
                out_leaves.append(("L", x))
        scopes = []
        for n in nodes:
            scope_path, scope_type = self.node_name_to_scope.get(n.name, (None, None))
            if scope_path is None or not (scope_path == path or scope_path.startswith(prefix)):
                raise _NoReplay
            scopes.append((_rel(scope_path, path), scope_type))
        cache = self._proxy_cache or {}
        cached = tuple(n.op == "get_attr" and n.target in cache and n.target not in before_cache for n in nodes)
        return _Template(path, depth, tuple(nodes), tuple(inputs), spec, tuple(out_leaves), tuple(calls), tuple(scopes),
                         cached)

    def _replay(self, tpl: _Template, path: str, inputs: tuple[fx.Node, ...]):
        """The nodes of ``tpl`` made again for the call of the module at ``path`` on ``inputs``."""
        env = dict(zip(tpl.inputs, inputs))
        old = tpl.path + "."

        def rename(text: str) -> str:
            return path + text[len(tpl.path):] if text == tpl.path or text.startswith(old) else text

        outer = list(self.module_stack.items())     # this call's entry is the last one
        for n, (scope_rel, scope_type), cached in zip(tpl.nodes, tpl.scopes, tpl.cached):
            target = rename(n.target) if n.op in ("call_module", "get_attr") else n.target
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            new = self.graph.create_node(n.op, target, args, kwargs, None, n.type)
            self.node_name_to_scope[new.name] = (_join(path, scope_rel), scope_type)
            stack = n.meta.get("nn_module_stack")
            if stack is not None:
                inner = list(stack.items())[tpl.depth:]
                new.meta["nn_module_stack"] = type(stack)(
                    outer + [(rename(k), (rename(v[0]), v[1])) for k, v in inner])
            env[n] = new
            if cached:
                self._proxy_cache[target] = self.proxy(new)
        self.replayed += 1
        for rel, count in tpl.calls:
            self.num_calls[_join(path, rel)] = count
        leaves = [self.proxy(env[v]) if kind == "N" else v for kind, v in tpl.out_leaves]
        return tree_unflatten(leaves, tpl.out_spec)


def _module_state(m: nn.Module) -> tuple:
    """What of ``m`` and the modules below it a traced call can depend on (module docstring);
    ``_NoReplay`` where one has hooks."""
    hooks = torch.nn.modules.module
    for g in ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
              "_global_backward_hooks"):
        if getattr(hooks, g, None):
            raise _NoReplay
    items = []
    for rel, sub in m.named_modules(remove_duplicate=False):
        attrs = []
        for k, v in vars(sub).items():
            if k in _STATE_SKIP:
                continue
            if "hook" in k:
                if v:
                    raise _NoReplay
                continue
            attrs.append((k, _tensor(v) if isinstance(v, torch.Tensor) else _state_value(v)))
        items.append((rel, type(sub), tuple(attrs),
                      tuple((k, _tensor(p)) for k, p in sub._parameters.items()),
                      tuple((k, _tensor(b)) for k, b in sub._buffers.items()),
                      tuple(sub._modules)))
    return tuple(items)
