"""Which module allocated: tag the CUDA allocator's history with module names.

A snapshot's stacks say which line allocated, not which module instance (``model.layers.17.attn``).
From PyTorch 2.10 on, every trace entry carries ``user_metadata``: the string last set by
``torch.cuda.memory._set_memory_metadata`` *on the allocating thread* (it is thread-local in the
allocator). :func:`tag_modules` sets it from module hooks, so that each allocation names the
innermost module whose forward or backward made it::

    from snapshot_lab.module_tags import tag_modules

    with tag_modules(model):        # or handle = tag_modules(model) ... handle.remove()
        train(model)

The metadata format (version 1), which the analysis parses with :func:`parse_tag`:

====================  =====================================================================
``''``                outside any tagged module (PyTorch's default)
``fwd:<fqn>``         in the forward of module ``<fqn>`` (the innermost tagged module)
``bwd:<fqn>``         in the backward of module ``<fqn>`` (on autograd's thread for CUDA)
``rec:<fqn>``         in a forward recomputed during the backward (activation checkpointing)
====================  =====================================================================

``<fqn>`` is the module's path as ``model.named_modules()`` and ``state_dict()`` spell it
(``transformer.h.3.attn``), relative to the model given, with ``prefix`` in front when one is
given; the model itself is ``''`` (so ``fwd:`` alone is the root module's own code). Without a
model (``tag_modules(None)``: every module of the process, for ``snaplab run``), each top-level
module is named after its class (``GPT2LMHeadModel.transformer.h.3.attn``; ``#2`` after the
class name for a second one).

How, and what it costs: a forward pre-hook sets ``fwd:<fqn>`` and a forward hook restores the
enclosing module's tag (a per-thread stack, so nesting, shared modules and exceptions unwind
correctly). The backward needs no extra autograd node: the forward hook registers one tensor
hook on the module's first output that requires grad ("the module's backward begins": set
``bwd:<fqn>``) and one on its first such input ("it has ended": back to the parent's tag). A
module that starts while a module inside it is already current keeps the inner one (the
last child's output is its parent's output: both hooks fire at once). A module that returns its
input (``nn.Identity``, an in-place activation) gets no backward tag: its backward counts towards
the enclosing module. A callback queued on the
autograd engine resets the tag to ``''`` when each backward ends. ``register_full_backward_hook``
is not used: it wraps every output in an extra autograd node, costs more, and breaks models that
modify a module's output in place (``ReLU(inplace=True)`` after a hooked module). All strings are
built once, when the hooks are installed; a hook call does a few attribute look-ups and one call
into the allocator. Under ``torch.compile`` the hooks do nothing (compiled regions count towards
the enclosing eager module).

torch is imported lazily, here only; ``parse_tag`` and the constants need no torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("snapshot_lab.module_tags")

TAG_FORMAT_VERSION = 1
NOT_A_MODULE = "tag_modules needs a torch.nn.Module (or None for every module), not {kind}"
PHASES: dict[str, str] = {
    "fwd": "forward",
    "bwd": "backward",
    "rec": "forward recomputed in the backward (activation checkpointing)",
}
OUTSIDE = ""  # the metadata outside any tagged module
NEEDS = "per-module attribution needs PyTorch >= 2.10 (torch.cuda.memory._set_memory_metadata)"


def format_tag(phase: str, fqn: str) -> str:
    """``format_tag('bwd', 'layers.3.attn') -> 'bwd:layers.3.attn'``."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
    return f"{phase}:{fqn}"


def parse_tag(metadata: object) -> tuple[str, str] | None:
    """``'fwd:layers.3.attn' -> ('fwd', 'layers.3.attn')``; ``'fwd:' -> ('fwd', '')`` (the root
    module); None for ``''`` (outside any module), for a missing value and for metadata that
    snaplab did not write (a program's own ``_set_memory_metadata`` strings)."""
    if not isinstance(metadata, str) or len(metadata) < 4 or metadata[3] != ":":
        return None
    phase = metadata[:3]
    return (phase, metadata[4:]) if phase in PHASES else None


