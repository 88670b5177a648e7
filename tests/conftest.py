"""Shared fixtures: real bundled tokenizers and grammar factories, built once per session."""

from __future__ import annotations

import dataclasses
import os

import pytest

# Tests count compiles: no test reads grammars that an earlier run left on disk (the disk
# cache's own tests turn it on, in a temporary folder).
os.environ.setdefault("CAPGRAPH_COMPILE_DISK_CACHE_BYTES", "0")

from capgraph import GuidedDecodingConfig
from capgraph.grammar import create_matcher_factory

TOKENIZERS = ["tekken", "mistral-sp32k"]


@pytest.fixture(scope="session")
def tokenizer_cache():
    """Loaded tokenizers by name (conversion happens once, then comes from the disk cache)."""
    from capgraph.tokenizers import load_tokenizer
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_tokenizer(name)
        return loaded[name]
    return get


@pytest.fixture(scope="session")
def tekken(tokenizer_cache):
    return tokenizer_cache("tekken")


@pytest.fixture(scope="session")
def factory_cache(tokenizer_cache):
    """xgrammar/llguidance factories by (tokenizer, backend, padding), built once."""
    built = {}

    def get(tok_name: str, backend: str = "xgrammar", pad: int = 0):
        key = (tok_name, backend, pad)
        if key not in built:
            tok = tokenizer_cache(tok_name)
            config = GuidedDecodingConfig.from_tokenizer(
                tok, backend=backend, vocab_size_padded=len(tok) + pad)
            built[key] = create_matcher_factory(config)
        return built[key]
    return get


@pytest.fixture(scope="module")
def xg(factory_cache):
    """The xgrammar factory over Tekken (refuses unenforced keywords: the default)."""
    return factory_cache("tekken")


@pytest.fixture(scope="module")
def xg_ignore(xg):
    """The same, with json_unenforced_keywords="ignore"."""
    return create_matcher_factory(dataclasses.replace(xg.config,
                                                      json_unenforced_keywords="ignore"))


@pytest.fixture(scope="session")
def native_ok(factory_cache):
    """Skip where the capturable decoder's native host node cannot run here (no C++ library
    or no C compiler)."""
    from capgraph import ConfigError
    from capgraph.capturable import CapturableGuidedDecoder
    factory = factory_cache("tekken")
    try:
        d = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="native")
    except ConfigError as e:
        pytest.skip(f"the native host node is not available here: {e}")
    d.close()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module, restored afterwards: on 2 cores torch's OpenMP
    threads contend with xgrammar's fill threads (and with other processes), and the tiny
    matmuls of these tests gain nothing from a second thread. Results are the same."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bits(t):
    """Integer view of a float tensor, so that NaNs compare equal to themselves and -0.0
    differs from 0.0."""
    import torch
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def random_d2t(g, draft_vocab: int, target_vocab: int, device=None):
    """Full d2t table: draft id i -> a distinct random (non-monotone) target id, as offsets, on
    ``device`` (by default the generator's own: torch draws only on the generator's device)."""
    import torch
    device = g.device if device is None else device
    targets = torch.randperm(target_vocab, generator=g, device=device)[:draft_vocab]
    return (targets - torch.arange(draft_vocab, device=device)).to(torch.int32)


def bits_of(row, vocab_size: int):
    """The allowed-token set of one int32 bitmask row (bit j of word w is token 32*w + j)."""
    import torch
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((row.unsqueeze(-1) >> shifts) & 1).flatten()[:vocab_size]
    return bits.bool()


@pytest.fixture(autouse=True)
def no_callback_error_left_behind():
    """A host callback error is process-wide until a drain reports it: one left behind by a
    test would fail whichever test drains next. Report it against the test that left it."""
    import hostfunc
    from hostfunc import HostFuncError
    yield
    try:
        hostfunc.check_errors()
    except HostFuncError as exc:
        pytest.fail(f"a host callback raised during this test and nothing reported it: {exc}")


def assert_steps_agree(decoders, step, draft_len: int) -> tuple:
    """Run one step on each decoder (add_batch, rollback of rejected drafts, execute on zero
    logits) and assert that all leave the same failures, token mask, masked bitmask rows,
    counters, draft termination, dropped and terminated matchers (the differential tests of
    the build paths). Returns the first decoder's (sorted failures, token mask list, ...)."""
    import torch

    outcomes = []
    for dec in decoders:
        dec.add_batch(step, runtime_draft_len=draft_len)
        dec.rollback_rejected_tokens()
        rows = dec.requests.num_bitmask_tokens
        failed = dec.execute(torch.zeros(rows, dec.vocab_size_padded))
        tm = dec.token_mask_host[:rows].clone()
        outcomes.append((sorted(failed), tm.tolist(), dec.bitmask_host[:rows][tm.bool()].clone(),
                         list(dec.num_advanced_tokens), list(dec.num_guided_tokens),
                         list(dec.is_draft_terminated),
                         [m is None for m in dec.grammar_matchers],
                         [m is not None and m.is_terminated() for m in dec.grammar_matchers]))
    first = outcomes[0]
    for other in outcomes[1:]:
        assert first[:2] == other[:2] and first[3:] == other[3:]
        assert torch.equal(first[2], other[2])
    return first


