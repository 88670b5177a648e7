// capgraph host build, CPython entry: the extension module capgraph_host_build, the host
// build's steady state without Python in the loop.
//
// Compiled only with CAPGRAPH_WITH_PYTHON (where Python's headers are installed; the file is
// empty otherwise) into the same library as builder.cc, which is then also a CPython
// extension module: fast_step() reads a whole steady-state batch of request objects through
// their type's attribute descriptors and runs the Builder's loop with the GIL released, so a
// plain decode step makes one call from Python; fast_begin()/fast_end() split the same step around a thread of the library's own, which
// never takes the GIL (a forked child starts its own). Compiled and loaded by
// capgraph/jit.py for capgraph/build/library.py, never at import.

#ifdef CAPGRAPH_WITH_PYTHON
#define PY_SSIZE_T_CLEAN
#include <Python.h>  // first, as Python's documentation asks
#include <pthread.h>  // pthread_setname_np
#include <sys/resource.h>  // setpriority: fast_begin's thread yields to the caller's
#include <sys/syscall.h>
#include <unistd.h>  // getpid: a forked child starts its own build thread

#include "host_build.h"

#ifdef CAPGRAPH_WITH_NVTX
#include <nvtx3/nvToolsExt.h>  // header-only NVTX v3 (capgraph/build/library.py finds it)
#endif

#include <tvm/ffi/error.h>
#include <tvm/ffi/object.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// What Python passes is explicit data, never the layout of its objects:
//   requests: the step's request objects, whose fields are read by name -- the names Python
//     hands make_fast (capgraph/requests.py, NATIVE_RECORD_FIELDS), in RecordField's order
//     (host_build.h, which fixes only their positions). For an exact instance of the request
//     type, a field the type serves through a data descriptor (a __slots__ member or a
//     property) is read by calling that descriptor, looked up once in make_fast; any other
//     object (a subclass, a look-alike) is read with PyObject_GetAttr. Reading a field may run
//     Python code; a read that raises declines the batch (or stops admission) and clears it;
//   handles: one entry per slot, kept by Python in step with the slot's matcher: None (no
//     matcher), an int (the address of the matcher's xgrammar FFI object, which the Builder's
//     methods run), anything else (a matcher only Python can run).
//
// make_fast(address, keep, handles, draft_terminated, advanced, guided, request_type,
//           field_names, num_slots, vocab_size, max_num_draft_tokens) -> state
//   binds a Builder (make_builder's address; `keep` is its step Function, held so the Builder
//   outlives the state) to a decoder's per-slot lists, which the decoder mutates in place;
//   field_names: a tuple of kRecordFields str, the request fields in RecordField's order
//   (TypeError otherwise).
// fast_admit(state, requests, slot_guides, slot_owners) -> int
//   how many leading requests pass the decoder's inline admission test (see FastAdmit).
// fast_step(state, requests, offsets, draft_len, clear_rows) -> None | (masked, unusual)
//   None: some guided request is not the plain case (a target request generating with a
//   valid unseen slot, exact-int new token in the vocabulary, exact-int drafts within bounds,
//   every field read without raising; its slot's handle None or an address), and nothing was
//   touched: the native loop (NativeLoopBuild) runs. Else the step ran as the native loop would run it,
//   counters written; masked: some row was guided; unusual: None, or [(batch index, status,
//   fault message, over-budget milliseconds as text, or None)] for every request whose status
//   is not plainly OK, in request order. A slot whose drafting loop stopped guiding it, or
//   whose matcher has terminated (the Builder's is_terminated asks it), is skipped.
namespace {

using capgraph::Builder;
using capgraph::Drafts;
using capgraph::GuardRef;
using capgraph::Utf8Guard;
using capgraph::kDeadEnd;
using capgraph::kFault;
using capgraph::kOk;
using capgraph::kOverBudget;
using capgraph::kRejected;
using capgraph::kTerminated;
using capgraph::NowNs;
using capgraph::kRecordFields;
using capgraph::RecordField;
using tvm::ffi::ObjectRef;

constexpr const char* kThreadName = "capgraph-build";  // as profilers and /proc show it

// fast_begin's thread and the handshake with it (one job at a time).
struct Runner {
  std::mutex mu;
  std::condition_variable cv;
  bool queued = false, done = true, stop = false;
  std::thread thread;
  pid_t pid = 0;  // a forked child has no such thread: it starts its own
};

struct FastEntry {
  ObjectRef matcher;
  int64_t slot, token, offset, first_draft, num_drafts, index;
};

struct FastState {
  Builder* builder = nullptr;
  PyObject* keep = nullptr;
  PyObject* handles = nullptr;
  PyObject* draft_terminated = nullptr;
  PyObject* advanced = nullptr;
  PyObject* guided = nullptr;
  // the request fields, by RecordField: each one's name (an interned str) and, where the
  // request type serves it through a data descriptor, that descriptor and its type's
  // tp_descr_get (else nullptr)
  PyObject* request_type = nullptr;
  PyObject* names[kRecordFields] = {};
  PyObject* descriptors[kRecordFields] = {};
  descrgetfunc getters[kRecordFields] = {};
  int64_t num_slots = 0, vocab_size = 0, max_drafts = 0;
  std::vector<FastEntry> entries;
  std::vector<int64_t> drafts;
  std::vector<int64_t> seen_slots;
  std::vector<uint8_t> seen;
  std::vector<int32_t> out;
  // the step between Begin and Finish
  int64_t job_draft_len = 0, job_rows = 0;
  int32_t* job_mask = nullptr;
  bool in_flight = false;  // fast_begin took a step that fast_end has not ended
  bool collecting = false;  // Begin is reading a batch (a field's Python code may call back)
  Runner* runner = nullptr;  // the build thread, started by the first fast_begin
};

constexpr const char* kCapsule = "capgraph_host_build.FastState";

// End the state's build thread, if it has one (a job in flight runs to its end first).
void StopRunner(FastState* st) {
  Runner* r = st->runner;
  st->runner = nullptr;
  if (r == nullptr || r->pid != getpid()) return;  // (a forked child: the parent's, leaked)
  {
    std::lock_guard<std::mutex> lock(r->mu);
    r->stop = true;
  }
  r->cv.notify_all();
  if (st->in_flight) {  // a job may still call a matcher method that takes the GIL
    Py_BEGIN_ALLOW_THREADS
    r->thread.join();
    Py_END_ALLOW_THREADS
  } else {
    r->thread.join();
  }
  delete r;
}

// End the state's thread, drop its references and delete it.
void FreeState(FastState* st) {
  StopRunner(st);
  Py_XDECREF(st->keep);
  Py_XDECREF(st->handles);
  Py_XDECREF(st->draft_terminated);
  Py_XDECREF(st->advanced);
  Py_XDECREF(st->guided);
  Py_XDECREF(st->request_type);
  for (int k = 0; k < kRecordFields; ++k) {
    Py_XDECREF(st->names[k]);
    Py_XDECREF(st->descriptors[k]);
  }
  delete st;
}

void DestroyState(PyObject* capsule) {
  auto* st = static_cast<FastState*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (st != nullptr) FreeState(st);
}

// One request's fields, read while it is held. An exact instance of the request type is read
// through the descriptors make_fast kept; anything else (a subclass, a look-alike) through
// PyObject_GetAttr. Either may run Python code.
class RequestFields {
 public:
  RequestFields(const FastState* st, PyObject* request)
      : st_(st), request_(request),
        exact_(reinterpret_cast<PyObject*>(Py_TYPE(request)) == st->request_type) {
    Py_INCREF(request);
  }
  RequestFields(const RequestFields&) = delete;
  RequestFields& operator=(const RequestFields&) = delete;
  ~RequestFields() { Py_DECREF(request_); }

  // A new reference to field `k`'s value, or nullptr (the read raised: the error is cleared).
  PyObject* Read(RecordField k) const {
    const descrgetfunc get = exact_ ? st_->getters[k] : nullptr;
    PyObject* v = get != nullptr ? get(st_->descriptors[k], request_, st_->request_type)
                                 : PyObject_GetAttr(request_, st_->names[k]);
    if (v == nullptr) PyErr_Clear();
    return v;
  }

  // As Read; where the read raised, *absent says whether it was an AttributeError (the
  // object has no such field) rather than another error.
  PyObject* Read(RecordField k, bool* absent) const {
    const descrgetfunc get = exact_ ? st_->getters[k] : nullptr;
    PyObject* v = get != nullptr ? get(st_->descriptors[k], request_, st_->request_type)
                                 : PyObject_GetAttr(request_, st_->names[k]);
    *absent = v == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError);
    if (v == nullptr) PyErr_Clear();
    return v;
  }

 private:
  const FastState* st_;
  PyObject* request_;
  bool exact_;
};

// An owned reference, dropped at the end of its scope.
class Ref {
 public:
  explicit Ref(PyObject* o = nullptr) : o_(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref& operator=(Ref&& other) noexcept {
    if (this != &other) {
      Py_XDECREF(o_);
      o_ = other.o_;
      other.o_ = nullptr;
    }
    return *this;
  }
  ~Ref() { Py_XDECREF(o_); }
  PyObject* get() const { return o_; }
  PyObject* release() {  // the reference, no longer dropped here
    PyObject* o = o_;
    o_ = nullptr;
    return o;
  }
  explicit operator bool() const { return o_ != nullptr; }

 private:
  PyObject* o_;
};

// An exact int in [0, bound), or -1 (nullptr, not an exact int, or out of range); never
// leaves an exception set.
int64_t IndexValue(PyObject* v, int64_t bound) {
  if (v == nullptr || !PyLong_CheckExact(v)) return -1;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (PyErr_Occurred()) PyErr_Clear();
  return !overflow && x >= 0 && x < bound ? static_cast<int64_t>(x) : -1;
}

// 1 for True, 0 for False, -1 for anything else, nullptr included (the plain case has exact
// bools).
int BoolValue(PyObject* v) { return v == Py_True ? 1 : v == Py_False ? 0 : -1; }

// Whether `request` carries a chain of drafts: draft_parents None, or no such attribute (an
// object without the tree fields). A draft tree is built by the Python build.
bool ChainRequest(const RequestFields& request) {
  // (no such field: a chain, as Python's getattr(req, "draft_parents", None); a read that
  // raised otherwise is not the plain case: Python's checks name it)
  bool absent = false;
  Ref parents(request.Read(RecordField::kDraftParents, &absent));
  return parents ? parents.get() == Py_None : absent;
}

// Read the batch into st->entries; false where some guided request is not the plain case.
// A request's fields are read first (the reads may run Python code, which may change any list
// here: each request is held while it is read, each list's size is re-read before an item is
// taken); then its slot's entries, which run no Python code; the only call out after that is
// the Builder's is_terminated.
bool Collect(FastState* st, PyObject* requests, PyObject* offsets, int64_t draft_len) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(requests); ++i) {
    const RequestFields request(st, PyList_GET_ITEM(requests, i));
    Ref params(request.Read(RecordField::kParams));
    if (!params) return false;
    if (params.get() == Py_None) continue;
    {
      Ref generating(request.Read(RecordField::kGenerating));
      if (BoolValue(generating.get()) != 1) return false;
    }
    {
      Ref is_draft(request.Read(RecordField::kIsDraft));
      if (BoolValue(is_draft.get()) != 0) return false;
    }
    {
      Ref context(request.Read(RecordField::kContext));
      if (BoolValue(context.get()) != 0) return false;
    }
    int64_t slot, token;
    {
      Ref value(request.Read(RecordField::kSlot));
      slot = IndexValue(value.get(), st->num_slots);
    }
    if (slot < 0) return false;
    {
      Ref value(request.Read(RecordField::kToken));
      token = IndexValue(value.get(), st->vocab_size);
    }
    if (token < 0) return false;
    if (!ChainRequest(request)) return false;
    Ref drafts(request.Read(RecordField::kDrafts));
    if (!drafts) return false;
    // no Python code runs from here to is_terminated
    if (st->seen[slot] || i >= PyList_GET_SIZE(offsets) ||
        slot >= PyList_GET_SIZE(st->handles) || slot >= PyList_GET_SIZE(st->draft_terminated)) {
      return false;
    }
    const long long offset = PyLong_AsLongLong(PyList_GET_ITEM(offsets, i));
    if (offset == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    // drafts: as the Python build's draft check, the plain case only
    const int64_t first_draft = static_cast<int64_t>(st->drafts.size());
    int64_t nd = 0;
    if (drafts.get() != Py_None) {
      PyObject* list = drafts.get();
      if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) > st->max_drafts) return false;
      nd = std::min<int64_t>(PyList_GET_SIZE(list), draft_len);
      for (int64_t j = 0; j < nd; ++j) {
        const int64_t x = IndexValue(PyList_GET_ITEM(list, j), st->vocab_size);
        if (x < 0) return false;
        st->drafts.push_back(x);
      }
    }
    st->seen[slot] = 1;
    st->seen_slots.push_back(slot);
    // skipped, not failed: no matcher, a draft loop that stopped guiding, a terminated matcher
    PyObject* handle = PyList_GET_ITEM(st->handles, slot);
    if (handle == Py_None) continue;
    if (!PyLong_CheckExact(handle)) return false;  // a matcher only Python can run
    const int stopped = BoolValue(PyList_GET_ITEM(st->draft_terminated, slot));
    if (stopped < 0) return false;
    if (stopped) continue;
    void* address = PyLong_AsVoidPtr(handle);
    if (address == nullptr) {
      if (PyErr_Occurred()) PyErr_Clear();
      return false;
    }
    // a counted reference: the GIL is released while the loop runs
    ObjectRef ref = tvm::ffi::detail::ObjectUnsafe::ObjectRefFromObjectPtr<ObjectRef>(
        tvm::ffi::detail::ObjectUnsafe::ObjectPtrFromUnowned<tvm::ffi::Object>(
            static_cast<TVMFFIObject*>(address)));
    bool terminated = false;
    try {
      terminated = st->builder->is_terminated(ref).cast<bool>();
    } catch (const std::exception&) {  // (the native loop runs it and reports the fault)
      if (PyErr_Occurred()) PyErr_Clear();
      return false;
    }
    if (terminated) continue;
    st->entries.push_back(FastEntry{std::move(ref), slot, token, static_cast<int64_t>(offset),
                                    first_draft, nd, static_cast<int64_t>(i)});
  }
  return true;
}

// Whether the per-slot lists still have num_slots entries (Python code may change them).
bool SlotListsIntact(const FastState* st) {
  return PyList_GET_SIZE(st->handles) == st->num_slots &&
         PyList_GET_SIZE(st->draft_terminated) == st->num_slots &&
         PyList_GET_SIZE(st->advanced) == st->num_slots &&
         PyList_GET_SIZE(st->guided) == st->num_slots;
}

bool SetCount(PyObject* list, int64_t slot, int32_t value) {
  PyObject* v = PyLong_FromLong(value);
  return v != nullptr && PyList_SetItem(list, slot, v) == 0;  // (steals v)
}

// The first half of a step, with the GIL held: check and read the batch, clear the token mask,
// zero the counters. 1: taken (the job is in st->entries); 0: declined, nothing touched;
// -1: an error is set.
int Begin(FastState* st, PyObject* const* args, const char* name) {
  if (st->in_flight) {
    PyErr_Format(PyExc_RuntimeError, "%s: a build started by fast_begin has not been ended "
                 "(fast_end)", name);
    return -1;
  }
  PyObject* requests = args[1];
  PyObject* offsets = args[2];
  const long long draft_len = PyLong_AsLongLong(args[3]);
  if (draft_len == -1 && PyErr_Occurred()) return -1;
  const long long clear_rows = PyLong_AsLongLong(args[4]);
  if (clear_rows == -1 && PyErr_Occurred()) return -1;
  // (a field read that calls back into this state is declined: the batch being read is not
  // done; the outer call goes on)
  if (st->collecting || !PyList_CheckExact(requests) || !PyList_CheckExact(offsets) ||
      PyList_GET_SIZE(offsets) != PyList_GET_SIZE(requests) || !SlotListsIntact(st) ||
      draft_len < 0) {
    return 0;
  }
  st->entries.clear();
  st->drafts.clear();
  st->seen_slots.clear();
  st->collecting = true;
  const bool plain = Collect(st, requests, offsets, draft_len) && SlotListsIntact(st) &&
                     PyList_GET_SIZE(offsets) == PyList_GET_SIZE(requests);
  st->collecting = false;
  for (int64_t slot : st->seen_slots) st->seen[slot] = 0;
  if (!plain) {
    st->entries.clear();  // (drops the references taken)
    return 0;
  }
  Builder* b = st->builder;
  try {
    st->job_mask = b->BeginStep(clear_rows);
  } catch (const tvm::ffi::Error& e) {
    st->entries.clear();
    PyErr_SetString(PyExc_ValueError, e.message().c_str());
    return -1;
  }
  for (int64_t slot : st->seen_slots) {  // as the Python build: every plain request's counters
    if (!SetCount(st->advanced, slot, 0) || !SetCount(st->guided, slot, 0)) {
      st->entries.clear();
      return -1;
    }
  }
  st->out.assign(st->entries.size() * 3, 0);
  st->job_draft_len = draft_len;
  st->job_rows = b->bitmask.size(0);
  return 1;
}

