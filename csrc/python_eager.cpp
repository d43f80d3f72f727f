// The eager entry point of the gather: dpmethods._C._gather_coalesced.
//
// torch.ops.dpmethods.gather_coalesced goes through the boxed calling
// convention: every input is converted to an IValue, copied into a
// std::vector and released again. Since torch 2.10 a C++ reference to a tensor
// that Python also holds keeps its PyObject alive, so each of those copies and
// releases takes the GIL; with 1024 inputs that bookkeeping cost more than the
// gather. This entry point borrows the tensors straight from the Python
// objects (no reference counting) and calls the autograd-aware kernel
// unboxed. dpmethods/ops.py uses it for plain tensors outside torch.compile
// and outside __torch_function__ modes; everything else takes torch.ops.
#include "gather_common.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <vector>

namespace dpmethods {
namespace {

// Above this many input bytes the copy runs with the GIL released: other
// Python threads then run during a long copy, while small gathers do not pay
// for handing the GIL over and waiting to get it back.
constexpr int64_t kReleaseGilBytes = int64_t{1} << 20;

// Tensors borrowed from Python objects that outlive this struct. They hold no
// reference, so destroying them must not decrement one.
struct BorrowedTensors {
  std::vector<at::Tensor> tensors;
  ~BorrowedTensors() {
    for (auto& t : tensors) {
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    }
  }
};

int64_t as_int(PyObject* obj, const char* name) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    TORCH_CHECK_TYPE(
        false, "gather_coalesced(): ", name, " must be an int, got ", Py_TYPE(obj)->tp_name);
  }
  return static_cast<int64_t>(v);
}

}  // namespace

// _gather_coalesced(tensors, num_replicas, dim, device) -> list[Tensor] | None.
// Returns None when the fast path does not apply (tensor subclasses, an active
// __torch_function__ mode, a sequence that is not a list or tuple), so the
// caller takes torch.ops.dpmethods.gather_coalesced instead.
PyObject* gather_coalesced_eager(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(
      nargs == 4, "_gather_coalesced() takes 4 arguments (tensors, num_replicas, dim, device), got ",
      nargs);
  PyObject* seq = args[0];
  if ((!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) ||
      !THPDevice_Check(args[3]) || at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  const int64_t num_replicas = as_int(args[1], "num_replicas");
  const int64_t dim = as_int(args[2], "dim");
  const c10::Device device = reinterpret_cast<THPDevice*>(args[3])->device;
  // A tuple of strong references keeps every borrowed tensor alive even if the
  // caller's list changes while the GIL is released.
  THPObjectPtr items(PySequence_Tuple(seq));
  if (!items) {
    throw python_error();
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(items.get());
  BorrowedTensors in;
  in.tensors.reserve(static_cast<size_t>(n));
  int64_t bytes = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(items.get(), i);
    if (!THPVariable_CheckExact(obj)) {
      Py_RETURN_NONE;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    in.tensors.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
    if (t.defined()) {
      bytes += static_cast<int64_t>(t.nbytes());
    }
  }
  std::vector<at::Tensor> outs;
  if (bytes >= kReleaseGilBytes) {
    pybind11::gil_scoped_release no_gil;
    outs = gather_coalesced_autograd(in.tensors, num_replicas, dim, device);
  } else {
    outs = gather_coalesced_autograd(in.tensors, num_replicas, dim, device);
  }
  THPObjectPtr list(PyList_New(static_cast<Py_ssize_t>(outs.size())));
  if (!list) {
    throw python_error();
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    PyObject* wrapped = THPVariable_Wrap(std::move(outs[i]));
    if (!wrapped) {
      throw python_error();
    }
    PyList_SET_ITEM(list.get(), static_cast<Py_ssize_t>(i), wrapped);
  }
  return list.release();
  END_HANDLE_TH_ERRORS
}

}  // namespace dpmethods
