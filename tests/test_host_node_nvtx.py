"""The native host node's NVTX range, seen by an NVTX tool: a small injection library (the
protocol nsys and CUPTI use: NVTX_INJECTION64_PATH, InitializeInjectionNvtx2) records every range
pushed, and a replayed step on the native node shows ``CapturableGuidedDecoder.host_node`` in
the ``capgraph`` domain on the node's thread, beside the Python stages' ranges. Skipped where
NVTX's headers or a C compiler are missing (the library is then built without the range)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capgraph.build.library import nvtx_include

INJECTION = textwrap.dedent(r"""
    #include <nvtx3/nvToolsExt.h>
    #include <pthread.h>
    #include <stdio.h>
    #include <stdlib.h>
    #include <string.h>
    #include <sys/syscall.h>
    #include <unistd.h>

    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

    static void record(const char *domain, const char *name) {
        const char *path = getenv("NVTX_TEST_LOG");
        if (!path) return;
        pthread_mutex_lock(&mu);
        FILE *f = fopen(path, "a");
        if (f) {
            fprintf(f, "%ld\t%s\t%s\n", (long)syscall(SYS_gettid), domain ? domain : "",
                    name ? name : "");
            fclose(f);
        }
        pthread_mutex_unlock(&mu);
    }

    /* handles are the names themselves (copied) */
    static nvtxDomainHandle_t create_domain(const char *name) {
        return (nvtxDomainHandle_t)strdup(name);
    }
    static nvtxStringHandle_t register_string(nvtxDomainHandle_t d, const char *s) {
        (void)d;
        return (nvtxStringHandle_t)strdup(s);
    }
    static int push_ex(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
        const char *name = "";
        if (a->messageType == NVTX_MESSAGE_TYPE_ASCII) name = a->message.ascii;
        if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED)
            name = (const char *)a->message.registered;
        record((const char *)d, name);
        return 0;
    }
    static int pop(nvtxDomainHandle_t d) { (void)d; return 0; }

    int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
        const NvtxExportTableCallbacks *cb =
            (const NvtxExportTableCallbacks *)get(NVTX_ETID_CALLBACKS);
        NvtxFunctionTable table = 0;
        unsigned int size = 0;
        if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size)) return 0;
        *table[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)create_domain;
        *table[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)register_string;
        *table[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)push_ex;
        *table[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)pop;
        return 1;
    }
""")

SCRIPT = textwrap.dedent("""
    import json, sys, threading, torch
    sys.path.insert(0, {tests!r})
    import hostfunc
    from cases import CASES
    from capgraph import GuidedDecodingConfig, GuideType
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.requests import GuidedRequest
    from capgraph.tokenizers import encode_continuation, load_tokenizer
    tok = load_tokenizer("tekken")
    config = GuidedDecodingConfig.from_tokenizer(tok)
    case = [c for c in CASES if c.params.guide_type == GuideType.JSON_SCHEMA][0]
    text = encode_continuation(tok, case.valid)
    d = CapturableGuidedDecoder(config, 1, 0, host_node="native")
    logits = torch.zeros(1, config.vocab_size_padded)
    d.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        d.execute(logits)
    d.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph.replay()
    hostfunc.drain()
    for token in text[:3]:
        d.add_batch([GuidedRequest.generation(1, 0, case.params, token)])
        graph.replay()
        hostfunc.drain()
        assert d.take_failed_requests() == []
    stats = d.host_node_stats
    import os
    print(json.dumps({{"runs": stats.runs, "python_runs": stats.python_runs,
                      "main_tid": threading.get_native_id()}}))
    graph.reset()
    d.close()
""")


def test_native_node_run_is_an_nvtx_range_in_the_capgraph_domain(tmp_path: Path) -> None:
    """An NVTX tool attached to the process sees one ``CapturableGuidedDecoder.host_node``
    range in the ``capgraph`` domain per run of the native node, on a thread other than the
    main one (the stream's), and the Python stages' ranges (``add_batch``) in the same domain
    on the main thread."""
    include = nvtx_include()
    if include is None:
        pytest.skip("NVTX v3's headers are not found here (CUDA toolkit or the nvidia-nvtx "
                    "wheel): the host library is built without the node's range")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the test's NVTX injection library")
    source = tmp_path / "inject.c"
    source.write_text(INJECTION)
    lib = tmp_path / "libinject.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-I{include}", str(source), "-o", str(lib),
                    "-lpthread"], check=True, capture_output=True)
    log = tmp_path / "ranges.tsv"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(lib), NVTX_TEST_LOG=str(log))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ranges = [line.split("\t") for line in log.read_text().splitlines()]
    node = [(int(tid), domain) for tid, domain, name in ranges
            if name == "CapturableGuidedDecoder.host_node"]
    assert len(node) == result["runs"] == 4 and result["python_runs"] == 0
    assert all(domain == "capgraph" for _, domain in node)
    assert all(tid != result["main_tid"] for tid, _ in node)  # the stream's C thread
    python_stages = {name for tid, domain, name in ranges
                     if domain == "capgraph" and int(tid) == result["main_tid"]}
    assert "CapturableGuidedDecoder.add_batch" in python_stages, python_stages