// The xgrammar work of a taken step: no Python object is touched (any thread, GIL or not).
// `on_build_thread`: the build thread runs the requests alone (at nice 19 it yields to the
// caller's threads, which keep the cores busy: a CPU forward), while any other caller splits
// them across the Builder's fill threads from its pool_min_requests on.
void RunJob(FastState* st, bool on_build_thread = false) {
  Builder* b = st->builder;
  const int64_t n = static_cast<int64_t>(st->entries.size());
  bool parallel = !on_build_thread && b->fill_threads > 1 && n >= b->pool_min_requests;
  if (parallel) {  // (Collect takes each slot once; this also rules out a shared matcher)
    std::vector<std::pair<const void*, int64_t>> matchers(n);
    std::vector<std::pair<int64_t, int64_t>> spans(n);
    for (int64_t k = 0; k < n; ++k) {
      const FastEntry& e = st->entries[k];
      matchers[k] = {e.matcher.get(), k};
      spans[k] = {e.offset, e.offset + e.num_drafts};
    }
    parallel = Builder::Disjoint(&matchers, &spans);
  }
  int32_t* out = st->out.data();
  b->ForEachRequest(n, out, parallel,
                    [st, b, out](int64_t k, Builder::StepClock* clock, std::string* error) {
                      const FastEntry& e = st->entries[k];
                      b->RunOne(e.matcher, e.token, e.offset, e.num_drafts,
                                Drafts{st->drafts.data() + e.first_draft}, st->job_draft_len,
                                st->job_rows, st->job_mask, out + k * 3, clock, error);
                    });
}

// The second half, with the GIL held: write the counters back, report what was unusual,
// drop the matcher references. Returns (masked, unusual) or nullptr with an error set.
PyObject* Finish(FastState* st) {
  Builder* b = st->builder;
  const int64_t n = static_cast<int64_t>(st->entries.size());
  bool masked = false;
  PyObject* unusual = nullptr;
  PyObject* result = nullptr;
  size_t next_error = 0;
  for (int64_t k = 0; k < n; ++k) {
    const FastEntry& e = st->entries[k];
    const int32_t* o = st->out.data() + k * 3;
    if (o[1] && !SetCount(st->advanced, e.slot, o[1])) goto fail;
    if (o[2]) {
      if (!SetCount(st->guided, e.slot, o[2])) goto fail;
      masked = true;
    }
    if (o[0] == kOk) continue;
    if (unusual == nullptr && (unusual = PyList_New(0)) == nullptr) goto fail;
    {
      PyObject* message = Py_None;
      Py_INCREF(message);
      const int32_t kind = o[0] & ~kTerminated;
      if ((kind == kFault || kind == kOverBudget) && next_error < b->errors.size()) {
        Py_DECREF(message);
        const std::string& text = b->errors[next_error++];
        message = PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()),
                                       "replace");
        if (message == nullptr) goto fail;
      }
      PyObject* item = Py_BuildValue("(LiN)", static_cast<long long>(e.index), o[0], message);
      if (item == nullptr) goto fail;
      const int appended = PyList_Append(unusual, item);
      Py_DECREF(item);
      if (appended < 0) goto fail;
    }
  }
  result = Py_BuildValue("(ON)", masked ? Py_True : Py_False,
                         unusual != nullptr ? unusual : (Py_INCREF(Py_None), Py_None));
  unusual = nullptr;  // (stolen by the tuple, or dropped by Py_BuildValue on failure)
fail:
  Py_XDECREF(unusual);
  st->entries.clear();
  return result;
}

// The state (args[0]) of `name`(state) or, with `step`, of `name`(state, requests, offsets,
// draft_len, clear_rows); nullptr with an error set.
FastState* StateArg(PyObject* const* args, Py_ssize_t nargs, bool step, const char* name) {
  if (nargs != (step ? 5 : 1)) {
    PyErr_Format(PyExc_TypeError, step ? "%s(state, requests, offsets, draft_len, clear_rows) "
                 "takes 5 arguments" : "%s(state) takes 1 argument", name);
    return nullptr;
  }
  return static_cast<FastState*>(PyCapsule_GetPointer(args[0], kCapsule));
}

// fast_step / fast_begin up to Begin: the state, and Begin's verdict (-1: error set,
// 0: declined, 1: taken).
int BeginCall(PyObject* const* args, Py_ssize_t nargs, const char* name, FastState** st) {
  *st = StateArg(args, nargs, true, name);
  return *st == nullptr ? -1 : Begin(*st, args, name);
}

// Whether `request` passes the decoder's inline admission test (capgraph/admission.py,
// Admission.admit), which this mirrors exactly: an unguided request whose is_draft and
// is_context_init_state are exact bools; or a guided one that is generating
// (is_generation_in_progress_state True, is_context_init_state and
// is_generation_only_first_iteration False, is_draft an exact bool) with an exact-int seq_slot
// in range whose slot_guides entry is its guide object, an exact-int request_id equal to the
// slot's slot_owners entry (an exact int: the request that created the slot's matcher),
// draft_tokens None or an exact list, and no draft tree (ChainRequest). A field whose read
// raises fails it, except draft_parents (an object without it carries chains).
bool Admitted(const RequestFields& request, int64_t num_slots, PyObject* guides,
              PyObject* owners) {
  Ref params(request.Read(RecordField::kParams));
  if (!params) return false;
  {
    Ref is_draft(request.Read(RecordField::kIsDraft));
    if (BoolValue(is_draft.get()) < 0) return false;
  }
  {
    Ref context(request.Read(RecordField::kContext));
    if (params.get() == Py_None) return BoolValue(context.get()) >= 0;
    if (context.get() != Py_False) return false;
  }
  {
    Ref generating(request.Read(RecordField::kGenerating));
    if (generating.get() != Py_True) return false;
  }
  {
    Ref first_iteration(request.Read(RecordField::kFirstIteration));
    if (first_iteration.get() != Py_False) return false;
  }
  Ref request_id(request.Read(RecordField::kRequestId));
  if (!request_id || !PyLong_CheckExact(request_id.get())) return false;
  {
    Ref drafts(request.Read(RecordField::kDrafts));
    if (!drafts || (drafts.get() != Py_None && !PyList_CheckExact(drafts.get()))) return false;
  }
  if (!ChainRequest(request)) return false;
  Ref slot_value(request.Read(RecordField::kSlot));
  // (last: no Python code runs between this bound and the guide read)
  const int64_t slot = IndexValue(
      slot_value.get(), std::min<int64_t>(num_slots, std::min(PyList_GET_SIZE(guides),
                                                             PyList_GET_SIZE(owners))));
  if (slot < 0 || PyList_GET_ITEM(guides, slot) != params.get()) return false;
  // (two exact ints: comparing them runs no Python code and cannot fail)
  PyObject* owner = PyList_GET_ITEM(owners, slot);
  return PyLong_CheckExact(owner) &&
         PyObject_RichCompareBool(owner, request_id.get(), Py_EQ) == 1;
}

// fast_admit(state, requests, slot_guides, slot_owners) -> int: how many leading requests of
// the list pass the decoder's inline admission test (Admitted). Reads only (a field's read may
// run Python code); never leaves an exception set.
PyObject* FastAdmit(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2]) ||
      !PyList_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "fast_admit(state, requests: list, slot_guides: list, slot_owners: list)");
    return nullptr;
  }
  auto* st = static_cast<FastState*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (st == nullptr) return nullptr;
  PyObject* requests = args[1];
  Py_ssize_t i = 0;
  for (; i < PyList_GET_SIZE(requests); ++i) {  // (re-read: a field's read may change it)
    if (!Admitted(RequestFields(st, PyList_GET_ITEM(requests, i)), st->num_slots, args[2],
                  args[3])) {
      break;
    }
  }
  return PyLong_FromSsize_t(i);
}

// fast_step: the whole step on the calling thread, the GIL released around the xgrammar work.
PyObject* FastStep(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FastState* st = nullptr;
  const int taken = BeginCall(args, nargs, "fast_step", &st);
  if (taken < 0) return nullptr;
  if (taken == 0) Py_RETURN_NONE;
  Py_BEGIN_ALLOW_THREADS
  RunJob(st);
  Py_END_ALLOW_THREADS
  return Finish(st);
}

// The state's build thread: one job at a time, started by fast_begin, ended by fast_end.
// It runs at the lowest priority (nice 19, this thread only): woken while the caller's threads
// keep every core busy (a CPU forward), it must not preempt them -- at normal priority it did,
// at once, and the build ran on the caller's time after all. It runs where a core idles; a
// job it has not started when fast_end comes runs there, on the caller's thread, rather than
// wait for this thread to be woken and scheduled.
void Serve(Runner* r, FastState* st) {
#ifdef __linux__
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);  // (best effort)
#endif
  std::unique_lock<std::mutex> lock(r->mu);
  for (;;) {
    r->cv.wait(lock, [r] { return r->queued || r->stop; });
    if (!r->queued) return;
    r->queued = false;
    lock.unlock();
    RunJob(st, /*on_build_thread=*/true);
    lock.lock();
    r->done = true;
    r->cv.notify_all();
  }
}

// fast_begin: as fast_step, but the xgrammar work runs on the state's own thread, which never
// takes the GIL; True (in flight: end it with fast_end before anything else reads the
// decoder's matchers, counters or masks) or None (declined, nothing touched).
PyObject* FastBegin(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FastState* st = nullptr;
  const int taken = BeginCall(args, nargs, "fast_begin", &st);
  if (taken < 0) return nullptr;
  if (taken == 0) Py_RETURN_NONE;
  st->in_flight = true;
  if (st->entries.empty()) Py_RETURN_TRUE;  // nothing for xgrammar to do: no hand-off
  Runner* r = st->runner;
  if (r != nullptr && r->pid != getpid()) r = st->runner = nullptr;  // forked: (leaked) parent's
  if (r == nullptr) {
    try {
      r = new Runner();
      r->pid = getpid();
      r->thread = std::thread(Serve, r, st);
#ifdef __linux__
      pthread_setname_np(r->thread.native_handle(), kThreadName);  // (seen before it runs)
#endif
    } catch (const std::exception& e) {
      delete r;
      st->in_flight = false;
      st->entries.clear();
      PyErr_Format(PyExc_RuntimeError, "fast_begin: cannot start the build thread: %s",
                   e.what());
      return nullptr;
    }
    st->runner = r;
  }
  {
    std::lock_guard<std::mutex> lock(r->mu);
    r->done = false;
    r->queued = true;
  }
  r->cv.notify_all();
  Py_RETURN_TRUE;
}

// fast_close: end the build thread (after the step in flight, which fast_end must still end);
// a later fast_begin starts a new one.
PyObject* FastClose(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FastState* st = StateArg(args, nargs, false, "fast_close");
  if (st == nullptr) return nullptr;
  // (a job in flight runs to its end on the thread first: fast_end then finds it done)
  StopRunner(st);
  Py_RETURN_NONE;
}

// fast_end: wait (GIL released) for the step fast_begin started; then as fast_step's result.
PyObject* FastEnd(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  FastState* st = StateArg(args, nargs, false, "fast_end");
  if (st == nullptr) return nullptr;
  if (!st->in_flight) {
    PyErr_SetString(PyExc_RuntimeError, "fast_end: no build in flight (fast_begin declined "
                    "or was not called)");
    return nullptr;
  }
  Runner* r = st->runner;
  if (!st->entries.empty() && r != nullptr && r->pid != getpid() && !r->done) {
    // forked while the step was in flight: the thread running it is not in this process (its
    // flags are read unlocked: no other thread of this process touches them)
    st->in_flight = false;
    st->entries.clear();
    PyErr_SetString(PyExc_RuntimeError, "fast_end: the process forked while this build was "
                    "in flight; its thread is not in this process and the step is lost");
    return nullptr;
  }
  if (!st->entries.empty() && r != nullptr && r->pid == getpid()) {
    bool done, steal = false;
    {
      std::lock_guard<std::mutex> lock(r->mu);
      done = r->done;
      if (!done && r->queued) {  // not started (nothing else ran it yet): run it here rather
        r->queued = false;       // than wait for the thread to be woken and scheduled
        steal = true;
      }
    }
    if (steal) {
      Py_BEGIN_ALLOW_THREADS
      RunJob(st);
      Py_END_ALLOW_THREADS
      std::lock_guard<std::mutex> lock(r->mu);
      r->done = true;
    } else if (!done) {  // (done already, the usual case behind a forward: the GIL stays held)
      Py_BEGIN_ALLOW_THREADS
      {  // (the lock is released before the GIL is taken back: never mutex -> GIL)
        std::unique_lock<std::mutex> lock(r->mu);
        r->cv.wait(lock, [r] { return r->done; });
      }
      Py_END_ALLOW_THREADS
    }
  }
  st->in_flight = false;
  return Finish(st);
}