def threads_named(name: str) -> set[str]:
    """Ids of this process's running threads whose name is ``name`` (Linux /proc; empty
    elsewhere). A thread that is exiting is not counted: the kernel marks it ``PF_EXITING``
    before it wakes the thread's ``join``, yet /proc lists it until the kernel reaps it a
    moment later, so a thread that ``join`` has just ended could otherwise still be seen."""
    import os

    pf_exiting = 0x4  # linux/sched.h
    found = set()
    if os.path.isdir("/proc/self/task"):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if f.read().strip() != name:
                        continue
                with open(f"/proc/self/task/{tid}/stat") as f:
                    # after the name's closing parenthesis: state ppid pgrp session tty_nr
                    # tpgid flags ...
                    flags = int(f.read().rsplit(")", 1)[1].split()[6])
            except (OSError, IndexError, ValueError):  # the thread ended meanwhile
                continue
            if not flags & pf_exiting:
                found.add(tid)
    return found


def build_threads() -> set[str]:
    """Ids of this process's threads named as the C++ build's thread, ``capgraph-build``."""
    return threads_named("capgraph-build")


def request_type_whose_field_raises(field: str, message: str) -> type:
    """A GuidedRequest subclass (an engine's request type) whose ``field`` raises
    ``RuntimeError(message)`` when read; setting it does nothing."""
    from capgraph.requests import GuidedRequest

    def read(self):
        raise RuntimeError(message)
    return type(f"Raising_{field}", (GuidedRequest,),
                {"__slots__": (), field: property(read, lambda self, value: None)})


def load_tool(name: str):
    """The module ``tools/<name>.py`` (tools are scripts, not a package), loaded once."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


class AimedMethods:
    """The matcher methods a native host build's C++ loop calls
    (``capgraph.build.make_native_build(methods=...)``): xgrammar's own FFI methods, except
    that the calls on one matcher, the one :meth:`aim` names once it exists, go to the test's
    replacements (tvm-ffi carries what they raise through C++ back to the build).

    Args:
        accept: ``(original, handle, token, debug) -> bool`` for the aimed matcher, or None.
        fill: ``(original, handle, bitmask, index, debug)`` for the aimed matcher, or None.

    Pass :meth:`host_build` as ``GuidedDecoder(host_build=...)``; until :meth:`aim` is called
    every call goes to xgrammar's methods.
    """

    def __init__(self, accept=None, fill=None) -> None:
        self._accept, self._fill = accept, fill
        self.target = 0  # ffi_address of the aimed matcher; 0: none
        self._matcher = None  # held, so that no later matcher can reuse the aimed address

    def aim(self, matcher) -> None:
        """Route the calls on ``matcher`` (an ``XGrammarMatcher``) to the replacements."""
        self.target, self._matcher = matcher.ffi_address, matcher
        assert self.target, "this xgrammar exposes no FFI matcher address"

    def methods(self, factory) -> tuple:
        """``(accept_token, fill_next_token_bitmask, is_terminated)`` for ``factory``'s
        xgrammar matchers."""
        from capgraph.build import library as native
        from capgraph.build.native import xgrammar_factory

        accept, fill, is_terminated = native.matcher_methods(
            xgrammar_factory(factory).ffi_matcher_type())
        accept_replacement, fill_replacement = self._accept, self._fill

        def accept_aimed(handle, token, debug):
            if handle.__chandle__() == self.target:
                return accept_replacement(accept, handle, token, debug)
            return accept(handle, token, debug)

        def fill_aimed(handle, bitmask, index, debug):
            if handle.__chandle__() == self.target:
                return fill_replacement(fill, handle, bitmask, index, debug)
            return fill(handle, bitmask, index, debug)

        return (accept if accept_replacement is None else accept_aimed,
                fill if fill_replacement is None else fill_aimed, is_terminated)

    def host_build(self, entry: bool = True):
        """A ``host_build`` callable: the native strategy (with its CPython entry where
        ``entry``, else the native loop) whose C++ loop calls these methods."""
        from capgraph.build import make_native_build

        def make(slots, factory, budget_ms):
            return make_native_build(slots, factory, budget_ms, entry=entry,
                                     methods=self.methods(factory))
        return make


def spend_cpu(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (a host-step budget counts a request's CPU
    time: a sleep would not go over it)."""
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def settled_live_entries() -> int:
    """hostfunc's live entries once the garbage of earlier tests is collected (graphs in
    reference cycles hold theirs until then): a baseline for a leak check that does not
    depend on which tests ran before."""
    import gc

    import hostfunc
    gc.collect()
    return hostfunc.live_entries()


@pytest.fixture
def cpu_stand_in_without_leaks():
    """Run the test on hostfunc's CPU stand-in (even on a GPU machine) and check that it leaves
    no hostfunc registry entries behind (after a drain and a collection)."""
    import gc

    import hostfunc
    with hostfunc.use_backend("cpu"):
        baseline = settled_live_entries()
        yield
        hostfunc.drain(10.0)
        gc.collect()
        assert hostfunc.live_entries() == baseline, "a test leaked hostfunc entries"
