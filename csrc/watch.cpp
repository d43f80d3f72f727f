// What dpmethods/processes/state.py's Watch reads of a module, in one pass each:
// _tensor_states (each parameter's and buffer's version counter, storage, shape,
// strides, dtype, device and requires_grad), _dict_versions (the version of each
// of its submodules' dicts) and _identities (each submodule's class and __dict__).
//
// Before each batch of a map on worker processes, the caller checks that the
// module did not change since its workers got it. In Python that is six
// attribute reads per tensor and a call per dict and submodule, about a
// millisecond for a model of 2,000 tensors; here a few nanoseconds each. The
// values are packed into bytes (a record): two looks agree exactly when the
// bytes do, and a later look compares with the record as it reads, in place.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace dpmethods {
namespace {

// Where a look's values go: packed into a record (the first look), or compared one by
// one with a record (every later look: no allocation, and it stops at the first
// difference).
struct Packer {
  std::vector<int64_t>& out;
  bool put(int64_t v) {
    out.push_back(v);
    return true;
  }
};

// A look at a large model reads thousands of objects scattered in memory, most of them
// out of cache by the next batch: the readers are bound by cache misses, not by their
// work per item. So each asks for the memory of the items a few places ahead (a hint,
// never a read), and the misses of several items overlap.
constexpr Py_ssize_t kAhead = 8;

inline void prefetch(const void* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p);
#else
  (void)p;
#endif
}

// Before reading tensor i: the Python object 2 * kAhead ahead; the TensorImpl of the
// one kAhead ahead (its object fetched by then); and what the TensorImpl of the one
// kAhead / 2 ahead points to (its autograd meta, its storage).
void prefetch_tensors(PyObject* const* items, Py_ssize_t n, Py_ssize_t i) {
  if (i + 2 * kAhead < n) {
    prefetch(items[i + 2 * kAhead]);
  }
  if (i + kAhead < n && THPVariable_CheckExact(items[i + kAhead])) {
    const char* impl = reinterpret_cast<const char*>(THPVariable_Unpack(items[i + kAhead]).unsafeGetTensorImpl());
    for (size_t line = 0; line < sizeof(c10::TensorImpl); line += 64) {
      prefetch(impl + line);
    }
  }
  if (i + kAhead / 2 < n && THPVariable_CheckExact(items[i + kAhead / 2])) {
    const c10::TensorImpl* impl = THPVariable_Unpack(items[i + kAhead / 2]).unsafeGetTensorImpl();
    prefetch(impl->autograd_meta());
    prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  }
}

struct Comparer {
  const int64_t* at;
  const int64_t* end;
  bool put(int64_t v) { return at != end && *at++ == v; }
};

template <typename Sink>
bool put_state(const at::Tensor& t, Sink& sink) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  // Raises for an inference tensor (it has no version counter), as Tensor._version does.
  if (!sink.put(static_cast<int64_t>(torch::autograd::impl::version_counter(t).current_version()))) {
    return false;
  }
  const bool stored = impl->has_storage();
  const c10::Device device = impl->device();
  const bool same =
      sink.put(stored ? reinterpret_cast<int64_t>(impl->storage().unsafeGetStorageImpl()) : 0) &&
      sink.put(stored ? reinterpret_cast<int64_t>(impl->storage().data()) : 0) &&
      sink.put(impl->storage_offset()) &&
      sink.put(static_cast<int64_t>(impl->dtype().toScalarType()) |
               (static_cast<int64_t>(impl->layout()) << 8) | (static_cast<int64_t>(device.type()) << 16) |
               ((static_cast<int64_t>(device.index()) & 0xffff) << 24) |
               (static_cast<int64_t>(impl->requires_grad()) << 40) |
               (static_cast<int64_t>(impl->is_conj()) << 41) | (static_cast<int64_t>(impl->is_neg()) << 42));
  if (!same) {
    return false;
  }
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  if (!sink.put(static_cast<int64_t>(sizes.size()))) {
    return false;
  }
  for (const int64_t s : sizes) {
    if (!sink.put(s)) {
      return false;
    }
  }
  for (const int64_t s : strides) {
    if (!sink.put(s)) {
      return false;
    }
  }
  return true;
}

// ``obj``'s tensor where it is a plain tensor or parameter with a strided layout,
// else nullptr (a tensor subclass, a sparse one: read in Python).
const at::Tensor* plain_tensor(PyObject* obj) {
  if (!THPVariable_Check(obj)) {
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || t.unsafeGetTensorImpl()->is_python_dispatch()) {
    return nullptr;
  }
  return &t;
}