// Look up, on `st->request_type`, the name and descriptor of every field in `field_names`
// (see make_fast); false with an error set.
bool BindFields(FastState* st, PyObject* field_names) {
  if (!PyTuple_Check(field_names) || PyTuple_GET_SIZE(field_names) != kRecordFields) {
    PyErr_Format(PyExc_TypeError, "make_fast: field_names must be a tuple of %d str (the "
                 "request fields in RecordField's order), got %R", kRecordFields, field_names);
    return false;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(st->request_type);
  // a type that computes its attributes itself: every read goes through PyObject_GetAttr
  const bool generic = type->tp_getattro == PyObject_GenericGetAttr;
  for (int k = 0; k < kRecordFields; ++k) {
    PyObject* item = PyTuple_GET_ITEM(field_names, k);
    if (!PyUnicode_Check(item)) {
      PyErr_Format(PyExc_TypeError, "make_fast: field_names[%d] is %R, not a str", k, item);
      return false;
    }
    PyObject* name = PyUnicode_FromObject(item);  // (an exact str: interned below)
    if (name == nullptr) return false;
    PyUnicode_InternInPlace(&name);
    st->names[k] = name;
    if (!generic) continue;
    PyObject* d = PyObject_GetAttr(st->request_type, name);
    if (d == nullptr) {  // (not on the type: each request is asked)
      PyErr_Clear();
      continue;
    }
    // a data descriptor (a __slots__ member, a property): what attribute lookup on an exact
    // instance calls first; anything else may be shadowed per instance
    if (Py_TYPE(d)->tp_descr_get != nullptr && Py_TYPE(d)->tp_descr_set != nullptr) {
      st->descriptors[k] = d;
      st->getters[k] = Py_TYPE(d)->tp_descr_get;
    } else {
      Py_DECREF(d);
    }
  }
  return true;
}

PyObject* MakeFast(PyObject*, PyObject* args) {
  long long address = 0, num_slots = 0, vocab_size = 0, max_drafts = 0;
  PyObject *keep, *handles, *draft_terminated, *advanced, *guided, *request_type, *field_names;
  if (!PyArg_ParseTuple(args, "LOO!O!O!O!O!OLLL", &address, &keep, &PyList_Type, &handles,
                        &PyList_Type, &draft_terminated, &PyList_Type, &advanced, &PyList_Type,
                        &guided, &PyType_Type, &request_type, &field_names, &num_slots,
                        &vocab_size, &max_drafts)) {
    return nullptr;
  }
  if (address == 0 || num_slots < 1 || vocab_size < 1 || max_drafts < 0) {
    PyErr_Format(PyExc_ValueError, "make_fast: bad arguments (address %lld, num_slots %lld, "
                 "vocab_size %lld, max_num_draft_tokens %lld)", address, num_slots, vocab_size,
                 max_drafts);
    return nullptr;
  }
  auto* st = new FastState();
  st->builder = reinterpret_cast<Builder*>(static_cast<intptr_t>(address));
  st->num_slots = num_slots;
  st->vocab_size = vocab_size;
  st->max_drafts = max_drafts;
  st->seen.assign(static_cast<size_t>(num_slots), 0);
  for (PyObject* o : {keep, handles, draft_terminated, advanced, guided, request_type}) {
    Py_INCREF(o);
  }
  st->keep = keep;
  st->handles = handles;
  st->draft_terminated = draft_terminated;
  st->advanced = advanced;
  st->guided = guided;
  st->request_type = request_type;
  PyObject* capsule = BindFields(st, field_names)
                          ? PyCapsule_New(st, kCapsule, DestroyState) : nullptr;
  // (the references dropped on failure are all held elsewhere too: no Python code runs, the
  // error stays set)
  if (capsule == nullptr) FreeState(st);
  return capsule;
}

// ---------------------------------------------------------------------------------------------
// The native host node: a capturable decoder's step (fetch the batch, advance the matchers,
// fill the bitmask, guard dead ends, report per request) as one C function, RunNode, that a
// captured graph calls as its host node (hostfunc.launch_native) and that never takes the GIL
// for a steady-state batch.
//
// Python prepares each step's job at add_batch time (NodePush: the batch's requests read once,
// as Collect reads them, into plain entries) and reads what the step did after the step's sync
// (NodeTake). Between the two, the node reads only native state: its job queue, its per-slot
// table (which matcher a slot's requests run, kept by Python through NodeSetSlot whenever a
// slot's matcher or its drafting-stopped flag changes), the decoder's pinned token buffer (the
// tokens a replayed step sampled) and the Builder's buffers. A batch that is not the plain
// case, or a slot whose matcher only Python can run when the node comes, makes that step a
// Python step: the node takes the GIL and calls the decoder's Python host step (`fallback`),
// which builds it as the Python callback would.
//
// The host may queue step N+1's job before step N has run (an engine scheduling ahead of the
// stream): add_batch writes each put's epoch modulo ticket_ring to the pinned ticket in stream
// order, and a step takes the job whose epoch the ticket holds (TakeJob), leaving later jobs
// queued. The matchers add_batch creates for a job's new requests (NodePush, then NodeCommit)
// are installed in their slots when the job runs natively (Install), so a job queued before
// it still runs the slots' previous matchers; Python installs its own copies when it reads
// that step (node_take's records, in order).
//
// The batch after launch (node_set_batch_wait): a loop may replay a step first and call
// add_batch after, while the GPU runs the forward. Such a batch carries no ticket: a step's
// batch is the epoch after the last one consumed (TakeLateJob). A step that finds none queued
// waits for it (on its own thread, on mu's condition variable, without the GIL) until a job is
// queued, the wait is switched off (set_batch_after_launch(None), close: the step masks
// nothing, consumes no epoch and reports a queue error; the mode is switched on again only
// after the stream has synchronised) or its time runs out. A launched step whose add_batch
// failed is given an empty batch (add_batch([]): it masks nothing). A step whose
// wait ran out consumes its epoch and stops the mode: every later step masks nothing and
// reports a queue error, dropping what is queued (a batch that came after its step gave up
// is never masked for another step), until node_set_batch_wait resynchronises the epochs.
// Any other queue (a job of another epoch, two jobs) is consumed whole, as an error.
//
// Lifetime: a HostNode is counted (the decoder's capsule holds one reference, each captured
// graph one more through hostfunc's retain/release); the last release may come on a driver
// thread, so it only moves the node to a list that the next Python call into this module
// frees (with the GIL: the node holds Python and tvm-ffi objects).
//
// The node also runs the rollback of rejected drafts (rollback_rejected_batch) as a second C
// function, RunRollback: it rolls each request of the batch the next step runs (else of the
// last step run) back to the tokens its verification accepted, read from the decoder's pinned
// count buffer, using the node's own per-slot table of the tokens each slot's matcher
// advanced in its last step. That table is written by the node's steps and rollbacks, zeroed
// when a slot's matcher is cleared (NodeSetSlot), and copied from Python's counters after any
// Python stage (node_sync_counts); a slot generation, bumped with each change of a slot's
// handle, keeps a step or rollback that ran for a slot's previous matcher from writing its
// counters (here and in Python's lists, NodeTake). After a Python step (it may have traversed a draft tree,
// whose accepted path only Python keeps), for a slot that still holds such a tree (its request
// sat out the steps since: slot_tree), or for a slot whose matcher only Python can run,
// the rollback is Python's (`rollback_fallback`, under the GIL).
//
// A step that meets a slot whose last step advanced drafts with no rollback of rejected tokens
// run for it since (slot_due: a rollback_rejected_batch left out) rolls it back first, by its
// request's num_accepted_draft_tokens read at node_push (SettleEntries), as the Python build
// settles it; the due slots pass to a Python stage (node_due) and back (node_sync_counts).
//
// A drafting loop's steps (execute_draft_batch) are C functions too (RunDraft): the first
// takes the loop's batch off the queue and rolls its rejected drafts back (as RunRollback),
// each builds one row per request from the draft-token buffer, the last (by the batch's
// runtime draft length) rolls the loop's draft advances back; the slots' draft advances and
// drafting-stopped flags are the node's (copied from Python's after a Python stage, and to
// Python's by node_take). A loop the node cannot run (the cases of the rollback, or a batch
// with context requests) is Python's (`draft_fallback(draft_step, rows, launch)`, under the
// GIL) from
// its first step to its last.
//
// Each launch carries its shape (NodeLaunch, made by node_launch): the logits rows its step
// masks and a draft step's index. A captured graph replays the shape it was captured with,
// whatever the batch its replay takes: a request whose bitmask rows lie past those rows fails
// (its tokens would be sampled unmasked), and which step of a drafting loop is its last is
// read from the loop's batch when the step runs. A loop replayed short of its last step stays
// open (draft_open) until the next run that takes a batch, which is then a Python step: its
// build, or its rollback of rejected tokens, ends the loop first (GuidedDecoder._open_draft).
//
// node_create(fast, new_tokens, address, positions, fallback, counts, counts_address,
//             rollback, rollback_address, rollback_fallback, drafts, drafts_address,
//             draft_fallback, ticket, ticket_address, ticket_ring)
//   -> (capsule, run, retain, release, run_rollback, run_draft)
//   fast: make_fast's state (its Builder and request field descriptors); new_tokens: the
//   decoder's [positions, num_slots] int32 token buffer (a DLPack-capable CPU tensor) at
//   `address`; fallback(epoch, rows, launch): the Python host step of a Python step (launch:
//   its launch's address, node_launch); counts: the decoder's
//   [num_slots] int32 accepted-count buffer at `counts_address`; rollback: xgrammar's matcher
//   `rollback` tvm-ffi Function (held), whose FFI object is at `rollback_address`;
//   rollback_fallback(): the Python rollback; drafts: the decoder's [num_slots] int32
//   draft-token buffer at `drafts_address`; draft_fallback(draft_step, rows, launch): the
//   Python draft step; ticket: the decoder's one-element int32 step ticket at `ticket_address`, holding
//   epochs modulo ticket_ring. run/retain/release/run_rollback/run_draft: addresses of the C
//   functions `void f(void*)` to launch with a launch's address (node_launch).
// node_launch(node, rows, draft_step, reach) -> address: a launch shape (rows >= 0;
//   draft_step: the index of a drafting loop's step, -1 for a step or a rollback; reach: None,
//   or the step's pruned draft vocabulary as bytes of int32 bitmask words, NodeLaunch);
//   it lives as long as the node.
// node_push(node, fast, requests, offsets, draft_len, clear_rows, epoch, from_buffer,
//           ticketed)
//   -> False | (context, disaggregated): read the step's native job and return the batch
//   indices of the requests whose matchers the caller creates now: context requests at their
//   last chunk (the node fills their row without accepting a token; an earlier chunk has
//   nothing to do) and disaggregated requests' first generation step (the job waits for
//   node_commit where there are any); False (nothing queued) where the batch is not the plain
//   case: the caller then queues a Python step (node_push_python). ticketed: add_batch wrote
//   the epoch to the ticket (not while capturing).
// node_commit(node, handles): queue the waiting job with its inits' matchers (or, handles
//   None, as a Python step).
// node_repeat(node, tokens, epoch, ticketed) -> bool: queue the last job node_push queued
//   again, with new tokens, where every request of it was generating with its token and no
//   drafts (advance_batch's step); False: nothing queued.
// node_push_python(node, epoch, ticketed, drops); node_drop(node, newest) -> bool: forget the oldest
//   job, or the newest (the host side consumed its batch); node_set_slot(node, slot, handle,
//   stopped).
// node_take(node, advanced, guided, drafted)
//   -> [(kind, epoch, error, masked, unusual, columns, rolled, stale)]
//   every record (DoneKind: a step, a rollback, a drafting loop's start, a draft build, a
//   loop's end) since the last call, in order, counters written to the lists (where the
//   slot's matcher is still the one the run used); epoch: the batch the record's indices
//   refer to; error: None or the queue error's text; unusual: as fast_step's (a rollback's
//   and a loop end's: (batch index, 1, text) where the count cannot roll back,
//   (batch index, 2, "Kind: message") where the matcher raised); columns: None or
//   [(batch index, [token, draft, ...])] of the tokens read from the token buffer, for the
//   unusual requests alone (the ones a failure's report reads: nothing reads the others', and
//   a later Python step refreshes its requests' tokens itself); rolled:
//   for a rollback the slots whose matchers rolled back (a matcher that had terminated no
//   longer has), for a loop's end every slot of its batch, for a step the slots its settling
//   of a rollback left out rolled back (SettleEntries), else None; stale: a tuple of the
//   batch indices of unusual requests whose slot holds another matcher by now.
// node_pending(node) -> (records, latest_epoch, plain): the records node_take would return
//   now, without taking them: how many, the newest one's epoch (-1 where none), and whether
//   every one is a plain step: a step's record (no rollback or drafting loop) with no queue
//   error, no matcher installed, and every request's status ok, so that reading it would
//   change nothing but counters and the host side's note of which batch ran.
// node_sync_counts(node, advanced, drafted, trees): the node's per-slot advance and
//   draft-advance counts from Python's lists, and which slots hold a draft tree (trees[slot]
//   not None: their rollback is Python's until the node builds the slot).
// node_stats(node) -> (runs, python_runs, last_start_ns, last_end_ns, busy_ns, rows,
//                      rollback_runs, python_rollback_runs, draft_runs, python_draft_runs,
//                      last_job_ns)
// node_set_warmup(node, on): runs from now on are warm-up runs (no job taken, nothing masked).
// node_set_epoch(node, epoch): the latest batch consumed before the node serves steps.
// node_set_batch_wait(node, ms, epoch): the batch after launch: a step that finds no job
//   queued waits up to `ms` milliseconds for add_batch to queue it (0: the mode is off; it
//   wakes a waiting step). epoch: None, or the latest epoch Python has put with every job
//   dropped (the slots their batches drop cleared): the epochs resynchronised and a stopped
//   mode resumed.
// node_batch_wait_stopped(node) -> bool: a step's wait ran out, and the mode stopped.
// node_shutdown(): Python steps are refused from now on (interpreter exit).

constexpr const char* kNodeCapsule = "capgraph_host_build.HostNode";

struct NodeEntry {
  int64_t slot, token, offset, first_draft, num_drafts, index;
  bool from_buffer;
  // a context request: its matcher was created at add_batch (fill its row, accept nothing),
  // or it has nothing to do this step (`skip`: an earlier chunk, or a request whose slot was
  // released before its step, node_forget_slot; the slot's counters are zeroed unless its
  // native matcher serves another request, whose counts they are)
  bool fill_only, skip;
  bool fresh = false;  // a disaggregated request's first step (its matcher new this step)
  // its num_accepted_draft_tokens (None reads 0), for the settling of a rollback left out
  // (SettleEntries); -1: not an int >= 0 (where the slot is due, the step is Python's)
  int64_t accepted = 0;
};

struct NodeJob {
  int64_t epoch = 0;
  bool python = false;
  bool ticketed = false;  // add_batch wrote its epoch to the ticket in stream order
  int64_t draft_len = 0, clear_rows = 0;
  std::vector<NodeEntry> entries;  // every plain guided request of the batch, in batch order
  std::vector<int64_t> drafts;
  // the matchers add_batch created for its new and disaggregated requests, installed in their
  // slots when the job runs natively (in step order: a step still queued before it runs the
  // slot's previous matcher); an undefined one clears the slot (its creation failed)
  std::vector<std::pair<int64_t, ObjectRef>> installs;
  // a Python job's: the slots its batch drops (failed requests' matchers), cleared by TakeJob
  // where the job is consumed by a queue error instead of run (as the Python fetch would)
  std::vector<int64_t> drops;
  std::vector<ObjectRef> released;  // the matchers those drops cleared (freed after the lock)
};

// What a NodeDone record reports: a step; a rollback of rejected drafts; the start of a
// drafting loop (its batch taken off the queue); a draft step's build; the end of a drafting
// loop (every draft advance rolled back).
enum DoneKind : int { kDoneStep = 0, kDoneRollback = 1, kDoneDraftPop = 2, kDoneDraftBuild = 3,
                      kDoneDraftEnd = 4 };

struct NodeDone {
  int64_t epoch = 0;
  int kind = kDoneStep;
  std::string error;  // a queue error: nothing was built
  bool masked = false;
  std::vector<int64_t> seen_slots;  // the slots whose counters the step zeroes
  std::vector<uint64_t> seen_gens;  // their generations when the step began
  std::vector<int64_t> slots, index;  // per request the Builder ran (a rollback: touched)
  std::vector<uint64_t> gens;  // their slots' generations when the run began
  // per request the Builder ran: status, accepted, guided; a rollback's: status (0, or 1 / 2
  // as node_take says), tokens kept, whether the matcher rolled back
  std::vector<int32_t> out;
  std::vector<std::string> messages;  // per request the Builder ran: its fault / ms, or ""
  std::vector<int64_t> columns;  // per request reading the buffer: index, positions values
  std::vector<int64_t> installed;  // the slots whose matchers the job installed
  // a step's: the slots whose matchers its settling rolled back (SettleEntries; a matcher
  // that had terminated re-reads its state on the host), with their generations
  std::vector<int64_t> settled;
  std::vector<uint64_t> settled_gens;
};

struct HostNode;

// One launch shape of the node's C functions (node_launch): the node, the logits rows the
// launching step masks (its bitmask copy and apply; a captured launch keeps the rows it was
// captured with) and, for a drafting loop's step, its index in the loop (-1 otherwise). The
// launch is the user data of hostfunc's launch; it lives as long as its node, which each
// launch retains (LaunchRetain / LaunchRelease).
struct NodeLaunch {
  HostNode* node;
  int64_t rows, draft_step;
  // a step or a drafting loop's step with a pruned draft vocabulary (d2t): the bitmask words
  // of the target ids its draft ids reach (RunNative and DraftBuild leave a row that allows
  // none of them unmasked); empty: none given
  std::vector<int32_t> reach;
};

struct HostNode {
  std::atomic<int64_t> refs{1};
  // (made by node_launch under the GIL; read by the runs through their user data only)
  std::vector<std::unique_ptr<NodeLaunch>> launches;
  Builder* builder = nullptr;
  PyObject* keep = nullptr;  // make_fast's `keep` (the Builder's step Function): its owner
  PyObject* buffer = nullptr;  // the token buffer's tensor, which owns `tokens`
  const int32_t* tokens = nullptr;  // [positions, num_slots] int32
  int64_t positions = 0, num_slots = 0, vocab_size = 0, max_drafts = 0;
  PyObject* fallback = nullptr;
  std::mutex mu;  // jobs, done and the slot table
  std::deque<NodeJob> jobs;
  std::deque<NodeDone> done;
  // a job whose matchers the caller creates (node_push returned its inits), queued by
  // node_commit
  bool has_pending = false;
  NodeJob pending;
  std::vector<int64_t> pending_slots;  // the slots of its inits, in the order returned
  // the step's ticket: add_batch writes its epoch modulo ticket_ring here in stream order, so
  // a step knows which queued batch is its own (capgraph/capturable.py, _write_step)
  PyObject* ticket_buffer = nullptr;  // owns `ticket`
  const int32_t* ticket = nullptr;
  int64_t ticket_ring = 1;
  std::vector<ObjectRef> slot_matcher;  // per slot: the FFI object a step runs, or none
  // the last job node_push queued, where node_repeat may queue it again with new tokens:
  // every entry a generation request carrying its token, with no drafts (`repeat_ok`); read
  // and written under the GIL only (node_push, node_push_python, node_repeat)
  bool repeat_ok = false;
  std::vector<NodeEntry> repeat_entries;
  int64_t repeat_clear_rows = 0, repeat_batch = 0;
  std::vector<uint8_t> slot_kind;  // 0: no matcher, 1: native, 2: only Python can run it
  std::vector<uint8_t> slot_stopped;  // the drafting loop stopped guiding the slot
  std::vector<int32_t> slot_advanced;  // tokens the slot's matcher advanced in its last step
  std::vector<uint64_t> slot_gen;  // bumped with each change of the slot's matcher
  // the slot holds a draft tree whose accepted path only Python keeps (its rollback is
  // Python's): set from Python's after a Python stage (node_sync_counts), cleared when a
  // native step or draft build runs the slot (its tree is no longer current then)
  std::vector<uint8_t> slot_tree;
  // the slot's last step advanced drafts and no rollback of rejected tokens has run for it
  // since (Python's `_rollback_due`): the next step that runs the slot rolls them back first
  // (SettleEntries); set by the node's steps, cleared by its rollbacks and installs, and
  // from Python's set after a Python stage (node_sync_counts)
  std::vector<uint8_t> slot_due;
  // the rollback's inputs: the accepted-count buffer, xgrammar's matcher rollback, and the
  // Python rollback for what the node cannot roll back
  PyObject* counts_buffer = nullptr;  // owns `counts`
  const int32_t* counts = nullptr;  // [num_slots] int32, by batch position
  PyObject* rollback_owner = nullptr;  // the Python object of `rollback`
  tvm::ffi::Function rollback;
  PyObject* rollback_fallback = nullptr;
  // the drafting loop (RunDraft): the draft-token buffer, the Python draft step, the drafts'
  // advances per slot, and the loop in progress (under mu)
  PyObject* draft_buffer = nullptr;  // owns `draft_tokens`
  const int32_t* draft_tokens = nullptr;  // [num_slots] int32, by batch position
  PyObject* draft_fallback = nullptr;  // draft_fallback(draft_step, rows, launch)
  std::vector<int32_t> slot_drafted;  // tokens the drafting loop advanced the slot's matcher
  bool draft_python = true;  // the loop in progress runs in Python (or none began)
  int64_t draft_epoch = 0;
  // the index of the loop's last step: its batch's runtime draft length - 1 (0 for none); a
  // step past it guides nothing
  int64_t draft_last = 0;
  // a loop took its batch and its last step has not run: the next run taking a batch (a step,
  // a rollback, a loop's first step) is a Python step, which ends the loop first (its
  // draft advances rolled back: a replay that ran fewer steps than the batch's runtime draft
  // length leaves no draft prefix in the matchers, and no slot unguided)
  bool draft_open = false;
  std::vector<NodeEntry> draft_entries;
  std::mutex run_mu;  // one step or rollback at a time
  // last_job: when the latest run had its job (after a step's wait for its batch after
  // launch; a run that waits for nothing: its start)
  std::atomic<int64_t> runs{0}, python_runs{0}, last_start{0}, last_job{0}, last_end{0},
      busy_ns{0}, rows{0}, rollback_runs{0}, python_rollback_runs{0}, draft_runs{0},
      python_draft_runs{0};
  std::atomic<bool> warmup{false};  // steps take no job and mask nothing (graph warm-up)
  int64_t last_epoch = 0;  // (under mu) the epoch of the latest job taken or dropped
  // The batch after launch (node_set_batch_wait, TakeLateJob): a step that finds no job queued
  // waits up to batch_wait_ms for add_batch to queue it (0: the mode is off); `wait_stopped`:
  // a step's wait ran out (the epoch it stopped at) and every step masks nothing until the
  // epochs are resynchronised (-1: running). job_cv is notified, under mu, whenever a job is
  // queued or the wait is switched off.
  std::condition_variable job_cv;
  int64_t batch_wait_ms = 0;
  int64_t wait_stopped = -1;
  // (under mu) the last step run: Python's (or none yet), else its epoch and entries
  bool last_python = true;
  int64_t last_run_epoch = 0;
  std::vector<NodeEntry> last_entries;
};

std::atomic<bool> g_node_shutdown{false};
std::mutex g_grave_mu;
std::vector<HostNode*> g_grave;  // released nodes, freed by the next Python call

void NodeRetain(void* p) { static_cast<HostNode*>(p)->refs.fetch_add(1); }

void NodeRelease(void* p) {
  auto* n = static_cast<HostNode*>(p);
  if (n->refs.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> lock(g_grave_mu);
    g_grave.push_back(n);
  }
}

// A launch's retain / release: its node's.
void LaunchRetain(void* p) { NodeRetain(static_cast<NodeLaunch*>(p)->node); }
void LaunchRelease(void* p) { NodeRelease(static_cast<NodeLaunch*>(p)->node); }

// Free the released nodes (with the GIL: they hold Python and tvm-ffi objects).
void BuryNodes() {
  std::vector<HostNode*> dead;
  {
    std::lock_guard<std::mutex> lock(g_grave_mu);
    if (g_grave.empty()) return;
    dead.swap(g_grave);
  }
  for (HostNode* n : dead) {
    Py_XDECREF(n->fallback);
    Py_XDECREF(n->buffer);
    Py_XDECREF(n->rollback_fallback);
    Py_XDECREF(n->counts_buffer);
    Py_XDECREF(n->draft_fallback);
    Py_XDECREF(n->draft_buffer);
    Py_XDECREF(n->ticket_buffer);
    n->rollback = tvm::ffi::Function();  // (before its owner)
    Py_XDECREF(n->rollback_owner);
    PyObject* keep = n->keep;
    delete n;  // (its matcher references first, the Builder's owner after them)
    Py_XDECREF(keep);
  }
}

void DestroyNode(PyObject* capsule) {
  auto* n = static_cast<HostNode*>(PyCapsule_GetPointer(capsule, kNodeCapsule));
  if (n != nullptr) NodeRelease(n);
  BuryNodes();
}

// The address of a launch, as node_launch returned it (what a Python step is given, to find
// the launch's pruned draft vocabulary).
unsigned long long LaunchAddress(const NodeLaunch* l) {
  return static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(l));
}