def parent_fqn(fqn: str) -> str | None:
    """The enclosing module's path: ``'layers.3.attn' -> 'layers.3'``, ``'layers' -> ''``,
    ``'' -> None``. (Tags name the innermost *tagged* module: with ``max_depth`` some levels are
    missing, and the analysis may add a module's bytes to every prefix of its path.)"""
    if not fqn:
        return None
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


# --------------------------------------------------------------------------- the hooks


class _Mod:
    """One tagged module: its three tags, built once, and where it sits in the tree."""

    __slots__ = ("ancestors", "cls", "fqn", "in_hook", "out_hook", "parent", "tags")

    def __init__(self, fqn: str, cls: str, parent: _Mod | None) -> None:
        self.fqn = fqn
        self.cls = cls
        self.parent = parent
        self.ancestors: frozenset[_Mod] = frozenset()
        if parent is not None:
            self.ancestors = parent.ancestors | {parent}
        self.tags = (f"fwd:{fqn}", f"bwd:{fqn}", f"rec:{fqn}")
        self.out_hook: Callable[[Any], None] | None = None
        self.in_hook: Callable[[Any], None] | None = None


class _ThreadState(threading.local):
    """The allocator's metadata is per thread, so is what the hooks know about it."""

    def __init__(self) -> None:
        # the module whose tag is set on this thread
        self.mod: _Mod | None = None
        self.tag = OUTSIDE
        # forward nesting: (module, previous mod, previous tag, the hooked output before it entered)
        self.stack: list[tuple[_Mod, _Mod | None, str, _Hooked | None]] = []
        # the output whose node got the last begin-backward hook
        self.hooked: _Hooked | None = None


class _Hooked:
    """The last module output whose autograd node got a "backward begins" hook, held weakly (a
    module's output must not outlive its use because it is being tagged): later modules that take
    exactly this tensor as input (a chain: ``b(a(x))``), or return it (a parent whose last child
    made its output), need no hook of their own on that node (see ``leave``)."""

    __slots__ = ("mod", "ref", "version")

    def __init__(self, ref: Any, version: int, mod: _Mod) -> None:
        self.ref = ref
        # an in-place op after the hook moves the tensor to another node
        self.version = version
        self.mod = mod


_STATE = _ThreadState()
# modules tagged by an explicit tag_modules(model), and by which handle: a module is tagged once
# (a second tagger would unbalance the first one's stack), and the process-wide tagger leaves them
_EXPLICIT: weakref.WeakKeyDictionary[Any, ModuleTags] = weakref.WeakKeyDictionary()
# the active process-wide tagger (one at a time)
_PROCESS: list[ModuleTags] = []
_WARNED: set[str] = set()


class ModuleTags:
    """The handle :func:`tag_modules` returns: ``remove()`` (or leave the ``with`` block) takes
    the hooks away; ``enabled`` says whether tags are being written and ``reason`` why not;
    ``describe()`` is a JSON-able summary for a snapshot's sidecar."""

    def __init__(
        self,
        *,
        enabled: bool,
        reason: str | None = None,
        mode: str = "model",
        backward: bool = True,
    ) -> None:
        self.enabled = enabled
        self.reason = reason
        self.mode = mode  # 'model' or 'process'
        self.backward = backward
        self.active = enabled
        self._handles: list[Any] = []
        self._mods: dict[str, _Mod] = {}
        # weak references to the modules counted in _EXPLICIT
        self._explicit: list[Any] = []
        self._set: Callable[[str], Any] = _noop
        # the graph task whose end already has a reset queued
        self._queued_for = -2

    # -- public ---------------------------------------------------------------------------

    @property
    def modules(self) -> dict[str, str]:
        """Tagged modules so far: path -> class name (a process-wide tagger finds them as they
        run)."""
        return {fqn: module.cls for fqn, module in self._mods.items()}

    def describe(self) -> dict[str, Any]:
        """What a snapshot's sidecar should say about the tags (format version, mode, modules)."""
        return {
            "format": TAG_FORMAT_VERSION,
            "enabled": self.enabled,
            "reason": self.reason,
            "mode": self.mode,
            "backward": self.backward,
            "modules": self.modules,
        }

    def remove(self) -> None:
        """Take the hooks away (idempotent). Tags already written stay in the history."""
        if not self.active and not self._handles:
            return
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for ref in self._explicit:
            mod = ref()
            if mod is not None and _EXPLICIT.get(mod) is self:
                del _EXPLICIT[mod]
        self._explicit.clear()
        if self in _PROCESS:
            _PROCESS.remove(self)
        state = _STATE
        if not state.stack and state.tag:
            state.mod, state.tag = None, OUTSIDE
            self._set(OUTSIDE)

    def __enter__(self) -> ModuleTags:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "on" if self.active else ("off: " + self.reason if self.reason else "removed")
        return f"<ModuleTags {self.mode}, {len(self._mods)} modules, {state}>"


