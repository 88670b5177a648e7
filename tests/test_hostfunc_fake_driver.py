"""The CUDA backend's driver call sequence, checked on a CPU machine against a fake libcuda.

tests/fake_libcuda/fake_cuda.c is compiled with gcc into a temporary ``libcuda.so.1``. Each test
runs a script in a fresh interpreter that loads that library first (so cuda-python's loader,
which looks for an already-loaded ``libcuda.so.1`` before searching, binds every ``cu*`` entry
point to the fake through its ``cuGetProcAddress_v2``), then drives the real
``cuda.bindings.driver`` through :class:`hostfunc.cuda_backend.CudaBackend`. The fake logs each
call with its arguments and whether the GIL was held; the test reads the log and the results.

What this cannot show (it needs a GPU, see test_hostfunc_gpu.py): that a real driver accepts the
capture-time calls, replays the host node, and runs the destructor on graph destruction.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

FAKE_SOURCE = Path(__file__).parent / "fake_libcuda" / "fake_cuda.c"
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found: cannot "
                                "build the fake libcuda")

PRELUDE = r'''
import ctypes, gc, json, os, sys, weakref
lib = ctypes.CDLL(os.environ["FAKE_LIBCUDA"], mode=os.RTLD_NOW | os.RTLD_GLOBAL)
lib.fake_log.restype = ctypes.c_char_p
lib.fake_begin_capture.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
lib.fake_replay.argtypes = [ctypes.c_size_t, ctypes.c_int]
lib.fake_destroy_graph.argtypes = [ctypes.c_size_t]
lib.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_int]
from cuda.bindings import driver
import hostfunc
from hostfunc.cuda_backend import CudaBackend
from hostfunc.trampoline import trampoline_addresses
STREAM, GRAPH = 0x5000, 0x777
backend = CudaBackend(driver=driver, current_stream=lambda: STREAM)

def done(**result):
    result["log"] = lib.fake_log().decode().splitlines()
    result["run_addr"], result["release_addr"] = trampoline_addresses()
    print("RESULT " + json.dumps(result))
'''


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fake_libcuda") / "libcuda.so.1"
    subprocess.run(["gcc", "-Wall", "-Wextra", "-Werror", "-O1", "-shared", "-fPIC",
                    "-Wl,-soname,libcuda.so.1", "-o", str(out), str(FAKE_SOURCE),
                    "-ldl", "-lpthread"], check=True, timeout=TIMEOUT_S)
    return out


def run_script(lib: Path, body: str) -> dict:
    """Run PRELUDE + body in a fresh interpreter; return what it passed to done()."""
    env = dict(os.environ, FAKE_LIBCUDA=str(lib))
    # A file, not -c, so that tracebacks of the script show its source lines.
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=lib.parent, delete=False) as f:
        f.write(PRELUDE + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, f.name], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"script failed:\n{proc.stdout}\n{proc.stderr}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"script printed no result:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def calls(log: list[str], name: str) -> list[dict[str, str]]:
    """The fake's log lines for entry point ``name``, as key=value dicts."""
    out = []
    for line in log:
        head, _, rest = line.partition(" ")
        if head == name:
            out.append(dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", rest)))
    return out


def names(log: list[str]) -> list[str]:
    return [line.split(" ", 1)[0] for line in log]


def test_eager_launch_uses_cuLaunchHostFunc_and_frees_entries(fake_libcuda: Path) -> None:
    """Pins: eager launches go through cuLaunchHostFunc with the GIL released, run in launch
    order, drain synchronizes the stream (blocking, and polling with a timeout), and each entry
    is released after it ran (live_entries back to 0)."""
    r = run_script(fake_libcuda, """
        order = []
        with hostfunc.use_backend(backend):
            for i in range(5):
                hostfunc.launch(order.append, i)
            capturing = hostfunc.is_capturing()
            hostfunc.drain()
            live = hostfunc.live_entries()
            hostfunc.launch(order.append, 5)
            hostfunc.drain(timeout=10)
            done(order=order, capturing=capturing, live=live, live2=hostfunc.live_entries())
    """)
    assert r["order"] == [0, 1, 2, 3, 4, 5]
    assert r["capturing"] is False
    assert r["live"] == 0 and r["live2"] == 0
    log = r["log"]
    assert len(calls(log, "cuInit")) == 1
    launches = calls(log, "cuLaunchHostFunc")
    assert len(launches) == 6
    assert all(c["gil"] == "0" for c in launches), "GIL held during cuLaunchHostFunc"
    assert all(c["stream"] == "0x5000" for c in launches)
    syncs = calls(log, "cuStreamSynchronize")
    assert len(syncs) == 1 and syncs[0]["gil"] == "0", "drain must release the GIL while waiting"
    assert not calls(log, "cuGraphAddHostNode")
    infos = calls(log, "cuStreamGetCaptureInfo_v3")
    assert len(infos) == 6 and all(c["status"] == "0" for c in infos)


def test_captured_launch_adds_host_node_owned_by_user_object(fake_libcuda: Path) -> None:
    """Pins the capture-time sequence: GetCaptureInfo -> UserObjectCreate(key, release
    trampoline, NO_DESTRUCTOR_SYNC) -> GraphRetainUserObject(MOVE) -> GraphAddHostNode(raw
    trampoline, userData=key, deps=current deps) -> UpdateCaptureDependencies(SET, [node]); that
    the next node depends on the previous one; that drain is a no-op while capturing; that every
    replay runs each recorded call with the arguments bound at capture; and that destroying the
    graph hands the keys back (entries released, the payload collected)."""
    r = run_script(fake_libcuda, """
        calls = []

        class Payload:
            pass

        class Decoder:
            @hostfunc.hostfunc
            def build(self, tag, payload):
                calls.append((tag, type(payload).__name__))

        payload = Payload()
        ref = weakref.ref(payload)
        dec = Decoder()
        with hostfunc.use_backend(backend):
            lib.fake_begin_capture(STREAM, GRAPH)
            capturing = hostfunc.is_capturing()
            dec.build("a", payload)
            hostfunc.launch(calls.append, ("b", "-"))
            hostfunc.drain()
            lib.fake_end_capture()
            del payload
            ran_during_capture = list(calls)
            live_captured = hostfunc.live_entries()
            lib.fake_replay(GRAPH, 3)
            live_replayed = hostfunc.live_entries()
            lib.fake_destroy_graph(GRAPH)
            live_destroyed = hostfunc.live_entries()
            gc.collect()
            done(capturing=capturing, ran_during_capture=ran_during_capture,
                 calls=[list(c) for c in calls], live_captured=live_captured,
                 live_replayed=live_replayed, live_destroyed=live_destroyed,
                 payload_dead=ref() is None)
    """)
    assert r["capturing"] is True
    assert r["ran_during_capture"] == []
    assert r["calls"] == [["a", "Payload"], ["b", "-"]] * 3
    assert (r["live_captured"], r["live_replayed"], r["live_destroyed"]) == (2, 2, 0)
    assert r["payload_dead"], "the graph's destruction did not free the captured arguments"

    log = r["log"]
    seq = [n for n in names(log) if n.startswith("cu") and n not in ("cuInit",
                                                                     "cuStreamIsCapturing")]
    one = ["cuStreamGetCaptureInfo_v3", "cuUserObjectCreate", "cuGraphRetainUserObject",
           "cuGraphAddHostNode", "cuStreamUpdateCaptureDependencies_v2"]
    assert seq == one + one, "capture-time call sequence changed (and drain must not sync)"
    assert not calls(log, "cuLaunchHostFunc") and not calls(log, "cuStreamSynchronize")

    objs, retains = calls(log, "cuUserObjectCreate"), calls(log, "cuGraphRetainUserObject")
    nodes, updates = calls(log, "cuGraphAddHostNode"), calls(log, "cuStreamUpdateCaptureDependencies_v2")
    for obj, retain, node, update in zip(objs, retains, nodes, updates):
        assert int(obj["destroy"], 16) == r["release_addr"]
        assert obj["flags"] == "1" and obj["refs"] == "1"           # NO_DESTRUCTOR_SYNC
        assert retain["obj"] == obj["obj"] and retain["graph"] == "0x777"
        assert retain["flags"] == "1" and retain["count"] == "1"    # CU_GRAPH_USER_OBJECT_MOVE
        assert int(node["fn"], 16) == r["run_addr"], "the raw trampoline must reach the driver"
        assert node["userData"] == obj["ptr"] != "0", "node and user object carry the same key"
        assert update["first"] == node["node"] and update["n"] == "1"
        assert update["flags"] == "1"                               # SET_CAPTURE_DEPENDENCIES
    assert objs[0]["ptr"] != objs[1]["ptr"]
    assert nodes[0]["deps"] == "[0x1f000]" and nodes[1]["deps"] == f"[{nodes[0]['node']}]"
    for c in objs + retains + nodes + updates:
        assert c["gil"] == "0", "a driver call was made with the GIL held"


def test_captured_callback_exception_reaches_drain(fake_libcuda: Path) -> None:
    """Pins: an exception raised by a captured callback during replay is kept (not printed by
    ctypes) and re-raised by the next drain as HostFuncError with the function's name, the
    original traceback text and the original exception as __cause__; later failures ride along;
    the next drain is clean."""
    r = run_script(fake_libcuda, """
        def explode(step):
            raise ValueError(f"bad step {step}")

        with hostfunc.use_backend(backend):
            lib.fake_begin_capture(STREAM, GRAPH)
            hostfunc.launch(explode, 7)
            lib.fake_end_capture()
            lib.fake_replay(GRAPH, 2)
            try:
                hostfunc.drain()
                err = None
            except hostfunc.HostFuncError as e:
                err = dict(fn=e.fn_name, tb=e.traceback, cause=type(e.__cause__).__name__,
                           msg=str(e.__cause__), later=len(e.later_errors))
            hostfunc.drain()
            lib.fake_destroy_graph(GRAPH)
            done(err=err, live=hostfunc.live_entries())
    """)
    err = r["err"]
    assert err is not None, "the callback's exception was dropped"
    assert err["fn"] == "explode" and err["cause"] == "ValueError"
    assert err["msg"] == "bad step 7" and err["later"] == 1
    assert 'raise ValueError(f"bad step {step}")' in err["tb"]
    assert r["live"] == 0


@pytest.mark.parametrize("failing, live_before_destroy", [
    ("cuLaunchHostFunc", 0),
    ("cuUserObjectCreate", 0),
    ("cuGraphRetainUserObject", 0),
    ("cuGraphAddHostNode", 1),
])
def test_driver_failure_raises_launch_error_without_leaking(
        fake_libcuda: Path, failing: str, live_before_destroy: int) -> None:
    """Pins: a failing driver call raises HostFuncLaunchError naming the call and the callback;
    the entry is released at once, or (once the graph owns it through the user object) with the
    graph — never leaked."""
    capture = failing != "cuLaunchHostFunc"
    r = run_script(fake_libcuda, f"""
        def step():
            pass

        with hostfunc.use_backend(backend):
            if {capture}:
                lib.fake_begin_capture(STREAM, GRAPH)
            lib.fake_fail({failing!r}.encode(), 999)
            try:
                hostfunc.launch(step)
                err = None
            except hostfunc.HostFuncLaunchError as e:
                err = dict(call=e.call, fn=e.fn_name, result=int(e.result))
            live_before = hostfunc.live_entries()
            lib.fake_end_capture()
            lib.fake_destroy_graph(GRAPH)
            done(err=err, live_before=live_before, live_after=hostfunc.live_entries())
    """)
    assert r["err"] == {"call": failing, "fn": "step", "result": 999}
    assert r["live_before"] == live_before_destroy
    assert r["live_after"] == 0
    if failing == "cuGraphRetainUserObject":
        assert calls(r["log"], "cuUserObjectRelease"), "the unowned user object was not released"