// A Python draft step: the decoder's Python draft step under the GIL (it reports its own
// errors), with the step's index in its loop, its logits rows and its launch's address.
void RunPythonDraft(HostNode* n, int64_t draft_step, const NodeLaunch* l) {
  if (g_node_shutdown.load()) return;
  n->python_draft_runs.fetch_add(1);
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* r = PyObject_CallFunction(n->draft_fallback, "LLK",
                                      static_cast<long long>(draft_step),
                                      static_cast<long long>(l->rows), LaunchAddress(l));
  if (r == nullptr) PyErr_WriteUnraisable(n->draft_fallback);
  Py_XDECREF(r);
  PyGILState_Release(gil);
}

// A Python step: the decoder's Python host step under the GIL (it reports its own errors),
// with the step's epoch, its logits rows and its launch's address; epoch < 0 (no launch): the
// Python rollback.
void RunPython(HostNode* n, int64_t epoch, const NodeLaunch* l = nullptr) {
  if (g_node_shutdown.load()) return;  // (the interpreter is exiting: no thread may enter it)
  (epoch < 0 ? n->python_rollback_runs : n->python_runs).fetch_add(1);
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* fn = epoch < 0 ? n->rollback_fallback : n->fallback;
  PyObject* r = epoch < 0 ? PyObject_CallNoArgs(fn)
                          : PyObject_CallFunction(fn, "LLK", static_cast<long long>(epoch),
                                                  static_cast<long long>(l->rows),
                                                  LaunchAddress(l));
  if (r == nullptr) PyErr_WriteUnraisable(fn);  // (the fallbacks catch their own)
  Py_XDECREF(r);
  PyGILState_Release(gil);
}

// A request's outcome from the Builder's run (run_o3) into o3, with, for a fault or a budget
// overrun, its message: the next of the Builder's errors (they come in request order).
void TakeOutcome(HostNode* n, const int32_t* run_o3, int32_t* o3, std::string* message,
                 size_t* next_error) {
  const std::vector<std::string>& errors = n->builder->errors;
  std::copy(run_o3, run_o3 + 3, o3);
  const int32_t kind = o3[0] & ~kTerminated;
  if ((kind == kFault || kind == kOverBudget) && *next_error < errors.size()) {
    *message = errors[(*next_error)++];
  }
  n->rows.fetch_add(o3[2]);
}

// The failure of a request whose rows [first, end) lie past the `rows` logits rows its step
// masks (a graph captured for a smaller batch): its tokens would be sampled unmasked.
std::string PastRows(int64_t first, int64_t end, int64_t rows) {
  return "LayoutError: the request's bitmask rows [" + std::to_string(first) + ", " +
         std::to_string(end) + ") lie past the " + std::to_string(rows) + " logits rows this " +
         "step masks (a graph captured for a smaller batch, or prepare(num_rows) below the " +
         "batch layout): they would be sampled unmasked";
}

bool CallRollback(HostNode* n, const ObjectRef& m, int64_t count, std::string* message);
void DropFailed(HostNode* n, int64_t slot, uint64_t gen);

// Before a step's build: each request of `job` whose slot is due (slot_due: its last step
// advanced drafts, and no rollback of rejected tokens ran for it since) is first rolled back
// to its own num_accepted_draft_tokens, as rollback_rejected_tokens would have rolled it
// back (the Python build's settling, GuidedDecoder._settle_drafts): a step left without that
// call must not mask from a state the text never reached. A count past what the matcher
// advanced fails the request by name, unless the matcher has terminated (verification can
// accept past a draft stop token: clamped), as the Python settling does. A new request's
// slot (its matcher installed for this step) is no longer due. Returns per entry the text
// of its failure ("" where none); RunStep made the step Python's where a due slot's count
// is not an int >= 0 or its draft tree's path is Python's to keep.
std::vector<std::string> SettleEntries(HostNode* n, const NodeJob& job, NodeDone* d) {
  const size_t k = job.entries.size();
  std::vector<std::string> failed(k);
  if (n->max_drafts <= 0) return failed;  // (no step advances drafts: none is ever due)
  struct Due {
    size_t entry;
    ObjectRef matcher;
    int32_t advanced;
    uint64_t gen;
  };
  std::vector<Due> due;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    for (size_t i = 0; i < k; ++i) {
      const NodeEntry& e = job.entries[i];
      if (e.skip || !n->slot_due[e.slot]) continue;
      n->slot_due[e.slot] = 0;
      if (e.fill_only || e.fresh || n->slot_advanced[e.slot] <= 0) continue;
      due.push_back(Due{i, n->slot_kind[e.slot] == 1 ? n->slot_matcher[e.slot] : ObjectRef(),
                        n->slot_advanced[e.slot], n->slot_gen[e.slot]});
    }
  }
  for (const Due& x : due) {
    const NodeEntry& e = job.entries[x.entry];
    std::string& message = failed[x.entry];
    const int64_t accepted = std::max<int64_t>(e.accepted, 0);
    if (!x.matcher.defined()) {
      message = "RequestError: cannot roll back: num_accepted_draft_tokens=" +
                std::to_string(accepted) + ", num_advanced_tokens=" + std::to_string(x.advanced);
      continue;
    }
    int64_t keep = 1 + accepted;
    if (keep > x.advanced) {
      try {
        if (!n->builder->is_terminated(x.matcher).cast<bool>()) {
          message = "RequestError: num_accepted_draft_tokens=" + std::to_string(accepted) +
                    ", but the last step advanced its matcher by " +
                    std::to_string(x.advanced - 1) + " draft token(s): the others were not "
                    "given, past the runtime draft length, or refused by the grammar, so no "
                    "masked row let verification accept them";
          continue;
        }
      } catch (const std::exception& ex) {
        message = std::string("RuntimeError: is_terminated: ") + ex.what();
        continue;
      }
      keep = x.advanced;  // (verification can accept past a draft stop token)
    }
    if (keep < x.advanced) {
      if (!CallRollback(n, x.matcher, x.advanced - keep, &message)) continue;
      d->settled.push_back(e.slot);
      d->settled_gens.push_back(x.gen);
    }
    std::lock_guard<std::mutex> lock(n->mu);
    if (n->slot_gen[e.slot] == x.gen) n->slot_advanced[e.slot] = static_cast<int32_t>(keep);
  }
  return failed;
}

// Whether bitmask row `row` allows none of the target ids of `reach` (a launch's pruned draft
// vocabulary, NodeLaunch): a dead end in draft coordinates, which is left unmasked (its masked
// softmax would be NaN), as the Python build's GuidedDecoder._unguide_unreachable leaves it.
bool Unreachable(const Builder* b, int64_t row, const std::vector<int32_t>& reach) {
  const int32_t* bits = static_cast<const int32_t*>(b->bitmask.data_ptr()) + row * b->words;
  const int64_t words = std::min<int64_t>(b->words, static_cast<int64_t>(reach.size()));
  for (int64_t w = 0; w < words; ++w) {
    if ((bits[w] & reach[w]) != 0) return false;
  }
  return true;
}

// One native job: the Builder's loop over the entries whose slot has a native matcher, after
// the settling of a rollback left out (SettleEntries); `launch_rows`: the logits rows the step
// masks (a request past them fails, PastRows); `reach`: the launch's pruned draft vocabulary
// (empty: none), whose dead ends are left unmasked (Unreachable).
void RunNative(HostNode* n, const NodeJob& job, NodeDone* d, int64_t launch_rows,
               const std::vector<int32_t>& reach) {
  Builder* b = n->builder;
  std::vector<std::string> settled = SettleEntries(n, job, d);
  const int64_t k = static_cast<int64_t>(job.entries.size());
  std::vector<ObjectRef> refs(static_cast<size_t>(k));
  std::vector<uint64_t> gens(static_cast<size_t>(k));
  {
    std::lock_guard<std::mutex> lock(n->mu);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t slot = job.entries[i].slot;
      if (n->slot_kind[slot] == 1 && !n->slot_stopped[slot]) refs[i] = n->slot_matcher[slot];
      gens[i] = n->slot_gen[slot];
    }
  }
  int32_t* mask = b->BeginStep(job.clear_rows);
  const int64_t rows = b->bitmask.size(0);
  const int32_t* tokens = n->tokens;
  const int64_t width = n->positions;
  // 1. per request, in order: its token and drafts (the buffer's column where it reads
  // one), whether it runs, and what fails it before it runs
  struct Run {
    int64_t entry, token;
    const int64_t* drafts;
  };
  std::vector<int64_t> columns(static_cast<size_t>(k * width));
  std::vector<Run> runs;
  std::vector<int32_t> out;  // per request that reaches RunOne or fails before it
  std::vector<int64_t> reported;  // its entry
  std::vector<std::string> messages;
  for (int64_t i = 0; i < k; ++i) {
    const NodeEntry& e = job.entries[i];
    if (!(e.skip && refs[i].defined())) {  // (a skipped entry on a slot whose matcher serves
      d->seen_slots.push_back(e.slot);    // another request leaves that request's counts, as
      d->seen_gens.push_back(gens[i]);    // the Python build's _prepare does)
    }
    int64_t token = e.token;
    const int64_t* drafts = job.drafts.data() + e.first_draft;
    if (e.from_buffer) {
      int64_t* column = columns.data() + i * width;
      d->columns.push_back(e.index);
      for (int64_t p = 0; p < width; ++p) {
        column[p] = tokens[p * n->num_slots + e.slot];
        d->columns.push_back(column[p]);
      }
      token = column[0];
      drafts = column + 1;
    }
    const ObjectRef& m = refs[i];
    if (!settled[i].empty()) {  // (its rows stay unmasked; its matcher is dropped below)
      reported.push_back(i);
      out.insert(out.end(), {kFault, 0, 0});
      messages.push_back(std::move(settled[i]));
      continue;
    }
    if (e.skip || !m.defined()) continue;  // nothing to do, no matcher, or drafting stopped
    std::string message;
    try {
      if (b->is_terminated(m).cast<bool>()) continue;
    } catch (const std::exception& ex) {
      message = std::string("RuntimeError: is_terminated: ") + ex.what();
    }
    const int64_t end = e.offset + (e.fill_only ? 1 : 1 + job.draft_len);
    if (message.empty() && end > launch_rows) message = PastRows(e.offset, end, launch_rows);
    if (message.empty() && !e.fill_only && (token < 0 || token >= n->vocab_size)) {
      message = "RequestError: new_token " + std::to_string(token) + " from the token buffer "
                "is outside the vocabulary [0, " + std::to_string(n->vocab_size) + ")";
    }
    for (int64_t j = 0; message.empty() && j < e.num_drafts; ++j) {
      if (drafts[j] < 0 || drafts[j] >= n->vocab_size) {
        message = "RequestError: draft token " + std::to_string(drafts[j]) + " from the token "
                  "buffer is outside the vocabulary [0, " + std::to_string(n->vocab_size) + ")";
      }
    }
    reported.push_back(i);
    out.insert(out.end(), {message.empty() ? kOk : kFault, 0, 0});
    messages.push_back(std::move(message));
    if (messages.back().empty()) runs.push_back(Run{i, token, drafts});
  }
  // 2. the xgrammar work: on the fill pool where the Builder's fill allows (each request its
  // own matcher and rows), else in order on this thread
  const int64_t nrun = static_cast<int64_t>(runs.size());
  std::vector<int32_t> run_out(static_cast<size_t>(nrun * 3), 0);
  bool parallel = b->fill_threads > 1 && nrun >= b->pool_min_requests;
  if (parallel) {
    std::vector<std::pair<const void*, int64_t>> matchers(static_cast<size_t>(nrun));
    std::vector<std::pair<int64_t, int64_t>> spans(static_cast<size_t>(nrun));
    for (int64_t r = 0; r < nrun; ++r) {
      const NodeEntry& e = job.entries[runs[r].entry];
      matchers[r] = {refs[runs[r].entry].get(), r};
      spans[r] = {e.offset, e.offset + e.num_drafts};
    }
    parallel = Builder::Disjoint(&matchers, &spans);
  }
  const size_t errors_before = b->errors.size();
  b->ForEachRequest(nrun, run_out.data(), parallel,
                    [&](int64_t r, Builder::StepClock* clock, std::string* error) {
                      const NodeEntry& e = job.entries[runs[r].entry];
                      b->RunOne(refs[runs[r].entry], runs[r].token, e.offset, e.num_drafts,
                                Drafts{runs[r].drafts}, job.draft_len, rows, mask,
                                run_out.data() + r * 3, clock, error);
                    });
  // 3. in order: the results, and what a failed request leaves behind
  size_t next_error = errors_before;
  int64_t r = 0;
  for (size_t q = 0; q < reported.size(); ++q) {
    const int64_t i = reported[q];
    const NodeEntry& e = job.entries[i];
    int32_t* o3 = out.data() + q * 3;
    if (r < nrun && runs[r].entry == i) {
      TakeOutcome(n, run_out.data() + r * 3, o3, &messages[q], &next_error);
      ++r;
    }
    if ((o3[0] & ~kTerminated) != kOk) {
      // a failed request: the rows it filled before the failure stay unmasked, and its
      // matcher runs no later step (Python drops it when it reads this step)
      for (int64_t row = e.offset; row < e.offset + o3[2] && row < rows; ++row) mask[row] = 0;
      std::lock_guard<std::mutex> lock(n->mu);
      DropFailed(n, e.slot, gens[i]);
    } else if (o3[2]) {
      d->masked = true;
      for (int64_t row = e.offset; !reach.empty() && row < e.offset + o3[2] && row < rows;
           ++row) {
        if (mask[row] && Unreachable(b, row, reach)) mask[row] = 0;
      }
    }
    d->slots.push_back(e.slot);
    d->gens.push_back(gens[i]);
    d->index.push_back(e.index);
    d->out.insert(d->out.end(), o3, o3 + 3);
    d->messages.push_back(std::move(messages[q]));
  }
  // 4. the node's advance counts, as node_take writes Python's: zero for every slot the step
  // saw, then what each request that ran advanced (a failed one's matcher is gone: zero)
  std::lock_guard<std::mutex> lock(n->mu);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t slot = job.entries[i].slot;
    const bool held = job.entries[i].skip && refs[i].defined();  // (as seen_slots above)
    if (n->slot_gen[slot] == gens[i] && !held) n->slot_advanced[slot] = 0;
    n->slot_tree[slot] = 0;  // (the slot was built: a tree stored before is not current)
  }
  for (size_t q = 0; q < d->slots.size(); ++q) {
    const int64_t slot = d->slots[q];
    const int32_t* o3 = d->out.data() + q * 3;
    if (n->slot_gen[slot] == d->gens[q] && (o3[0] & ~kTerminated) == kOk) {
      n->slot_advanced[slot] = o3[1];
    }
  }
  // the slots this step gave drafts to are due (SettleEntries), whatever their outcome, as
  // the Python build marks them
  for (int64_t i = 0; i < k; ++i) {
    const NodeEntry& e = job.entries[i];
    if (!e.skip && !e.fill_only && e.num_drafts > 0 && n->slot_gen[e.slot] == gens[i]) {
      n->slot_due[e.slot] = 1;
    }
  }
}

// Each run of the node as an NVTX range in the "capgraph" domain (the Python stages' domain:
// capgraph/_nvtx.py), where the library was built with NVTX's headers; a no-op otherwise, and
// close to one while no tool is attached. A step's range (0) is
// "CapturableGuidedDecoder.host_node", a rollback's (1) "CapturableGuidedDecoder.host_rollback",
// a draft step's (2) "CapturableGuidedDecoder.host_draft".
class NodeRange {
 public:
#ifdef CAPGRAPH_WITH_NVTX
  explicit NodeRange(int what = 0) {
    static const nvtxDomainHandle_t domain = nvtxDomainCreateA("capgraph");
    static const nvtxStringHandle_t names[3] = {
        nvtxDomainRegisterStringA(domain, "CapturableGuidedDecoder.host_node"),
        nvtxDomainRegisterStringA(domain, "CapturableGuidedDecoder.host_rollback"),
        nvtxDomainRegisterStringA(domain, "CapturableGuidedDecoder.host_draft")};
    const nvtxStringHandle_t name = names[what];
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    a.message.registered = name;
    domain_ = domain;
    nvtxDomainRangePushEx(domain_, &a);
  }
  ~NodeRange() { nvtxDomainRangePop(domain_); }