// A reader's arguments (seq[, record]): -1 (a TypeError set) for others; 0 when seq is
// not a list or tuple (the reader returns None); 1 with its items (no copy: nothing that
// reads them calls back into Python, so the sequence cannot change meanwhile).
int reader_input(const char* name, PyObject* const* args, Py_ssize_t nargs, PyObject*** items, Py_ssize_t* n,
                 PyObject** record) {
  if (nargs < 1 || nargs > 2) {
    PyErr_Format(PyExc_TypeError, "%s: expected 1 or 2 arguments (seq[, record]), got %zd", name, nargs);
    return -1;
  }
  *record = nargs == 2 && args[1] != Py_None ? args[1] : nullptr;
  if (*record != nullptr && !PyBytes_CheckExact(*record)) {
    PyErr_Format(PyExc_TypeError, "%s: record: expected bytes or None, got %s", name, Py_TYPE(*record)->tp_name);
    return -1;
  }
  PyObject* seq = args[0];
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    return 0;
  }
  *n = PySequence_Fast_GET_SIZE(seq);
  *items = PySequence_Fast_ITEMS(seq);
  return 1;
}

// ``out`` packed in bytes (no record given), or whether it equals ``record``.
template <typename Word>
PyObject* packed_or_equal(const std::vector<Word>& out, PyObject* record) {
  const auto nbytes = static_cast<Py_ssize_t>(out.size() * sizeof(Word));
  if (record == nullptr) {
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()), nbytes);
  }
  return PyBool_FromLong(PyBytes_GET_SIZE(record) == nbytes &&
                         std::memcmp(PyBytes_AS_STRING(record), out.data(), static_cast<size_t>(nbytes)) == 0);
}

}  // namespace

// _tensor_states(tensors[, record]) -> bytes | bool, for a list or tuple of plain
// tensors and parameters: their states packed in bytes (a record), or with a record,
// whether the states equal it; None for anything else (a tensor subclass: the caller
// reads it in Python). Raises what reading a tensor raises (an inference tensor's
// version).
PyObject* tensor_states(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  PyObject* record = nullptr;
  const int input = reader_input("_tensor_states", args, nargs, &items, &n, &record);
  if (input < 0) {
    return nullptr;
  }
  if (input == 0) {
    Py_RETURN_NONE;
  }
  if (record != nullptr) {
    const auto* at = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(record));
    Comparer sink{at, at + PyBytes_GET_SIZE(record) / static_cast<Py_ssize_t>(sizeof(int64_t))};
    for (Py_ssize_t i = 0; i < n; ++i) {
      prefetch_tensors(items, n, i);
      const at::Tensor* t = plain_tensor(items[i]);
      if (t == nullptr) {
        Py_RETURN_NONE;
      }
      if (!put_state(*t, sink)) {
        Py_RETURN_FALSE;
      }
    }
    return PyBool_FromLong(sink.at == sink.end && PyBytes_GET_SIZE(record) % sizeof(int64_t) == 0);
  }
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n) * 10);
  Packer sink{out};
  for (Py_ssize_t i = 0; i < n; ++i) {
    prefetch_tensors(items, n, i);
    const at::Tensor* t = plain_tensor(items[i]);
    if (t == nullptr) {
      Py_RETURN_NONE;
    }
    put_state(*t, sink);
  }
  return packed_or_equal(out, nullptr);
  END_HANDLE_TH_ERRORS
}

// _dict_versions(dicts[, record]) -> bytes | bool: each dict's version tag (a new one
// at every change to the dict), for a list or tuple of dicts, packed in bytes, or with
// a record, whether they equal it; None where this Python has no per-dict version
// (3.14 and later) or an item is not a dict.
PyObject* dict_versions(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  PyObject* record = nullptr;
  const int input = reader_input("_dict_versions", args, nargs, &items, &n, &record);
  if (input < 0) {
    return nullptr;
  }
#if PY_VERSION_HEX >= 0x030E0000
  (void)items, (void)n, (void)record;
  Py_RETURN_NONE;
#else
  if (input == 0) {
    Py_RETURN_NONE;
  }
  std::vector<uint64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      prefetch(items[i + kAhead]);
    }
    if (!PyDict_Check(items[i])) {
      Py_RETURN_NONE;
    }
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
    out[static_cast<size_t>(i)] = reinterpret_cast<PyDictObject*>(items[i])->ma_version_tag;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
  }
  return packed_or_equal(out, record);
#endif
}

// _identities(objects[, record]) -> bytes | bool: each object's class and __dict__, by
// address, packed in bytes, or with a record, whether they equal it (the caller keeps
// both alive, so an address is never reused while it compares).
PyObject* identities(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  PyObject* record = nullptr;
  const int input = reader_input("_identities", args, nargs, &items, &n, &record);
  if (input < 0) {
    return nullptr;
  }
  if (input == 0) {
    Py_RETURN_NONE;
  }
  std::vector<uintptr_t> out(static_cast<size_t>(2 * n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      prefetch(items[i + kAhead]);
    }
    // The instance's own dict, without looking up the __dict__ attribute on its class.
    PyObject* d = PyObject_GenericGetDict(items[i], nullptr);
    if (d == nullptr) {
      return nullptr;
    }
    out[static_cast<size_t>(2 * i)] = reinterpret_cast<uintptr_t>(Py_TYPE(items[i]));
    out[static_cast<size_t>(2 * i + 1)] = reinterpret_cast<uintptr_t>(d);
    Py_DECREF(d);
  }
  return packed_or_equal(out, record);
}

}  // namespace dpmethods