def _noop(_: str) -> None:
    return None


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("snaplab: modules are not tagged: %s", reason)


def _torch() -> Any:
    import torch

    return torch


def _metadata_setter(torch: Any) -> tuple[Callable[[str], Any] | None, str | None]:
    """The allocator's setter (the C function itself when there, to skip a Python frame), or why
    not."""
    mem = getattr(getattr(torch, "cuda", None), "memory", None)
    if mem is None or not hasattr(mem, "_set_memory_metadata"):
        return None, f"{NEEDS}; this is PyTorch {getattr(torch, '__version__', '?')}"
    try:
        if not torch.cuda.is_available():
            return None, "CUDA is not available: there is no GPU allocator to tag"
        # the setter indexes the device's allocator: it must exist first
        torch.cuda.init()
    except Exception as exc:  # a broken driver must not stop training
        return None, f"CUDA could not be initialised: {exc}"
    setter = getattr(torch._C, "_cuda_setMemoryMetadata", None) or mem._set_memory_metadata
    try:
        # an allocator backend without metadata (cudaMallocAsync) refuses here, not in a hook
        setter(OUTSIDE)
    except Exception as exc:
        return None, f"the CUDA allocator does not take metadata: {exc}"
    return setter, None


def tag_modules(
    model: Any = None,
    *,
    prefix: str = "",
    max_depth: int | None = None,
    backward: bool = True,
    set_metadata: Callable[[str], Any] | None = None,
) -> ModuleTags:
    """Tag CUDA allocations with the module that made them (see the module docstring for the
    format).

    ``model``: an ``nn.Module`` (its modules and itself get per-module hooks), or None for every
    module of the process (global hooks; for ``snaplab run``, which has no model at hand; a model
    tagged explicitly keeps its own names). ``prefix``: put in front of every path (the model
    itself is then ``prefix``). ``max_depth``: tag only modules at most this many levels below
    the model (0: the model alone); deeper ones count towards their tagged ancestor. ``backward``:
    also tag the backward pass. ``set_metadata``: where tags go (default: the CUDA allocator's
    ``_set_memory_metadata``; for tests and measurements).

    Never raises for a missing capability: on PyTorch < 2.10 or without CUDA it returns a handle
    with ``enabled=False`` and ``reason`` saying why, and logs that once.
    """
    if max_depth is not None and max_depth < 0:
        raise ValueError("max_depth must be at least 0")
    try:
        torch = _torch()
    except ImportError:
        return ModuleTags(
            enabled=False,
            reason="PyTorch is not installed",
            mode="model" if model else "process",
        )
    nn_module = getattr(getattr(torch, "nn", None), "Module", None)
    if model is not None and nn_module is not None and not isinstance(model, nn_module):
        raise TypeError(NOT_A_MODULE.format(kind=type(model).__name__))
    setter = set_metadata
    if setter is None:
        setter, reason = _metadata_setter(torch)
        if setter is None:
            _warn_once(str(reason))
            return ModuleTags(
                enabled=False,
                reason=reason,
                mode="process" if model is None else "model",
            )
    if model is None and _PROCESS:
        # nested recordings: the outer one already tags everything
        inner = ModuleTags(
            enabled=True,
            reason="already tagged by an enclosing tag_modules(None)",
            mode="process",
        )
        inner._mods = _PROCESS[0]._mods
        return inner
    handle = ModuleTags(
        enabled=True,
        mode="process" if model is None else "model",
        backward=backward,
    )
    handle._set = setter
    _Installer(torch, handle, setter, backward, max_depth).install(model, prefix)
    return handle