 private:
  nvtxDomainHandle_t domain_;
#else
  explicit NodeRange(int = 0) {}  // (user-provided: a range object is not an unused variable)
#endif
};

// The end of a run begun at t0: its time, its end, one more in `runs`.
void EndRun(HostNode* n, int64_t t0, std::atomic<int64_t>* runs) {
  const int64_t t1 = NowNs();
  n->busy_ns.fetch_add(t1 - t0);
  n->last_end.store(t1);
  runs->fetch_add(1);
}

// Zero the whole token mask: a run that masks nothing (warm-up, a queue error).
void ClearAll(HostNode* n) {
  try {
    n->builder->BeginStep(n->builder->bitmask.size(0));
  } catch (const std::exception&) {  // (full rows are always in bounds)
  }
}

// The signed distance from a queued epoch to a step's ticket (an epoch modulo ring): 0 for the
// step's own batch, > 0 for a batch put before it, < 0 for one put after it.
int64_t TicketDistance(int64_t ticket, int64_t epoch, int64_t ring) {
  int64_t d = (ticket - epoch) % ring;
  if (d < 0) d += ring;
  return d >= ring / 2 ? d - ring : d;
}

std::string EpochList(const std::deque<NodeJob>& jobs) {
  std::string out;
  for (const NodeJob& j : jobs) out += (out.empty() ? "" : ", ") + std::to_string(j.epoch);
  return "[" + out + "]";
}

// Clear the slots that `jobs`' batches drop (under n->mu): jobs consumed by a queue error
// never run, and the Python fetch that would have dropped them drops them as it consumes
// them; the old matchers go to out->released.
void DropConsumed(HostNode* n, const std::vector<int64_t>& slots, NodeJob* out) {
  for (const int64_t slot : slots) {
    if (n->slot_kind[slot] != 0) ++n->slot_gen[slot];
    n->slot_advanced[slot] = 0;
    out->released.push_back(std::move(n->slot_matcher[slot]));
    n->slot_matcher[slot] = ObjectRef();
    n->slot_kind[slot] = 0;
  }
}

// Take this step's job off the queue into *job, as CapturableGuidedDecoder._take_put does
// (d->epoch: the latest epoch consumed; d->error: a queue error). A ticketed front job: the
// step's own job is the one whose epoch the ticket holds; jobs put before it had no step of
// their own (consumed with it, an error: the step masks nothing); a ticket older than every
// queued job is a step without its add_batch (nothing consumed, an error). Jobs put after
// the step's own stay queued for their steps. An unticketed job (put while capturing) must be
// the only one queued, the epoch after the last consumed. Where a queue error consumes jobs,
// the slots their batches drop are cleared here (DropConsumed). False: no job was taken.
bool TakeJob(HostNode* n, NodeJob* job, NodeDone* d) {
  std::lock_guard<std::mutex> lock(n->mu);
  const int64_t expected = n->last_epoch + 1;
  d->epoch = n->last_epoch;
  if (n->jobs.empty()) {
    d->error = "no batch queued for this step (expected epoch " + std::to_string(expected) +
               "): a replay or execute without its add_batch";
    return false;
  }
  if (n->jobs.front().ticketed) {
    const int64_t ticket = __atomic_load_n(n->ticket, __ATOMIC_ACQUIRE);
    const int64_t front = n->jobs.front().epoch;
    const int64_t dist = TicketDistance(ticket, front, n->ticket_ring);
    if (dist < 0) {
      d->error = "this step's batch (epoch " + std::to_string(front + dist) + ") was " +
                 "consumed already; still queued: " + EpochList(n->jobs) +
                 " (a replay or execute without its add_batch)";
      return false;
    }
    const int64_t own = front + dist;
    std::string skipped;
    std::vector<int64_t> drops;  // (of every job consumed: cleared if this is an error)
    while (!n->jobs.empty() && n->jobs.front().epoch <= own) {
      *job = std::move(n->jobs.front());
      n->jobs.pop_front();
      drops.insert(drops.end(), job->drops.begin(), job->drops.end());
      if (job->epoch < own) skipped += (skipped.empty() ? "" : ", ") + std::to_string(job->epoch);
    }
    n->last_epoch = d->epoch = own;
    if (!skipped.empty() || job->epoch != own) {
      d->error = "fetched epoch " + std::to_string(job->epoch) + ", expected " +
                 std::to_string(own) + " (this step's add_batch); the batches of epochs [" +
                 skipped + "] had no step of their own (an add_batch without its execute)";
      DropConsumed(n, drops, job);
    }
    return true;
  }
  *job = std::move(n->jobs.front());
  n->jobs.pop_front();
  d->epoch = n->last_epoch = job->epoch;
  if (job->epoch != expected || !n->jobs.empty()) {
    DropConsumed(n, job->drops, job);
    for (const NodeJob& j : n->jobs) {
      n->last_epoch = d->epoch = j.epoch;
      DropConsumed(n, j.drops, job);
    }
    d->error = "fetched epoch " + std::to_string(job->epoch) + ", expected " +
               std::to_string(expected) + "; still queued: " + EpochList(n->jobs) +
               " (an add_batch without its execute)";
    n->jobs.clear();
  }
  return true;
}

// Install a native job's matchers in their slots (under n->mu): a new generation each, no
// advances; the drafting-stopped flag stays Python's (as a Python build's matcher creation).
void Install(HostNode* n, NodeJob* job, NodeDone* d) {
  for (auto& [slot, ref] : job->installs) {
    ObjectRef old = std::move(n->slot_matcher[slot]);  // (released after the lock: no Python)
    n->slot_matcher[slot] = std::move(ref);
    n->slot_kind[slot] = n->slot_matcher[slot].defined() ? 1 : 0;
    ++n->slot_gen[slot];
    n->slot_advanced[slot] = 0;
    n->slot_drafted[slot] = 0;
    n->slot_due[slot] = 0;
    d->installed.push_back(slot);
    ref = std::move(old);  // (the job, destroyed after the lock, drops the old reference)
  }
}

// Move every queued job into *out (under n->mu) and clear the slots their batches drop, as a
// step that consumes them does (the old matchers go to released->released); returns the
// latest epoch among them, or -1 for an empty queue.
int64_t ConsumeQueue(HostNode* n, std::deque<NodeJob>* out, NodeJob* released) {
  out->swap(n->jobs);
  std::vector<int64_t> drops;
  int64_t latest = -1;
  for (const NodeJob& j : *out) {
    drops.insert(drops.end(), j.drops.begin(), j.drops.end());
    latest = std::max(latest, j.epoch);
  }
  DropConsumed(n, drops, released);
  return latest;
}

// TakeJob for the batch after launch (batch_wait_ms > 0; see the section's comment): this
// step's job, the epoch after the last consumed, waited for where none is queued. False with
// d->error set: the step masks nothing.
bool TakeLateJob(HostNode* n, NodeJob* job, NodeDone* d) {
  std::deque<NodeJob> consumed;  // (destroyed after the lock: their matcher references)
  std::unique_lock<std::mutex> lock(n->mu);
  const int64_t own = n->last_epoch + 1;
  d->epoch = n->last_epoch;
  auto consume_all = [n, job, d, &consumed](const std::string& why) {  // (an error)
    const std::string queued = EpochList(n->jobs);
    n->last_epoch = std::max(n->last_epoch, ConsumeQueue(n, &consumed, job));
    d->epoch = n->last_epoch;
    d->error = why + (queued == "[]" ? "" : "; dropped the batches of epochs " + queued);
  };
  if (n->wait_stopped >= 0) {
    consume_all("the batch after launch stopped at epoch " + std::to_string(n->wait_stopped) +
                ", whose batch did not come in time: every step masks nothing until "
                "set_batch_after_launch() or discard_queued_batches() resumes it");
    return false;
  }
  if (n->jobs.empty()) {
    const int64_t wait_ms = n->batch_wait_ms;
    const bool ready = n->job_cv.wait_for(lock, std::chrono::milliseconds(wait_ms), [n] {
      return !n->jobs.empty() || n->batch_wait_ms <= 0;
    });
    if (!ready) {
      n->last_epoch = n->wait_stopped = own;
      d->epoch = own;
      d->error = "no batch queued for this step (epoch " + std::to_string(own) + ") within " +
                 std::to_string(wait_ms) + " ms of its start (the batch after launch: each "
                 "replay's add_batch follows it); the steps after it mask nothing until "
                 "set_batch_after_launch() or discard_queued_batches() resumes";
      return false;
    }
    if (n->jobs.empty()) {
      d->error = "no batch queued for this step (epoch " + std::to_string(own) + ") when the "
                 "wait for it was switched off (set_batch_after_launch(None) or close)";
      return false;
    }
  }
  if (n->jobs.size() != 1 || n->jobs.front().epoch != own) {
    consume_all("this step's batch is epoch " + std::to_string(own) + ", but the queue held " +
                "another (an add_batch without its step, or a step without its add_batch)");
    return false;
  }
  *job = std::move(n->jobs.front());
  n->jobs.pop_front();
  n->last_epoch = d->epoch = own;
  return true;
}

// The host node: take the next job and run it (see the section's comment) for the launch `l`:
// masking its logits rows, with its pruned draft vocabulary (RunNative). Never throws.
void RunStep(HostNode* n, const NodeLaunch* l) {
  const int64_t rows = l->rows;
  const std::vector<int32_t>& reach = l->reach;
  std::lock_guard<std::mutex> serial(n->run_mu);
  const NodeRange range;
  int64_t t0 = NowNs();
  n->last_start.store(t0);
  n->last_job.store(t0);
  NodeDone d;
  NodeJob job;
  if (n->warmup.load()) {  // a warm-up run: no job taken, nothing masked, nothing reported
    ClearAll(n);
    n->last_end.store(NowNs());
    return;
  }
  bool late;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    late = n->batch_wait_ms > 0;
  }
  const bool have = late ? TakeLateJob(n, &job, &d) : TakeJob(n, &job, &d);
  t0 = NowNs();  // (busy_ns counts the step's work, not its wait for the batch after launch)
  n->last_job.store(t0);
  bool python = have && d.error.empty() && job.python;
  if (have && d.error.empty() && !python) {
    std::lock_guard<std::mutex> lock(n->mu);
    auto installed = [&job](int64_t slot) {  // (a slot whose matcher the job replaces)
      return std::any_of(job.installs.begin(), job.installs.end(),
                         [slot](const auto& install) { return install.first == slot; });
    };
    for (const NodeEntry& e : job.entries) {
      if (n->slot_kind[e.slot] == 2 && !n->slot_stopped[e.slot] && !installed(e.slot)) {
        python = true;
      }
      // a due slot (SettleEntries) whose count is not an int >= 0, or whose draft tree's
      // accepted path only Python keeps
      if (n->slot_due[e.slot] && !e.skip && !e.fill_only && !e.fresh && !installed(e.slot) &&
          (e.accepted < 0 || n->slot_tree[e.slot])) {
        python = true;
      }
    }
    if (n->draft_open) python = true;  // (it ends the open loop first)
    if (!python) Install(n, &job, &d);
  }
  if (have && d.error.empty()) {  // what a rollback before the next step's job rolls back
    std::lock_guard<std::mutex> lock(n->mu);
    n->last_python = python;
    n->last_run_epoch = job.epoch;
    if (python) n->last_entries.clear();
    else n->last_entries = job.entries;
  }
  if (python) {
    RunPython(n, job.epoch, l);  // (it takes its batch and reports itself: no record)
    std::lock_guard<std::mutex> lock(n->mu);
    n->draft_open = false;
  } else {
    try {
      if (d.error.empty()) {
        RunNative(n, job, &d, rows, reach);
      } else {
        n->builder->BeginStep(n->builder->bitmask.size(0));  // a step out of step masks nothing
      }
    } catch (const std::exception& ex) {  // (BeginStep's bounds: a bug, reported as such)
      d.error = std::string("host node: ") + ex.what();
    }
    std::lock_guard<std::mutex> lock(n->mu);
    n->done.push_back(std::move(d));
  }
  EndRun(n, t0, &n->runs);
}

void RunNode(void* p) {
  const auto* l = static_cast<NodeLaunch*>(p);
  RunStep(l->node, l);
}

// Roll m back by `count` tokens through xgrammar's FFI rollback: true, or false with what it
// raised ("Kind: message") in *message.
bool CallRollback(HostNode* n, const ObjectRef& m, int64_t count, std::string* message) {
  // (the matcher's UTF-8 guard, if the builds guard: rolled back with it, and first, so that
  // a rollback past its history moves nothing)
  const GuardRef guard_ref(n->builder->utf8_trans.defined() ? m.get() : nullptr);
  Utf8Guard* guard = guard_ref.get();
  if (guard != nullptr && !guard->Pop(count)) {
    *message = "MatcherError: a rollback of " + std::to_string(count) + " tokens goes past " +
               "the UTF-8 guard's history (" +
               std::to_string(guard->Count() - guard->Floor()) + " tokens)";
    return false;
  }
  try {
    n->rollback(m, count);
    return true;
  } catch (const tvm::ffi::Error& ex) {
    *message = ex.kind() + ": " + ex.message();
  } catch (const std::exception& ex) {
    *message = std::string("RuntimeError: ") + ex.what();
  }
  if (guard != nullptr) guard->Unpop(count);  // (the matcher did not move)
  return false;
}

// One request's rollback (see RunRollback): writes {status, kept, rolled} to o3 and a
// failure's text to *message; `count` is its accepted count (-1: none was given).
void RollbackOne(HostNode* n, const NodeEntry& e, int64_t count, int32_t advanced,
                 const ObjectRef& m, int32_t* o3, std::string* message) {
  const int64_t accepted = std::min<int64_t>(count, advanced) - 1;
  if (!m.defined() || accepted < 0) {  // (the Python rollback's words)
    o3[0] = 1;
    *message = count < 0 ? "cannot roll back: no accepted count for batch position " +
                               std::to_string(e.index)
                         : "cannot roll back: num_accepted_draft_tokens=" +
                               std::to_string(accepted) + ", num_advanced_tokens=" +
                               std::to_string(advanced);
    return;
  }
  const int64_t keep = std::min<int64_t>(accepted + 1, advanced);
  o3[1] = static_cast<int32_t>(keep);
  if (keep == advanced) return;
  if (CallRollback(n, m, advanced - keep, message)) {
    o3[2] = 1;
  } else {
    o3[0] = 2;
  }
}

// Drop the native matcher of a slot whose request failed (if it is still `gen`'s): no later
// step runs it (Python drops its own when it reads the failure). Under n->mu.
void DropFailed(HostNode* n, int64_t slot, uint64_t gen) {
  if (n->slot_gen[slot] == gen && n->slot_kind[slot] == 1) {
    ObjectRef dropped;
    std::swap(n->slot_matcher[slot], dropped);
    n->slot_kind[slot] = 0;
    n->slot_advanced[slot] = 0;
  }
}

// A slot's row of the node's table, read under n->mu: its native matcher (none where it has
// none or only Python can run it), advance counts and generation.
struct SlotView {
  ObjectRef matcher;
  int32_t advanced = 0, drafted = 0;
  uint64_t gen = 0;
};

SlotView ReadSlot(HostNode* n, int64_t slot) {
  std::lock_guard<std::mutex> lock(n->mu);
  SlotView v;
  if (n->slot_kind[slot] == 1) v.matcher = n->slot_matcher[slot];
  v.advanced = n->slot_advanced[slot];
  v.drafted = n->slot_drafted[slot];
  v.gen = n->slot_gen[slot];
  return v;
}

// Append one request's outcome {status, count, flag} and message to the record d.
void Report(NodeDone* d, const NodeEntry& e, uint64_t gen, const int32_t* o3,
            std::string message) {
  d->slots.push_back(e.slot);
  d->gens.push_back(gen);
  d->index.push_back(e.index);
  d->out.insert(d->out.end(), o3, o3 + 3);
  d->messages.push_back(std::move(message));
}

// Roll each of `entries` back to its accepted count (RollbackOne), into the rollback record d.
void RollbackEntries(HostNode* n, const std::vector<NodeEntry>& entries, NodeDone* d) {
  if (n->max_drafts <= 0) return;
  for (const NodeEntry& e : entries) {
    if (!e.skip) {  // (rolled back now, or a new request's slot: no longer due)
      std::lock_guard<std::mutex> lock(n->mu);
      n->slot_due[e.slot] = 0;
    }
    // a new request drafted nothing: its slot's advances were its predecessor's
    if (e.fill_only || e.skip || e.fresh) continue;
    const SlotView v = ReadSlot(n, e.slot);
    if (v.advanced <= 0) continue;
    const int64_t count = e.index < n->num_slots ? n->counts[e.index] : -1;
    int32_t o3[3] = {0, 0, 0};
    std::string message;
    RollbackOne(n, e, count, v.advanced, v.matcher, o3, &message);
    {
      std::lock_guard<std::mutex> lock(n->mu);
      if (n->slot_gen[e.slot] == v.gen) n->slot_advanced[e.slot] = o3[0] == 0 ? o3[1] : 0;
      if (o3[0] != 0) DropFailed(n, e.slot, v.gen);
    }
    Report(d, e, v.gen, o3, std::move(message));
  }
}

