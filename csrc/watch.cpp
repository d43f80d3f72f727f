// What dpmethods/processes/state.py's Watch reads of a module, in one pass each:
// _tensor_states (each parameter's and buffer's version counter, storage, shape,
// strides, dtype, device and requires_grad), _dict_versions (the version of each
// of its submodules' dicts) and _identities (each submodule's class and __dict__).
//
// Before each batch of a map on worker processes, the caller checks that the
// module did not change since its workers got it. In Python that is six
// attribute reads per tensor and a call per dict and submodule, about a
// millisecond for a model of 2,000 tensors; here a few nanoseconds each. The
// values are packed into bytes: two looks agree exactly when the bytes do.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstdint>
#include <vector>

namespace dpmethods {
namespace {

void append_state(const at::Tensor& t, std::vector<int64_t>& out) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  // Raises for an inference tensor (it has no version counter), as Tensor._version does.
  out.push_back(static_cast<int64_t>(torch::autograd::impl::version_counter(t).current_version()));
  const bool stored = impl->has_storage();
  out.push_back(stored ? reinterpret_cast<int64_t>(impl->storage().unsafeGetStorageImpl()) : 0);
  out.push_back(stored ? reinterpret_cast<int64_t>(impl->storage().data()) : 0);
  out.push_back(impl->storage_offset());
  const c10::Device device = t.device();
  out.push_back(static_cast<int64_t>(t.scalar_type()) | (static_cast<int64_t>(t.layout()) << 8) |
                (static_cast<int64_t>(device.type()) << 16) |
                ((static_cast<int64_t>(device.index()) & 0xffff) << 24) |
                (static_cast<int64_t>(t.requires_grad()) << 40) | (static_cast<int64_t>(t.is_conj()) << 41) |
                (static_cast<int64_t>(t.is_neg()) << 42));
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  out.push_back(static_cast<int64_t>(sizes.size()));
  out.insert(out.end(), sizes.begin(), sizes.end());
  out.insert(out.end(), strides.begin(), strides.end());
}

}  // namespace

// _tensor_states(tensors) -> bytes, for a list or tuple of plain tensors and
// parameters; None for anything else (a tensor subclass: the caller reads it in
// Python). Raises what reading a tensor raises (an inference tensor's version).
PyObject* tensor_states(PyObject* /*self*/, PyObject* seq) {
  HANDLE_TH_ERRORS
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    Py_RETURN_NONE;
  }
  // The list itself (no copy): nothing below calls back into Python, so it cannot change.
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n) * 10);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = items[i];
    if (!THPVariable_Check(obj)) {
      Py_RETURN_NONE;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || t.unsafeGetTensorImpl()->is_python_dispatch()) {
      Py_RETURN_NONE;
    }
    append_state(t, out);
  }
  return PyBytes_FromStringAndSize(
      reinterpret_cast<const char*>(out.data()), static_cast<Py_ssize_t>(out.size() * sizeof(int64_t)));
  END_HANDLE_TH_ERRORS
}

// _dict_versions(dicts) -> bytes: each dict's version tag (a new one at every
// change to the dict), for a list or tuple of dicts; None where this Python has
// no per-dict version (3.14 and later) or an item is not a dict.
PyObject* dict_versions(PyObject* /*self*/, PyObject* seq) {
#if PY_VERSION_HEX >= 0x030E0000
  (void)seq;
  Py_RETURN_NONE;
#else
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<uint64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
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
  return PyBytes_FromStringAndSize(
      reinterpret_cast<const char*>(out.data()), static_cast<Py_ssize_t>(out.size() * sizeof(uint64_t)));
#endif
}

// _identities(objects) -> bytes: each object's class and __dict__, by address
// (the caller keeps both alive, so an address is never reused while it compares).
PyObject* identities(PyObject* /*self*/, PyObject* seq) {
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
    Py_RETURN_NONE;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<uintptr_t> out(static_cast<size_t>(2 * n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    // The instance's own dict, without looking up the __dict__ attribute on its class.
    PyObject* d = PyObject_GenericGetDict(items[i], nullptr);
    if (d == nullptr) {
      return nullptr;
    }
    out[static_cast<size_t>(2 * i)] = reinterpret_cast<uintptr_t>(Py_TYPE(items[i]));
    out[static_cast<size_t>(2 * i + 1)] = reinterpret_cast<uintptr_t>(d);
    Py_DECREF(d);
  }
  return PyBytes_FromStringAndSize(
      reinterpret_cast<const char*>(out.data()), static_cast<Py_ssize_t>(out.size() * sizeof(uintptr_t)));
}

}  // namespace dpmethods