class _Installer:
    """Builds the hook functions. They are closures over locals (the cheapest look-ups Python
    has), one set per module for a model, one pair for the whole process."""

    def __init__(
        self,
        torch: Any,
        handle: ModuleTags,
        setter: Callable[[str], Any],
        backward: bool,
        max_depth: int | None,
    ):
        self.torch = torch
        self.handle = handle
        self.set = setter
        self.backward = backward
        self.max_depth = max_depth
        compiler = getattr(torch, "compiler", None)
        self.is_compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
        self.graph_task_id = getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)

    # -- the hooks ------------------------------------------------------------------------

    def make_hooks(self) -> tuple[Callable[..., None], Callable[..., None], Callable[[_Mod], None]]:
        """(enter(m), leave(m, args, kwargs, output), attach(m)): what every pre/post hook does."""
        return self._make_enter(), self._make_leave(), self._make_attach(self._make_queue_reset())

    def _make_enter(self) -> Callable[[_Mod], None]:
        """A module's forward begins: its tag (``rec:`` when recomputed inside a backward)."""
        state = _STATE
        set_tag = self.set
        graph_task_id = self.graph_task_id

        def enter(tagged: _Mod) -> None:
            tag = tagged.tags[0] if graph_task_id() == -1 else tagged.tags[2]
            state.stack.append((tagged, state.mod, state.tag, state.hooked))
            state.mod, state.tag = tagged, tag
            set_tag(tag)

        return enter

    def _make_leave(self) -> Callable[..., None]:
        """A module's forward is over: back to the enclosing module's tag, and the hooks that tag
        its backward."""
        state = _STATE
        set_tag = self.set
        grad_enabled = self.torch.is_grad_enabled
        backward = self.backward
        hook_backward = self._make_hook_backward()

        def leave(tagged: _Mod, args: Any, kwargs: Any, output: Any) -> None:
            stack = state.stack
            # the hooked output when the module entered
            before: _Hooked | None = None
            if stack and stack[-1][0] is tagged:
                _, state.mod, state.tag, before = stack.pop()
            else:
                # a pre-hook that did not run (hooks added mid-forward): start clean
                stack.clear()
                state.mod, state.tag = None, OUTSIDE
            set_tag(state.tag)
            if not stack:
                # the outermost forward is over: nothing to chain to
                state.hooked = None
            if backward and output is not None and grad_enabled():
                hook_backward(tagged, before, args, kwargs, output)

        return leave

    def _make_hook_backward(self) -> Callable[..., None]:
        """Hooks on the module's first output and input that require grad: where its backward
        begins and where it ends."""
        state = _STATE
        first_grad_tensor = self._make_first_grad_tensor()
        weakref_ref = weakref.ref

        def hook_backward(
            tagged: _Mod,
            before: _Hooked | None,
            args: Any,
            kwargs: Any,
            output: Any,
        ) -> None:
            first_output = first_grad_tensor(output)
            if first_output is None:
                return
            first_input = first_grad_tensor(args)
            if first_input is None and kwargs:
                first_input = first_grad_tensor(kwargs)
            if first_input is first_output:
                # identity modules: their backward is nothing
                return
            hooked = state.hooked
            try:
                # on the node that made the tensor: it runs once that tensor's gradient is
                # complete; cheaper than Tensor.register_hook; leaves have no node. Skipped where
                # a module inside this one made the same output (it begins there, this module's
                # hook would find it current and do nothing)
                if (
                    hooked is None
                    or hooked.ref() is not first_output
                    or hooked.version != first_output._version
                    or tagged not in hooked.mod.ancestors
                ):
                    _hook_gradient(first_output, tagged.out_hook)
                    if state.stack:
                        # else the outermost forward is over: nothing chains to it
                        version = first_output._version
                        state.hooked = _Hooked(weakref_ref(first_output), version, tagged)
                # "the backward has ended" is said by the hook of the module that made this one's
                # input when there is one (b(a(x)): a's backward begins where b's ends), so this
                # module needs its own only where its input came from elsewhere
                if first_input is not None and (
                    before is None
                    or before.ref() is not first_input
                    or before.version != first_input._version
                    or before.mod in tagged.ancestors
                ):
                    _hook_gradient(first_input, tagged.in_hook)
            except RuntimeError:
                # tensors that refuse hooks (inference mode...): no backward tag
                pass

        return hook_backward

    def _make_first_grad_tensor(self) -> Callable[[Any], Any]:
        tensor_type = self.torch.Tensor

        def first_grad_tensor(obj: Any) -> Any:
            """``obj`` or its first item that is a tensor requiring grad (None: none is)."""
            if isinstance(obj, tensor_type):
                return obj if obj.requires_grad else None
            if isinstance(obj, (tuple, list)):
                items: Any = obj
            elif isinstance(obj, dict):
                items = obj.values()
            else:
                return None
            for item in items:
                if isinstance(item, tensor_type) and item.requires_grad:
                    return item
            return None

        return first_grad_tensor

    def _make_queue_reset(self) -> Callable[[], None]:
        """Queue (once per backward) a callback that resets the tag when the backward ends."""
        state = _STATE
        set_tag = self.set
        handle = self.handle
        graph_task_id = self.graph_task_id
        variable = getattr(self.torch.autograd, "Variable", None)
        engine = getattr(variable, "_execution_engine", None)

        def reset_at_backward_end() -> None:
            # runs on the thread that finished the backward (autograd's device thread for CUDA)
            if not state.stack:
                state.mod, state.tag = None, OUTSIDE
                set_tag(OUTSIDE)

        def queue_reset() -> None:
            task_id = graph_task_id()
            if task_id != handle._queued_for and engine is not None:
                handle._queued_for = task_id
                with contextlib.suppress(Exception):
                    # not inside a backward after all
                    engine.queue_callback(reset_at_backward_end)

        return queue_reset

    def _make_attach(self, queue_reset: Callable[[], None]) -> Callable[[_Mod], None]:
        """Give a module its two gradient hooks (``out_hook``, ``in_hook``)."""
        state = _STATE
        set_tag = self.set
        handle = self.handle

        def attach(tagged: _Mod) -> None:
            def on_output_grad(grad: Any) -> None:
                # the gradient of the module's output is complete: its backward begins
                if not handle.active:
                    return None
                current = state.mod
                # else a module inside this one is already current
                if current is None or tagged not in current.ancestors:
                    tag = tagged.tags[1]
                    state.mod, state.tag = tagged, tag
                    set_tag(tag)
                queue_reset()
                return None

            def on_input_grad(grad: Any) -> None:
                # the gradient of the module's input is complete: its backward is over
                if not handle.active:
                    return None
                current = state.mod
                if current is tagged or (current is not None and tagged in current.ancestors):
                    parent = tagged.parent
                    tag = OUTSIDE if parent is None else parent.tags[1]
                    state.mod, state.tag = parent, tag
                    set_tag(tag)
                return None

            tagged.out_hook, tagged.in_hook = on_output_grad, on_input_grad

        return attach

    # -- installing -----------------------------------------------------------------------

    def install(self, model: Any, prefix: str) -> None:
        enter, leave, attach = self.make_hooks()
        if model is None:
            self._install_process(enter, leave, attach)
        else:
            self._install_model(model, prefix, enter, leave, attach)

    def _walk(
        self, root: Any, root_name: str, root_parent: _Mod | None, attach: Callable[[_Mod], None]
    ) -> list[tuple[Any, _Mod]]:
        out: list[tuple[Any, _Mod]] = []
        seen: set[int] = set()
        todo: list[tuple[Any, str, _Mod | None, int]] = [(root, root_name, root_parent, 0)]
        while todo:
            module, fqn, parent, depth = todo.pop()
            if id(module) in seen or (self.max_depth is not None and depth > self.max_depth):
                continue
            seen.add(id(module))
            tagged = _Mod(fqn, type(module).__name__, parent)
            attach(tagged)
            out.append((module, tagged))
            named = getattr(module, "_modules", {}).items()
            children = [(name, child) for name, child in named if child is not None]
            for name, child in reversed(children):
                todo.append((child, f"{fqn}.{name}" if fqn else name, tagged, depth + 1))
        return out

    def _install_model(self, model: Any, prefix: str, enter: Any, leave: Any, attach: Any) -> None:
        handle = self.handle
        is_compiling = self.is_compiling
        for module, tagged in self._walk(model, prefix, None, attach):
            if module in _EXPLICIT:
                # already tagged by another live handle: it keeps its names
                continue
            handle._mods.setdefault(tagged.fqn, tagged)

            def pre(module: Any, args: Any, tagged: _Mod = tagged) -> None:
                if handle.active and not is_compiling():
                    enter(tagged)
                return None

            def post(module: Any, args: Any, *rest: Any, tagged: _Mod = tagged) -> None:
                if handle.active and not is_compiling():
                    leave(tagged, args, rest[0] if len(rest) == 2 else None, rest[-1])
                return None

            handle._handles.append(module.register_forward_pre_hook(pre))
            handle._handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
            _EXPLICIT[module] = handle
            handle._explicit.append(weakref.ref(module))

    def _install_process(self, enter: Any, leave: Any, attach: Any) -> None:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        handle = self.handle
        is_compiling = self.is_compiling
        lookup = self._make_lookup(attach)

        def pre(module: Any, args: Any) -> None:
            if handle.active and not is_compiling():
                tagged = lookup(module)
                if tagged is not None:
                    enter(tagged)
            return None

        def post(module: Any, args: Any, *rest: Any) -> None:
            if handle.active and not is_compiling():
                tagged = lookup(module)
                if tagged is not None:
                    # on an exception torch calls global hooks without kwargs
                    leave(tagged, args, rest[0] if len(rest) == 2 else None, rest[-1])
            return None

        handle._handles.append(register_module_forward_pre_hook(pre))
        global_hook = register_module_forward_hook(post, with_kwargs=True, always_call=True)
        handle._handles.append(_GlobalHookHandle(global_hook))
        _PROCESS.append(handle)

    def _make_lookup(self, attach: Callable[[_Mod], None]) -> Callable[[Any], _Mod | None]:
        """A module's tag entry for the process-wide hooks, found the first time it runs."""
        handle = self.handle
        known: weakref.WeakKeyDictionary[Any, _Mod | None] = weakref.WeakKeyDictionary()
        roots: dict[str, int] = {}
        walk = self._walk

        def discover(module: Any) -> _Mod | None:
            current = _STATE.mod
            class_name = type(module).__name__
            # called inside a tagged module but not one of its children
            if current is not None and _STATE.stack:
                tagged = _Mod(f"{current.fqn}.{class_name}", class_name, current)
                attach(tagged)
                known[module] = tagged
                handle._mods.setdefault(tagged.fqn, tagged)
                return tagged
            count = roots.get(class_name, 0) + 1
            roots[class_name] = count
            root_name = class_name if count == 1 else f"{class_name}#{count}"
            for found, tagged in walk(module, root_name, None, attach):
                old = known.get(found)
                # new, or a former root now found inside this one
                if old is None or old.parent is None:
                    known[found] = tagged
                    handle._mods.setdefault(tagged.fqn, tagged)
            if module not in known:  # deeper than max_depth
                known[module] = None
            return known[module]

        def lookup(module: Any) -> _Mod | None:
            if module in _EXPLICIT:
                return None
            try:
                return known[module]
            except KeyError:
                return discover(module)
            except TypeError:  # an unhashable module
                return None

        return lookup


def _hook_gradient(tensor: Any, hook: Any) -> None:
    """Call ``hook`` once ``tensor``'s gradient is complete: a pre-hook on the node that made it
    (cheaper than Tensor.register_hook), a tensor hook on a leaf (which has no node)."""
    node = tensor.grad_fn
    if node is not None:
        node.register_prehook(hook)
    else:
        tensor.register_hook(hook)


class _GlobalHookHandle:
    """torch's handle of a global forward hook forgets its ``with_kwargs`` entry (2.13 too), which
    leaves torch.compile warning about global hooks that are gone: remove that entry as well."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def remove(self) -> None:
        from torch.nn.modules import module

        self.handle.remove()
        getattr(module, "_global_forward_hooks_with_kwargs", {}).pop(self.handle.id, None)


__all__ = [
    "NEEDS",
    "OUTSIDE",
    "PHASES",
    "TAG_FORMAT_VERSION",
    "ModuleTags",
    "format_tag",
    "parent_fqn",
    "parse_tag",
    "tag_modules",
]