// The rollback of rejected drafts (rollback_rejected_batch): every request of the batch the
// next step runs (the oldest queued job; else the last step run) rolls back to the tokens its
// verification accepted, counts[batch index] (bonus included), clamped to what its matcher
// advanced in its last step, as the capturable decoder's Python rollback clamps them (the
// eager GuidedDecoder fails a count past them by name, but past a draft stop token). Python's
// rollback runs instead after a Python step, for a Python step's batch, and where a slot's
// matcher only Python can run. A warm-up run does nothing. Never throws.
void RunRollback(void* p) {
  HostNode* n = static_cast<NodeLaunch*>(p)->node;
  std::lock_guard<std::mutex> serial(n->run_mu);
  if (n->warmup.load()) return;
  const NodeRange range(1);
  const int64_t t0 = NowNs();
  n->last_start.store(t0);
  n->last_job.store(t0);
  NodeDone d;
  d.kind = kDoneRollback;
  std::vector<NodeEntry> entries;
  bool python;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    if (!n->jobs.empty()) {
      const NodeJob& job = n->jobs.front();
      python = job.python || n->last_python;
      d.epoch = job.epoch;
      if (!python) entries = job.entries;
    } else {
      python = n->last_python;
      d.epoch = n->last_run_epoch;
      if (!python) entries = n->last_entries;
    }
    for (const NodeEntry& e : entries) {  // (a slot's draft tree: Python keeps its path)
      if (n->slot_kind[e.slot] == 2 || n->slot_tree[e.slot]) python = true;
    }
    if (n->draft_open) python = true;  // (it ends the open loop first)
  }
  if (python) {
    RunPython(n, -1);
    std::lock_guard<std::mutex> lock(n->mu);
    n->draft_open = false;
  } else {
    RollbackEntries(n, entries, &d);
  }
  if (!python) {
    std::lock_guard<std::mutex> lock(n->mu);
    n->done.push_back(std::move(d));
  }
  EndRun(n, t0, &n->rollback_runs);
}

// A draft step's build: each request of the loop's batch accepts its draft token (the draft
// buffer's entry at its batch position) and fills its one row (row = batch position), as the
// decoder's build of draft requests does: a refused token or a dead row stops guiding the
// slot for the rest of the loop (not a failure); a fault or a budget overrun fails the
// request (rows unmasked, matcher dropped); a slot already stopped, or whose matcher has
// terminated, is skipped. The advances count toward the slot's draft advances. With `reach`
// (the launch's pruned draft vocabulary, NodeLaunch) a row that allows none of the target
// ids it reaches is left unmasked: a dead end in draft coordinates, whose masked softmax
// would be NaN (the Python build's GuidedDecoder._unguide_unreachable).
void DraftBuild(HostNode* n, const std::vector<NodeEntry>& entries, NodeDone* d,
                int64_t launch_rows, const std::vector<int32_t>& reach) {
  Builder* b = n->builder;
  const int64_t k = static_cast<int64_t>(entries.size());
  std::vector<ObjectRef> refs(static_cast<size_t>(k));
  std::vector<uint64_t> gens(static_cast<size_t>(k));
  {
    std::lock_guard<std::mutex> lock(n->mu);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t slot = entries[i].slot;
      if (n->slot_kind[slot] == 1 && !n->slot_stopped[slot]) refs[i] = n->slot_matcher[slot];
      gens[i] = n->slot_gen[slot];
    }
  }
  int32_t* mask = b->BeginStep(b->bitmask.size(0));  // (the decoder clears every row)
  const int64_t rows = b->bitmask.size(0);
  std::vector<int64_t> runs, tokens, reported;  // entries that run; their tokens
  std::vector<int32_t> out;
  std::vector<std::string> messages;
  for (int64_t i = 0; i < k; ++i) {
    const NodeEntry& e = entries[i];
    d->seen_slots.push_back(e.slot);
    d->seen_gens.push_back(gens[i]);
    const ObjectRef& m = refs[i];
    if (!m.defined()) continue;
    std::string message;
    try {
      if (b->is_terminated(m).cast<bool>()) continue;
    } catch (const std::exception& ex) {
      message = std::string("RuntimeError: is_terminated: ") + ex.what();
    }
    const int64_t token = e.index < n->num_slots ? n->draft_tokens[e.index] : -1;
    if (message.empty() && e.index >= launch_rows) {
      message = PastRows(e.index, e.index + 1, launch_rows);
    } else if (message.empty() && (token < 0 || token >= n->vocab_size)) {
      message = "RequestError: draft step token " + std::to_string(token) + " from the "
                "draft token buffer is outside the vocabulary [0, " +
                std::to_string(n->vocab_size) + ")";
    }
    reported.push_back(i);
    out.insert(out.end(), {message.empty() ? kOk : kFault, 0, 0});
    messages.push_back(std::move(message));
    if (messages.back().empty()) {
      runs.push_back(i);
      tokens.push_back(token);
    }
  }
  const int64_t nrun = static_cast<int64_t>(runs.size());
  std::vector<int32_t> run_out(static_cast<size_t>(nrun * 3), 0);
  const size_t errors_before = b->errors.size();
  // (one row each, its own matcher: the fill pool may split them)
  const bool parallel = b->fill_threads > 1 && nrun >= b->pool_min_requests;
  b->ForEachRequest(nrun, run_out.data(), parallel,
                    [&](int64_t r, Builder::StepClock* clock, std::string* error) {
                      b->RunOne(refs[runs[r]], tokens[r], entries[runs[r]].index, 0, Drafts{},
                                0, rows, mask, run_out.data() + r * 3, clock, error);
                    });
  {  // (as node_take writes Python's: zero for every slot the build saw, then what ran)
    std::lock_guard<std::mutex> lock(n->mu);
    for (int64_t i = 0; i < k; ++i) {
      if (n->slot_gen[entries[i].slot] == gens[i]) n->slot_advanced[entries[i].slot] = 0;
      n->slot_tree[entries[i].slot] = 0;  // (as a step's build)
    }
  }
  size_t next_error = errors_before;
  int64_t r = 0;
  for (size_t q = 0; q < reported.size(); ++q) {
    const int64_t i = reported[q];
    const NodeEntry& e = entries[i];
    int32_t* o3 = out.data() + q * 3;
    if (r < nrun && runs[r] == i) {
      TakeOutcome(n, run_out.data() + r * 3, o3, &messages[q], &next_error);
      ++r;
    }
    const int32_t kind = o3[0] & ~kTerminated;
    {
      std::lock_guard<std::mutex> lock(n->mu);
      const bool current = n->slot_gen[e.slot] == gens[i];
      if (kind == kFault || kind == kOverBudget) {
        if (o3[2] && e.index < rows) mask[e.index] = 0;
        DropFailed(n, e.slot, gens[i]);
      } else if (current) {
        n->slot_advanced[e.slot] = o3[1];
        n->slot_drafted[e.slot] += o3[1];
        if (kind == kRejected || kind == kDeadEnd) n->slot_stopped[e.slot] = 1;
      }
    }
    if (kind == kOk && o3[2] && !reach.empty() && e.index < rows && mask[e.index] &&
        Unreachable(b, e.index, reach)) {
      mask[e.index] = 0;
    }
    if (kind == kOk && o3[2]) d->masked = true;
    Report(d, e, gens[i], o3, std::move(messages[q]));
  }
}

// The end of a drafting loop: every request of the loop's batch rolls back what the loop
// advanced its matcher, and its slot is guided again (a matcher that raises fails its
// request).
void DraftEnd(HostNode* n, const std::vector<NodeEntry>& entries, NodeDone* d) {
  for (const NodeEntry& e : entries) {
    const SlotView v = ReadSlot(n, e.slot);
    int32_t o3[3] = {0, v.drafted, 0};
    std::string message;
    if (v.drafted > 0 && v.matcher.defined()) {
      if (CallRollback(n, v.matcher, v.drafted, &message)) {
        o3[2] = 1;
      } else {
        o3[0] = 2;
      }
    }
    {
      std::lock_guard<std::mutex> lock(n->mu);
      if (n->slot_gen[e.slot] == v.gen) {
        n->slot_drafted[e.slot] = 0;
        n->slot_stopped[e.slot] = 0;
      }
      if (o3[0] != 0) DropFailed(n, e.slot, v.gen);
    }
    Report(d, e, v.gen, o3, std::move(message));
  }
}

// One step of a drafting loop (execute_draft_batch), the loop's step `draft_step`, masking
// `rows` logits rows (a request past them fails, PastRows): at the first, the loop's batch is
// taken off the queue (as a step takes it) and its rejected drafts are rolled back (as
// RunRollback); then the draft step's build (DraftBuild); at the last (the batch's runtime
// draft length decides which, not the launch), the loop's draft advances are rolled back
// (DraftEnd); a step past the last guides nothing. Each part is a record of its own. The loop
// is Python's (the decoder's draft step under the GIL, from its first step to its last) where
// its batch is a Python step's, after a Python step, or where a slot's matcher only Python
// can run. A warm-up run masks nothing and takes nothing. Never throws.
void RunDraft(HostNode* n, const NodeLaunch* l) {
  const int64_t draft_step = l->draft_step, rows = l->rows;
  const std::vector<int32_t>& reach = l->reach;
  std::lock_guard<std::mutex> serial(n->run_mu);
  if (n->warmup.load()) {
    ClearAll(n);
    return;
  }
  const NodeRange range(2);
  const int64_t t0 = NowNs();
  n->last_start.store(t0);
  n->last_job.store(t0);
  const bool first = draft_step == 0;
  std::vector<NodeEntry> entries;
  bool python = false;
  int64_t last = 0;
  if (first) {
    NodeDone pop;
    pop.kind = kDoneDraftPop;
    NodeJob job;
    const bool have = TakeJob(n, &job, &pop);
    {
      std::lock_guard<std::mutex> lock(n->mu);
      python = have && pop.error.empty() &&
               (job.python || n->last_python || n->draft_open || !job.installs.empty() ||
                std::any_of(job.entries.begin(), job.entries.end(), [&](const NodeEntry& e) {
                  return n->slot_kind[e.slot] == 2 || n->slot_tree[e.slot] ||
                         e.fill_only || e.skip;
                }));
      n->draft_python = python;
      n->draft_epoch = job.epoch;
      n->draft_last = std::max<int64_t>(job.draft_len, 1) - 1;
      if (have && pop.error.empty()) n->draft_open = true;
      n->draft_entries.clear();
      if (have && pop.error.empty() && !python) n->draft_entries = job.entries;
      entries = n->draft_entries;
      last = n->draft_last;
      if (!python) n->done.push_back(std::move(pop));  // (Python's loop pops its own)
    }
  } else {
    std::lock_guard<std::mutex> lock(n->mu);
    python = n->draft_python;
    entries = n->draft_entries;
    last = n->draft_last;
  }
  if (python) {
    RunPythonDraft(n, draft_step, l);
    if (draft_step >= last) {
      std::lock_guard<std::mutex> lock(n->mu);
      n->draft_open = false;
    }
  } else if (draft_step > last) {
    ClearAll(n);  // (past the batch's draft length: the loop ended at its last step)
  } else {
    try {
      NodeDone back, build, end;
      back.kind = kDoneRollback;
      build.kind = kDoneDraftBuild;
      end.kind = kDoneDraftEnd;
      back.epoch = build.epoch = end.epoch = n->draft_epoch;
      if (first) RollbackEntries(n, entries, &back);
      DraftBuild(n, entries, &build, rows, reach);
      if (draft_step == last) DraftEnd(n, entries, &end);
      std::lock_guard<std::mutex> lock(n->mu);
      if (first) n->done.push_back(std::move(back));
      n->done.push_back(std::move(build));
      if (draft_step == last) {
        n->done.push_back(std::move(end));
        n->draft_open = false;
      }
    } catch (const std::exception& ex) {  // (BeginStep's bounds: a bug, reported as such)
      NodeDone bug;
      bug.kind = kDoneDraftPop;
      bug.epoch = n->draft_epoch;
      bug.error = std::string("host node draft step: ") + ex.what();
      std::lock_guard<std::mutex> lock(n->mu);
      n->done.push_back(std::move(bug));
    }
  }
  EndRun(n, t0, &n->draft_runs);
}

void RunDraftStep(void* p) {
  const auto* l = static_cast<NodeLaunch*>(p);
  RunDraft(l->node, l);
}

HostNode* NodeArg(PyObject* capsule) {
  return static_cast<HostNode*>(PyCapsule_GetPointer(capsule, kNodeCapsule));
}

// The node of a call `usage` taking `expected` arguments, the node first; nullptr with an
// error set (a TypeError naming `usage` for a wrong count).
HostNode* NodeCall(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t expected,
                   const char* usage) {
  if (nargs != expected) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", usage, expected);
    return nullptr;
  }
  return NodeArg(args[0]);
}


// node_create(fast, buffer, address, positions, fallback, counts, counts_address, rollback,
// rollback_address, rollback_fallback): see the section's comment; the buffers' layouts are
// checked by the caller (capgraph/build/library.py), which hands their data addresses and
// the address of the rollback Function's FFI object.
PyObject* NodeCreate(PyObject*, PyObject* args) {
  PyObject *fast_capsule, *buffer, *fallback, *counts, *rollback, *rollback_fallback, *drafts,
      *draft_fallback, *ticket;
  long long address = 0, positions = 0, counts_address = 0, rollback_address = 0,
            drafts_address = 0, ticket_address = 0, ticket_ring = 0;
  if (!PyArg_ParseTuple(args, "OOLLOOLOLOOLOOLL", &fast_capsule, &buffer, &address, &positions,
                        &fallback, &counts, &counts_address, &rollback, &rollback_address,
                        &rollback_fallback, &drafts, &drafts_address, &draft_fallback, &ticket,
                        &ticket_address, &ticket_ring)) {
    return nullptr;
  }
  BuryNodes();
  auto* st = static_cast<FastState*>(PyCapsule_GetPointer(fast_capsule, kCapsule));
  if (st == nullptr) return nullptr;
  if (!PyCallable_Check(fallback) || !PyCallable_Check(rollback_fallback) ||
      !PyCallable_Check(draft_fallback) || address == 0 || positions < 1 ||
      counts_address == 0 || rollback_address == 0 || drafts_address == 0 ||
      ticket_address == 0 || ticket_ring < 2) {
    PyErr_SetString(PyExc_ValueError, "node_create: callable fallbacks, the buffers' addresses, "
                    "positions >= 1, the rollback Function's address and a ticket ring >= 2 "
                    "are needed");
    return nullptr;
  }
  auto* n = new HostNode();
  n->ticket_buffer = ticket;
  n->ticket = reinterpret_cast<const int32_t*>(static_cast<intptr_t>(ticket_address));
  n->ticket_ring = ticket_ring;
  Py_INCREF(ticket);
  n->draft_buffer = drafts;
  n->draft_tokens = reinterpret_cast<const int32_t*>(static_cast<intptr_t>(drafts_address));
  n->draft_fallback = draft_fallback;
  Py_INCREF(drafts);
  Py_INCREF(draft_fallback);
  n->counts_buffer = counts;
  n->counts = reinterpret_cast<const int32_t*>(static_cast<intptr_t>(counts_address));
  n->rollback_owner = rollback;
  n->rollback = tvm::ffi::detail::ObjectUnsafe::ObjectRefFromObjectPtr<tvm::ffi::Function>(
      tvm::ffi::detail::ObjectUnsafe::ObjectPtrFromUnowned<tvm::ffi::Object>(
          reinterpret_cast<TVMFFIObject*>(static_cast<intptr_t>(rollback_address))));
  n->rollback_fallback = rollback_fallback;
  Py_INCREF(counts);
  Py_INCREF(rollback);
  Py_INCREF(rollback_fallback);
  n->builder = st->builder;
  n->keep = st->keep;
  n->buffer = buffer;
  n->fallback = fallback;
  Py_INCREF(st->keep);
  Py_INCREF(buffer);
  Py_INCREF(fallback);
  n->tokens = reinterpret_cast<const int32_t*>(static_cast<intptr_t>(address));
  n->positions = positions;
  n->num_slots = st->num_slots;
  n->vocab_size = st->vocab_size;
  n->max_drafts = st->max_drafts;
  n->slot_matcher.resize(static_cast<size_t>(n->num_slots));
  n->slot_kind.assign(static_cast<size_t>(n->num_slots), 0);
  n->slot_stopped.assign(static_cast<size_t>(n->num_slots), 0);
  n->slot_advanced.assign(static_cast<size_t>(n->num_slots), 0);
  n->slot_gen.assign(static_cast<size_t>(n->num_slots), 0);
  n->slot_tree.assign(static_cast<size_t>(n->num_slots), 0);
  n->slot_drafted.assign(static_cast<size_t>(n->num_slots), 0);
  n->slot_due.assign(static_cast<size_t>(n->num_slots), 0);
  PyObject* capsule = PyCapsule_New(n, kNodeCapsule, DestroyNode);
  if (capsule == nullptr) {
    NodeRelease(n);
    BuryNodes();
    return nullptr;
  }
  auto addr = [](void (*f)(void*)) {
    return static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(f));
  };
  return Py_BuildValue("(NKKKKK)", capsule, addr(&RunNode), addr(&LaunchRetain),
                       addr(&LaunchRelease), addr(&RunRollback), addr(&RunDraftStep));
}

// node_launch(node, rows, draft_step, reach) -> address: a new launch shape of the node
// (NodeLaunch), the user data to launch its C functions with.
PyObject* NodeLaunchNew(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 4, "node_launch(node, rows, draft_step, reach)");
  if (n == nullptr) return nullptr;
  const long long rows = PyLong_AsLongLong(args[1]);
  if (rows == -1 && PyErr_Occurred()) return nullptr;
  const long long draft_step = PyLong_AsLongLong(args[2]);
  if (draft_step == -1 && PyErr_Occurred()) return nullptr;
  if (rows < 0 || draft_step < -1) {
    PyErr_Format(PyExc_ValueError, "node_launch: rows %lld must be >= 0 and draft_step %lld "
                 ">= -1", rows, draft_step);
    return nullptr;
  }
  std::vector<int32_t> reach;
  if (args[3] != Py_None) {
    if (!PyBytes_CheckExact(args[3]) || PyBytes_GET_SIZE(args[3]) % 4 != 0) {
      PyErr_SetString(PyExc_TypeError, "node_launch: reach must be None or bytes of int32 "
                      "bitmask words");
      return nullptr;
    }
    reach.resize(static_cast<size_t>(PyBytes_GET_SIZE(args[3]) / 4));
    std::memcpy(reach.data(), PyBytes_AS_STRING(args[3]), reach.size() * 4);
  }
  n->launches.push_back(
      std::make_unique<NodeLaunch>(NodeLaunch{n, rows, draft_step, std::move(reach)}));
  return PyLong_FromUnsignedLongLong(
      static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(n->launches.back().get())));
}

// What a node job asks of its caller: the batch indices of the requests whose matchers it
// creates before the step runs (context requests at their last chunk; disaggregated requests'
// first generation step).
struct NodeInits {
  std::vector<int64_t> context, disaggregated;
  std::vector<int64_t> context_slots, disaggregated_slots;  // their slots, in the same order
};

// Read one request of a node job into `job`: false where it is not the plain case (then the
// step is a Python step). `seen`: the slots met so far.
bool PushOne(HostNode* n, FastState* st, PyObject* request_obj, int64_t index, int64_t offset,
             int64_t draft_len, bool from_buffer, std::vector<uint8_t>* seen, NodeJob* job,
             NodeInits* inits) {
  const RequestFields request(st, request_obj);
  Ref params(request.Read(RecordField::kParams));
  if (!params) return false;
  if (params.get() == Py_None) return true;  // unguided: no rows of its own to fill
  {
    Ref is_draft(request.Read(RecordField::kIsDraft));
    if (is_draft.get() != Py_False) return false;
  }
  bool context;
  {
    Ref value(request.Read(RecordField::kContext));
    if (BoolValue(value.get()) < 0) return false;
    context = value.get() == Py_True;
  }
  {
    Ref generating(request.Read(RecordField::kGenerating));
    if (generating.get() != (context ? Py_False : Py_True)) return false;
  }
  bool fill = false;  // a context request whose matcher is created at add_batch
  int first_step = 0;  // a disaggregated first step (its matcher created at add_batch)
  if (context) {
    Ref last(request.Read(RecordField::kLastChunk));
    if (BoolValue(last.get()) < 0) return false;
    fill = last.get() == Py_True;
  } else {
    Ref first(request.Read(RecordField::kFirstIteration));
    first_step = BoolValue(first.get());
    if (first_step < 0) return false;
  }
  if (!ChainRequest(request)) return false;
  int64_t slot;
  {
    Ref value(request.Read(RecordField::kSlot));
    slot = IndexValue(value.get(), n->num_slots);
  }
  if (slot < 0 || (*seen)[slot]) return false;
  if (context) {  // one row; created at add_batch (`fill`) or nothing to do
    (*seen)[slot] = 1;
    if (fill) {
      inits->context.push_back(index);
      inits->context_slots.push_back(slot);
    }
    job->entries.push_back(NodeEntry{slot, -1, offset, static_cast<int64_t>(job->drafts.size()),
                                     0, index, false, fill, !fill});
    return true;
  }
  bool buffered = false;
  if (from_buffer) {
    Ref prev(request.Read(RecordField::kPrevSlot));
    if (!prev) return false;
    buffered = prev.get() != Py_None;
  }
  NodeEntry e{slot, -1, offset, static_cast<int64_t>(job->drafts.size()), 0, index, buffered,
              false, false};
  e.fresh = first_step == 1;
  if (n->max_drafts > 0) {  // (read for the settling of a rollback left out: SettleEntries)
    Ref accepted(request.Read(RecordField::kAccepted));
    e.accepted = !accepted                 ? -1
                 : accepted.get() == Py_None ? 0
                                           : IndexValue(accepted.get(), INT32_MAX);
  }
  if (buffered) {  // the token and drafts of the slot's column, read by the node
    e.num_drafts = std::min<int64_t>(n->positions - 1, draft_len);
  } else {
    Ref value(request.Read(RecordField::kToken));
    e.token = IndexValue(value.get(), n->vocab_size);
    if (e.token < 0) return false;
    Ref drafts(request.Read(RecordField::kDrafts));
    if (!drafts) return false;
    if (drafts.get() != Py_None) {
      PyObject* list = drafts.get();
      if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) > n->max_drafts) return false;
      e.num_drafts = std::min<int64_t>(PyList_GET_SIZE(list), draft_len);
      for (int64_t j = 0; j < e.num_drafts; ++j) {
        const int64_t x = IndexValue(PyList_GET_ITEM(list, j), n->vocab_size);
        if (x < 0) return false;
        job->drafts.push_back(x);
      }
    }
  }
  (*seen)[slot] = 1;
  if (e.fresh) {
    inits->disaggregated.push_back(index);
    inits->disaggregated_slots.push_back(slot);
  }
  job->entries.push_back(e);
  return true;
}

// Python ints of `values`, as a new list (nullptr with an error set).
PyObject* IntList(const std::vector<int64_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t i = 0; list != nullptr && i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) Py_CLEAR(list);
    else PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), v);
  }
  return list;
}

// node_push(node, fast, requests, offsets, draft_len, clear_rows, epoch, from_buffer,
//           ticketed) -> False | (context, disaggregated)
PyObject* NodePush(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9 || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError, "node_push(node, fast, requests: list, offsets: list, "
                    "draft_len, clear_rows, epoch, from_buffer, ticketed)");
    return nullptr;
  }
  HostNode* n = NodeArg(args[0]);
  auto* st = static_cast<FastState*>(PyCapsule_GetPointer(args[1], kCapsule));
  if (n == nullptr || st == nullptr) return nullptr;
  n->repeat_ok = false;  // (set again below where this call queues a job node_repeat can repeat)
  const long long draft_len = PyLong_AsLongLong(args[4]);
  const long long clear_rows = PyLong_AsLongLong(args[5]);
  const long long epoch = PyLong_AsLongLong(args[6]);
  if (PyErr_Occurred()) return nullptr;
  if (draft_len < 0 || clear_rows < 0 || clear_rows > n->builder->bitmask.size(0)) {
    PyErr_Format(PyExc_ValueError, "node_push: draft_len %lld / clear_rows %lld out of range",
                 draft_len, clear_rows);
    return nullptr;
  }
  const bool from_buffer = PyObject_IsTrue(args[7]) == 1;
  NodeJob job;
  job.epoch = epoch;
  job.ticketed = PyObject_IsTrue(args[8]) == 1;
  job.draft_len = draft_len;
  job.clear_rows = clear_rows;
  std::vector<uint8_t> seen(static_cast<size_t>(n->num_slots), 0);
  PyObject* requests = args[2];
  PyObject* offsets = args[3];
  NodeInits inits;
  bool plain = PyList_GET_SIZE(offsets) == PyList_GET_SIZE(requests);
  for (Py_ssize_t i = 0; plain && i < PyList_GET_SIZE(requests); ++i) {
    if (i >= PyList_GET_SIZE(offsets)) {  // (a field's Python code may change the lists)
      plain = false;
      break;
    }
    const int64_t offset = IndexValue(PyList_GET_ITEM(offsets, i), clear_rows + 1);
    plain = offset >= 0 && PushOne(n, st, PyList_GET_ITEM(requests, i), i, offset, draft_len,
                                   from_buffer, &seen, &job, &inits);
  }
  if (!plain) Py_RETURN_FALSE;
  PyObject* result = Py_BuildValue("(NN)", IntList(inits.context),
                                   IntList(inits.disaggregated));
  if (result == nullptr) return nullptr;  // (nothing queued)
  std::vector<int64_t> slots = std::move(inits.context_slots);  // in the order returned
  slots.insert(slots.end(), inits.disaggregated_slots.begin(), inits.disaggregated_slots.end());
  n->repeat_ok = slots.empty() && job.draft_len == 0 && job.drafts.empty();
  for (size_t k = 0; n->repeat_ok && k < job.entries.size(); ++k) {
    const NodeEntry& e = job.entries[k];
    n->repeat_ok = !e.from_buffer && !e.fill_only && !e.skip && !e.fresh && e.num_drafts == 0;
  }
  if (n->repeat_ok) {
    n->repeat_entries = job.entries;
    n->repeat_clear_rows = job.clear_rows;
    n->repeat_batch = PyList_GET_SIZE(requests);
  }
  std::lock_guard<std::mutex> lock(n->mu);
  if (slots.empty()) {
    n->jobs.push_back(std::move(job));
    n->job_cv.notify_all();
  } else {  // (node_commit queues it with the matchers the caller creates)
    n->pending = std::move(job);
    n->pending_slots = std::move(slots);
    n->has_pending = true;
  }
  return result;
}

// The matcher an int handle names (the address of its FFI object, which gains a reference)
// into *out; false with a ValueError naming `who` for a null address.
bool RefFromAddress(PyObject* handle, const char* who, ObjectRef* out) {
  void* address = PyLong_AsVoidPtr(handle);
  if (address == nullptr) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: null handle", who);
    return false;
  }
  *out = tvm::ffi::detail::ObjectUnsafe::ObjectRefFromObjectPtr<ObjectRef>(
      tvm::ffi::detail::ObjectUnsafe::ObjectPtrFromUnowned<tvm::ffi::Object>(
          static_cast<TVMFFIObject*>(address)));
  return true;
}

// node_commit(node, handles): queue the job node_push left pending, with handles[k] the
// matcher created for its k-th init (an FFI object's address, or None where the creation
// failed: the slot is cleared); handles None: queue it as a Python step instead (a matcher
// only Python can run was created).
PyObject* NodeCommit(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 2, "node_commit(node, handles)");
  if (n == nullptr) return nullptr;
  PyObject* handles = args[1];
  std::lock_guard<std::mutex> lock(n->mu);
  if (!n->has_pending) {
    PyErr_SetString(PyExc_RuntimeError, "node_commit: no job is waiting for its matchers");
    return nullptr;
  }
  NodeJob& job = n->pending;
  bool ok = true;  // (a bad handle queues a Python step, so the queues stay in step)
  if (handles != Py_None) {
    if (!PyList_CheckExact(handles) ||
        PyList_GET_SIZE(handles) != static_cast<Py_ssize_t>(n->pending_slots.size())) {
      PyErr_Format(PyExc_TypeError, "node_commit: handles must be a list of %zd handles",
                   static_cast<Py_ssize_t>(n->pending_slots.size()));
      ok = false;
    }
    for (size_t k = 0; ok && k < n->pending_slots.size(); ++k) {
      PyObject* h = PyList_GET_ITEM(handles, static_cast<Py_ssize_t>(k));
      ObjectRef ref;
      if (PyLong_CheckExact(h)) {
        ok = RefFromAddress(h, "node_commit", &ref);
      } else if (h != Py_None) {
        PyErr_SetString(PyExc_TypeError, "node_commit: a handle is an int address or None");
        ok = false;
      }
      if (ok) job.installs.emplace_back(n->pending_slots[k], std::move(ref));
    }
  }
  if (handles == Py_None || !ok) {
    job.python = true;
    job.entries.clear();
    job.drafts.clear();
    job.installs.clear();
  }
  n->jobs.push_back(std::move(job));
  n->job_cv.notify_all();
  n->pending = NodeJob();
  n->pending_slots.clear();
  n->has_pending = false;
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

// node_push_python(node, epoch, ticketed, drops): queue a Python step; drops: the slots its
// batch drops (list of ints), cleared by the node where a queue error consumes the step.
PyObject* NodePushPython(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 4, "node_push_python(node, epoch, ticketed, drops)");
  if (n == nullptr) return nullptr;
  const long long epoch = PyLong_AsLongLong(args[1]);
  if (epoch == -1 && PyErr_Occurred()) return nullptr;
  n->repeat_ok = false;
  NodeJob job;
  job.epoch = epoch;
  job.python = true;
  job.ticketed = PyObject_IsTrue(args[2]) == 1;
  if (!PyList_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "node_push_python: drops must be a list of slots");
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(args[3]); ++k) {
    const int64_t slot = IndexValue(PyList_GET_ITEM(args[3], k), n->num_slots);
    if (slot < 0) {
      PyErr_Format(PyExc_IndexError, "node_push_python: drop %R is not a slot in [0, %lld)",
                   PyList_GET_ITEM(args[3], k), static_cast<long long>(n->num_slots));
      return nullptr;
    }
    job.drops.push_back(slot);
  }
  std::lock_guard<std::mutex> lock(n->mu);
  n->jobs.push_back(std::move(job));
  n->job_cv.notify_all();
  Py_RETURN_NONE;
}

// node_repeat(node, tokens, epoch, ticketed) -> bool: queue the job node_push queued last
// again as `epoch`'s, each entry's token tokens[its batch index] (a list, one item per request
// of the batch); False (nothing queued) where that job cannot be repeated (it was not every
// request generating with its token and no drafts, or another job was queued since) or a
// token it reads is not an exact int in the vocabulary: the caller then queues the step as
// add_batch does, which fails such a request alone.
PyObject* NodeRepeat(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 4, "node_repeat(node, tokens, epoch, ticketed)");
  if (n == nullptr) return nullptr;
  PyObject* tokens = args[1];
  if (!PyList_CheckExact(tokens)) {
    PyErr_SetString(PyExc_TypeError, "node_repeat: tokens must be a list");
    return nullptr;
  }
  const long long epoch = PyLong_AsLongLong(args[2]);
  if (epoch == -1 && PyErr_Occurred()) return nullptr;
  if (!n->repeat_ok || PyList_GET_SIZE(tokens) != n->repeat_batch) Py_RETURN_FALSE;
  NodeJob job;
  job.epoch = epoch;
  job.ticketed = PyObject_IsTrue(args[3]) == 1;
  job.clear_rows = n->repeat_clear_rows;
  job.entries = n->repeat_entries;
  for (NodeEntry& e : job.entries) {
    e.token = IndexValue(PyList_GET_ITEM(tokens, e.index), n->vocab_size);
    if (e.token < 0) Py_RETURN_FALSE;
  }
  std::lock_guard<std::mutex> lock(n->mu);
  n->jobs.push_back(std::move(job));
  n->job_cv.notify_all();
  Py_RETURN_TRUE;
}

// The slot a node call names (an exact int in [0, num_slots)); -1 with an IndexError set
// where it is none.
int64_t SlotArg(HostNode* n, PyObject* arg, const char* fn) {
  const int64_t slot = IndexValue(arg, n->num_slots);
  if (slot < 0) {
    PyErr_Format(PyExc_IndexError, "%s: slot %R is outside [0, %lld)", fn, arg,
                 static_cast<long long>(n->num_slots));
  }
  return slot;
}

// node_forget_slot(node, slot) -> int: the queued jobs (not yet taken by a step) run nothing
// for `slot` (its request was released before its step): their entries there are skipped
// and their matchers for it not installed; node_repeat stops repeating the last job. Returns
// how many entries and installs it took out.
PyObject* NodeForgetSlot(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 2, "node_forget_slot(node, slot)");
  if (n == nullptr) return nullptr;
  const int64_t slot = SlotArg(n, args[1], "node_forget_slot");
  if (slot < 0) return nullptr;
  std::vector<ObjectRef> dropped;  // (destroyed after the lock)
  long long changed = 0;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    for (NodeJob& job : n->jobs) {
      for (NodeEntry& e : job.entries) {
        if (e.slot == slot && !e.skip) {
          e.skip = true;
          e.fill_only = e.fresh = false;
          ++changed;
        }
      }
      auto& installs = job.installs;
      for (auto it = installs.begin(); it != installs.end();) {
        if (it->first == slot) {
          dropped.push_back(std::move(it->second));
          it = installs.erase(it);
          ++changed;
        } else {
          ++it;
        }
      }
    }
    n->repeat_ok = false;
  }
  return PyLong_FromLongLong(changed);
}

// node_drop(node, newest) -> bool: forget the oldest queued job, or the newest (False: none
// was queued).
PyObject* NodeDrop(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 2, "node_drop(node, newest)");
  if (n == nullptr) return nullptr;
  const bool newest = PyObject_IsTrue(args[1]) == 1;
  NodeJob job;  // (its destruction after the lock)
  {
    std::lock_guard<std::mutex> lock(n->mu);
    if (n->jobs.empty()) Py_RETURN_FALSE;
    if (newest) {
      job = std::move(n->jobs.back());
      n->jobs.pop_back();
      if (n->jobs.empty()) n->last_epoch = job.epoch;
    } else {
      job = std::move(n->jobs.front());
      n->jobs.pop_front();
      n->last_epoch = job.epoch;
    }
  }
  Py_RETURN_TRUE;
}

// node_set_slot(node, slot, handle, stopped): what a step runs for `slot` from now on.
PyObject* NodeSetSlot(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 4, "node_set_slot(node, slot, handle, stopped)");
  if (n == nullptr) return nullptr;
  const int64_t slot = SlotArg(n, args[1], "node_set_slot");
  if (slot < 0) return nullptr;
  PyObject* handle = args[2];
  ObjectRef ref;
  uint8_t kind = 0;
  if (PyLong_CheckExact(handle)) {
    if (!RefFromAddress(handle, "node_set_slot", &ref)) return nullptr;
    kind = 1;
  } else if (handle != Py_None) {
    kind = 2;
  }
  const uint8_t stopped = PyObject_IsTrue(args[3]) == 1;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    // what a run of the slot's old handle reports is not the new one's (a Python-only
    // handle cannot be told apart: always new); the count stands (a hand-over that settles
    // keeps its matcher's advances) but for no matcher, which is how Python clears a slot
    // before it creates a matcher or after a failure
    if (kind != n->slot_kind[slot] || kind == 2 || !n->slot_matcher[slot].same_as(ref)) {
      ++n->slot_gen[slot];
    }
    if (kind == 0) n->slot_advanced[slot] = 0;
    std::swap(n->slot_matcher[slot], ref);  // (the old reference goes after the lock)
    n->slot_kind[slot] = kind;
    n->slot_stopped[slot] = stopped;
  }
  Py_RETURN_NONE;
}

// Append the int v to list (false with an error set).
bool AppendInt(PyObject* list, int64_t v) {
  PyObject* item = PyLong_FromLongLong(v);
  const bool ok = item != nullptr && PyList_Append(list, item) == 0;
  Py_XDECREF(item);
  return ok;
}

// One NodeDone as node_take's tuple, its counters written to the lists where the slot's
// matcher generation is still the run's (gen_now); nullptr with an error set.
PyObject* DoneTuple(const HostNode* n, const NodeDone& d, const std::vector<uint64_t>& gen_now,
                    PyObject* advanced, PyObject* guided, PyObject* drafted) {
  auto set = [](PyObject* list, int64_t slot, int32_t value) {
    if (slot < PyList_GET_SIZE(list)) SetCount(list, slot, value);
  };
  for (size_t k = 0; k < d.seen_slots.size(); ++k) {
    const int64_t slot = d.seen_slots[k];
    if (gen_now[slot] != d.seen_gens[k]) continue;  // (a run of the slot's old matcher)
    set(advanced, slot, 0);
    set(guided, slot, 0);
  }
  for (int64_t slot : d.installed) {  // (a slot reused since shows its later generation)
    if (slot < PyList_GET_SIZE(drafted)) SetCount(drafted, slot, 0);
  }
  const bool rolls = d.kind == kDoneRollback || d.kind == kDoneDraftEnd || !d.settled.empty();
  Ref unusual(Py_None);
  Py_INCREF(Py_None);
  std::vector<int64_t> stale;  // the unusual requests whose slot has another matcher by now
  std::vector<int64_t> wanted;  // every unusual request's batch index (their columns go back)
  Ref rolled(rolls ? PyList_New(0) : (Py_INCREF(Py_None), Py_None));
  if (!rolled) return nullptr;
  for (size_t k = 0; k < d.settled.size(); ++k) {  // (a step's settling: SettleEntries)
    const int64_t slot = d.settled[k];
    if (gen_now[slot] == d.settled_gens[k] && !AppendInt(rolled.get(), slot)) return nullptr;
  }
  for (size_t k = 0; k < d.slots.size(); ++k) {
    const int32_t* o = d.out.data() + k * 3;
    const int64_t slot = d.slots[k];
    const bool current = gen_now[slot] == d.gens[k];
    if (current) {
      switch (d.kind) {
        case kDoneRollback:  // o: status, kept, rolled back
          if (o[0] == 0) set(advanced, slot, o[1]);
          if (o[2] && !AppendInt(rolled.get(), slot)) return nullptr;
          break;
        case kDoneDraftEnd:  // o: status, draft advances, rolled back
          if (slot < PyList_GET_SIZE(drafted)) SetCount(drafted, slot, 0);
          if (!AppendInt(rolled.get(), slot)) return nullptr;
          break;
        default:  // a step or a draft build: o: status, accepted, guided
          if (o[1]) set(advanced, slot, o[1]);
          if (o[2]) set(guided, slot, o[2]);
          if (d.kind == kDoneDraftBuild && o[1] && (o[0] & ~kTerminated) != kFault &&
              slot < PyList_GET_SIZE(drafted)) {
            PyObject* was = PyList_GET_ITEM(drafted, slot);
            const long before = PyLong_Check(was) ? PyLong_AsLong(was) : 0;
            if (before == -1 && PyErr_Occurred()) PyErr_Clear();
            SetCount(drafted, slot, static_cast<int32_t>(std::max<long>(before, 0) + o[1]));
          }
      }
    }
    if (o[0] == kOk) continue;
    if (!current) stale.push_back(d.index[k]);
    wanted.push_back(d.index[k]);
    if (unusual.get() == Py_None) {
      unusual = Ref(PyList_New(0));
      if (!unusual) return nullptr;
    }
    const std::string& text = d.messages[k];
    Ref item(text.empty()
                 ? Py_BuildValue("(LiO)", static_cast<long long>(d.index[k]), o[0], Py_None)
                 : Py_BuildValue("(Lis#)", static_cast<long long>(d.index[k]), o[0],
                                 text.data(), static_cast<Py_ssize_t>(text.size())));
    if (!item || PyList_Append(unusual.get(), item.get()) < 0) return nullptr;
  }
  Ref columns(Py_None);
  Py_INCREF(Py_None);
  if (!d.columns.empty() && !wanted.empty()) {
    std::sort(wanted.begin(), wanted.end());  // (for the lookup below)
    columns = Ref(PyList_New(0));
    if (!columns) return nullptr;
    const size_t width = static_cast<size_t>(n->positions) + 1;
    for (size_t at = 0; at + width <= d.columns.size(); at += width) {
      if (!std::binary_search(wanted.begin(), wanted.end(), d.columns[at])) continue;
      Ref values(PyList_New(n->positions));
      if (!values) return nullptr;
      for (int64_t p = 0; p < n->positions; ++p) {
        PyObject* v = PyLong_FromLongLong(d.columns[at + 1 + p]);
        if (v == nullptr) return nullptr;
        PyList_SET_ITEM(values.get(), p, v);
      }
      Ref item(Py_BuildValue("(LO)", static_cast<long long>(d.columns[at]), values.get()));
      if (!item || PyList_Append(columns.get(), item.get()) < 0) return nullptr;
    }
  }
  Ref stale_tuple(PyTuple_New(static_cast<Py_ssize_t>(stale.size())));  // (() when none)
  if (!stale_tuple) return nullptr;
  for (size_t k = 0; k < stale.size(); ++k) {
    PyObject* v = PyLong_FromLongLong(stale[k]);
    if (v == nullptr) return nullptr;
    PyTuple_SET_ITEM(stale_tuple.get(), static_cast<Py_ssize_t>(k), v);
  }
  Ref error(d.error.empty() ? (Py_INCREF(Py_None), Py_None)
                            : PyUnicode_DecodeUTF8(d.error.data(),
                                                   static_cast<Py_ssize_t>(d.error.size()),
                                                   "replace"));
  if (!error) return nullptr;
  return Py_BuildValue("(iLOOOOOO)", d.kind, static_cast<long long>(d.epoch), error.get(),
                       d.masked ? Py_True : Py_False, unusual.get(), columns.get(),
                       rolled.get(), stale_tuple.get());
}

// node_take(node, advanced, guided, drafted): see the section's comment.
PyObject* NodeTake(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
      !PyList_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "node_take(node, advanced: list, guided: list, drafted: list)");
    return nullptr;
  }
  HostNode* n = NodeArg(args[0]);
  if (n == nullptr) return nullptr;
  BuryNodes();
  std::deque<NodeDone> done;
  std::vector<uint64_t> gen_now;  // each slot's matcher generation now
  {
    std::lock_guard<std::mutex> lock(n->mu);
    done.swap(n->done);
    gen_now = n->slot_gen;
  }
  Ref result(PyList_New(0));
  if (!result) return nullptr;
  for (const NodeDone& d : done) {
    Ref item(DoneTuple(n, d, gen_now, args[1], args[2], args[3]));
    if (!item || PyList_Append(result.get(), item.get()) < 0) return nullptr;
  }
  return result.release();
}

// Whether reading the record would change nothing on the host side but counters and which
// batch ran (node_pending).
bool PlainStep(const NodeDone& d) {
  if (d.kind != kDoneStep || !d.error.empty() || !d.installed.empty() || !d.settled.empty()) {
    return false;
  }
  for (size_t k = 0; k < d.slots.size(); ++k) {
    if (d.out[k * 3] != kOk) return false;
  }
  return true;
}

// node_pending(node): see the section's comment.
PyObject* NodePending(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 1, "node_pending(node)");
  if (n == nullptr) return nullptr;
  long long records = 0, latest = -1;
  bool plain = true;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    records = static_cast<long long>(n->done.size());
    if (!n->done.empty()) latest = static_cast<long long>(n->done.back().epoch);
    for (const NodeDone& d : n->done) {
      if (!PlainStep(d)) {
        plain = false;
        break;
      }
    }
  }
  return Py_BuildValue("(LLO)", records, latest, plain ? Py_True : Py_False);
}

// node_stats(node) -> (runs, python_runs, last_start_ns, last_end_ns, busy_ns, rows,
//                      rollback_runs, python_rollback_runs, draft_runs, python_draft_runs,
//                      last_job_ns)
PyObject* NodeStats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 1, "node_stats(node)");
  if (n == nullptr) return nullptr;
  return Py_BuildValue("(LLLLLLLLLLL)", static_cast<long long>(n->runs.load()),
                       static_cast<long long>(n->python_runs.load()),
                       static_cast<long long>(n->last_start.load()),
                       static_cast<long long>(n->last_end.load()),
                       static_cast<long long>(n->busy_ns.load()),
                       static_cast<long long>(n->rows.load()),
                       static_cast<long long>(n->rollback_runs.load()),
                       static_cast<long long>(n->python_rollback_runs.load()),
                       static_cast<long long>(n->draft_runs.load()),
                       static_cast<long long>(n->python_draft_runs.load()),
                       static_cast<long long>(n->last_job.load()));
}

// The ints of a list of num_slots counts, clamped to [0, INT32_MAX]; false with an error set.
bool CountList(const HostNode* n, PyObject* list, const char* name, std::vector<int32_t>* out) {
  if (!PyList_Check(list) || PyList_GET_SIZE(list) != n->num_slots) {
    PyErr_Format(PyExc_TypeError, "node_sync_counts: %s must be a list of %lld ints", name,
                 static_cast<long long>(n->num_slots));
    return false;
  }
  out->resize(static_cast<size_t>(n->num_slots));
  for (int64_t slot = 0; slot < n->num_slots; ++slot) {
    const long v = PyLong_AsLong(PyList_GET_ITEM(list, slot));
    if (v == -1 && PyErr_Occurred()) return false;
    (*out)[slot] = static_cast<int32_t>(std::max<long>(0, std::min<long>(v, INT32_MAX)));
  }
  return true;
}

// node_sync_counts(node, advanced, drafted, trees, due): the node's per-slot advance and
// draft-advance counts from Python's lists (after a Python stage, whose counters are then the
// decoder's), its draft-tree flags from Python's per-slot trees (None: no tree), and its due
// slots (SettleEntries) from Python's iterable of slots.
PyObject* NodeSyncCounts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 5,
                         "node_sync_counts(node, advanced, drafted, trees, due)");
  if (n == nullptr) return nullptr;
  std::vector<int32_t> advanced, drafted;
  if (!CountList(n, args[1], "advanced", &advanced) ||
      !CountList(n, args[2], "drafted", &drafted)) {
    return nullptr;
  }
  PyObject* trees = args[3];
  if (!PyList_Check(trees) || PyList_GET_SIZE(trees) != n->num_slots) {
    PyErr_Format(PyExc_TypeError, "node_sync_counts: trees must be a list of %lld entries",
                 static_cast<long long>(n->num_slots));
    return nullptr;
  }
  std::vector<uint8_t> tree(static_cast<size_t>(n->num_slots));
  for (int64_t slot = 0; slot < n->num_slots; ++slot) {
    tree[slot] = PyList_GET_ITEM(trees, slot) != Py_None;
  }
  std::vector<uint8_t> due(static_cast<size_t>(n->num_slots), 0);
  {
    Ref items(PyObject_GetIter(args[4]));
    if (!items) return nullptr;
    while (PyObject* item = PyIter_Next(items.get())) {
      const int64_t slot = IndexValue(item, n->num_slots);
      Py_DECREF(item);
      if (slot < 0) {
        PyErr_Format(PyExc_ValueError, "node_sync_counts: due holds a slot outside [0, %lld)",
                     static_cast<long long>(n->num_slots));
        return nullptr;
      }
      due[slot] = 1;
    }
    if (PyErr_Occurred()) return nullptr;
  }
  std::lock_guard<std::mutex> lock(n->mu);
  n->slot_advanced.swap(advanced);
  n->slot_drafted.swap(drafted);
  n->slot_tree.swap(tree);
  n->slot_due.swap(due);
  Py_RETURN_NONE;
}

// node_due(node) -> [slot, ...]: the slots due now (SettleEntries), for a Python stage.
PyObject* NodeDue(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 1, "node_due(node)");
  if (n == nullptr) return nullptr;
  std::vector<int64_t> due;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    for (int64_t slot = 0; slot < n->num_slots; ++slot) {
      if (n->slot_due[slot]) due.push_back(slot);
    }
  }
  return IntList(due);
}

// node_set_warmup(node, on): whether the node's runs are warm-up runs (see RunNode).
PyObject* NodeSetWarmup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 2, "node_set_warmup(node, on)");
  if (n == nullptr) return nullptr;
  n->warmup.store(PyObject_IsTrue(args[1]) == 1);
  Py_RETURN_NONE;
}

// node_set_epoch(node, epoch): the epoch of the latest batch consumed (the next job's is one more).
PyObject* NodeSetEpoch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 2, "node_set_epoch(node, epoch)");
  if (n == nullptr) return nullptr;
  const long long epoch = PyLong_AsLongLong(args[1]);
  if (epoch == -1 && PyErr_Occurred()) return nullptr;
  std::lock_guard<std::mutex> lock(n->mu);
  n->last_epoch = epoch;
  Py_RETURN_NONE;
}

// node_set_batch_wait(node, ms, epoch): see the section's comment.
PyObject* NodeSetBatchWait(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 3, "node_set_batch_wait(node, ms, epoch)");
  if (n == nullptr) return nullptr;
  const long long ms = PyLong_AsLongLong(args[1]);
  if (ms == -1 && PyErr_Occurred()) return nullptr;
  long long epoch = -1;
  if (args[2] != Py_None) {
    epoch = PyLong_AsLongLong(args[2]);
    if (epoch == -1 && PyErr_Occurred()) return nullptr;
  }
  if (ms < 0 || (args[2] != Py_None && epoch < 0)) {
    PyErr_Format(PyExc_ValueError, "node_set_batch_wait: %lld ms / epoch %lld is negative", ms,
                 epoch);
    return nullptr;
  }
  std::deque<NodeJob> dropped;  // (destroyed after the lock, with the matchers released)
  NodeJob released;
  {
    std::lock_guard<std::mutex> lock(n->mu);
    n->batch_wait_ms = ms;
    if (args[2] != Py_None) {
      ConsumeQueue(n, &dropped, &released);
      n->last_epoch = epoch;
      n->wait_stopped = -1;
    }
    n->job_cv.notify_all();
  }
  Py_RETURN_NONE;
}

// node_batch_wait_stopped(node) -> bool: see the section's comment.
PyObject* NodeBatchWaitStopped(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HostNode* n = NodeCall(args, nargs, 1, "node_batch_wait_stopped(node)");
  if (n == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(n->mu);
  return PyBool_FromLong(n->wait_stopped >= 0);
}

// node_shutdown(): refuse Python steps from now on (registered at interpreter exit).
PyObject* NodeShutdown(PyObject*, PyObject* const*, Py_ssize_t) {
  g_node_shutdown.store(true);
  Py_RETURN_NONE;
}

PyMethodDef g_methods[] = {
    {"make_fast", reinterpret_cast<PyCFunction>(MakeFast), METH_VARARGS,
     "Bind a host builder to a decoder's per-slot lists and its request type's fields."},
    {"fast_admit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastAdmit)),
     METH_FASTCALL, "How many leading requests pass the decoder's inline admission test."},
    {"fast_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastStep)),
     METH_FASTCALL, "Run a steady-state build step, or return None (see python_entry.cc)."},
    {"fast_begin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastBegin)),
     METH_FASTCALL, "Start a steady-state build step on the state's thread: True, or None."},
    {"fast_end", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastEnd)),
     METH_FASTCALL, "Wait for the step fast_begin started and return fast_step's result."},
    {"fast_close", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(FastClose)),
     METH_FASTCALL, "End the state's build thread (fast_begin starts it again)."},
    {"node_create", reinterpret_cast<PyCFunction>(NodeCreate), METH_VARARGS,
     "Create a native host node bound to a fast state and a token buffer."},
    {"node_launch",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeLaunchNew)), METH_FASTCALL,
     "A launch shape of the node (its logits rows, a draft step's index): its address."},
    {"node_push", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodePush)),
     METH_FASTCALL, "Queue a step's native job, or return False (a Python step)."},
    {"node_commit", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeCommit)),
     METH_FASTCALL, "Queue the job node_push left waiting for its matchers."},
    {"node_push_python",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodePushPython)),
     METH_FASTCALL, "Queue a Python step."},
    {"node_repeat", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeRepeat)),
     METH_FASTCALL, "Queue the last plain job again with new tokens, or return False."},
    {"node_drop", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeDrop)),
     METH_FASTCALL, "Forget the oldest queued job."},
    {"node_forget_slot",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeForgetSlot)),
     METH_FASTCALL, "Queued jobs run nothing for a slot."},
    {"node_set_slot", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeSetSlot)),
     METH_FASTCALL, "Set what a step runs for a slot."},
    {"node_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeTake)),
     METH_FASTCALL, "The steps the node ended since the last call."},
    {"node_pending",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodePending)), METH_FASTCALL,
     "How many records node_take would return, the newest's epoch, whether all are plain."},
    {"node_stats", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeStats)),
     METH_FASTCALL, "Counters and timestamps of the node's runs."},
    {"node_sync_counts",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeSyncCounts)),
     METH_FASTCALL, "Copy Python's per-slot advance counts into the node."},
    {"node_due", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeDue)),
     METH_FASTCALL, "The slots whose rollback of rejected drafts is due."},
    {"node_set_warmup",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeSetWarmup)), METH_FASTCALL,
     "Make the node's runs warm-up runs (no job, no mask) or not."},
    {"node_set_epoch",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeSetEpoch)), METH_FASTCALL,
     "Set the epoch of the latest batch consumed."},
    {"node_set_batch_wait",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeSetBatchWait)),
     METH_FASTCALL, "How long a step that finds no batch waits for add_batch (ms; 0: not)."},
    {"node_batch_wait_stopped",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeBatchWaitStopped)),
     METH_FASTCALL, "Whether a step's wait for its batch ran out (the mode stopped)."},
    {"node_shutdown",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(NodeShutdown)), METH_FASTCALL,
     "Refuse Python steps from now on (interpreter exit)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef g_module = {PyModuleDef_HEAD_INIT, "capgraph_host_build",
                        "capgraph's host build loop, called from Python without a Python loop.",
                        -1, g_methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

extern "C" __attribute__((visibility("default"))) PyObject* PyInit_capgraph_host_build() {
  return PyModule_Create(&g_module);
}
#endif  // CAPGRAPH_WITH_PYTHON
