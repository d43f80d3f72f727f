// The `dpmethods._C` Python module. Importing it loads this shared library,
// whose static initializers register the dpmethods operators with torch; the
// module itself only reports how it was built. Plain CPython API keeps this
// translation unit cheap to compile.
#include <Python.h>

#include "dpmethods_build_info.h"

namespace dpmethods {
// csrc/python_eager.cpp
PyObject* gather_coalesced_eager(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
// csrc/watch.cpp
PyObject* tensor_states(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* dict_versions(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* identities(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
}  // namespace dpmethods

namespace {

PyObject* torch_version(PyObject*, PyObject*) {
  return PyUnicode_FromString(DPMETHODS_TORCH_VERSION);
}

PyObject* cuda_arch_list(PyObject*, PyObject*) {
  return PyUnicode_FromString(DPMETHODS_CUDA_ARCHS);
}

PyObject* with_cuda(PyObject*, PyObject*) {
  return PyBool_FromLong(DPMETHODS_WITH_CUDA);
}

PyMethodDef kMethods[] = {
    {"torch_version", torch_version, METH_NOARGS, "torch version the extension was built against."},
    {"cuda_arch_list", cuda_arch_list, METH_NOARGS,
     "Semicolon-separated CUDA targets compiled (sm_XX / compute_XX); empty without CUDA."},
    {"with_cuda", with_cuda, METH_NOARGS, "True when the CUDA kernels were compiled in."},
    {"_gather_coalesced", reinterpret_cast<PyCFunction>(dpmethods::gather_coalesced_eager),
     METH_FASTCALL,
     "_gather_coalesced(tensors, num_replicas, dim, device): the eager gather of "
     "dpmethods.ops.gather_coalesced; None where torch.ops must be used instead."},
    {"_tensor_states", reinterpret_cast<PyCFunction>(dpmethods::tensor_states), METH_FASTCALL,
     "_tensor_states(tensors[, record]): each tensor's version, storage, shape, strides, dtype, "
     "device and requires_grad, packed in bytes, or whether they equal record; None for a tensor "
     "subclass."},
    {"_dict_versions", reinterpret_cast<PyCFunction>(dpmethods::dict_versions), METH_FASTCALL,
     "_dict_versions(dicts[, record]): each dict's version tag, packed in bytes, or whether they "
     "equal record; None where Python has none."},
    {"_identities", reinterpret_cast<PyCFunction>(dpmethods::identities), METH_FASTCALL,
     "_identities(objects[, record]): each object's class and __dict__ by address, packed in bytes, "
     "or whether they equal record."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_C", "Compiled kernels of dpmethods (ops under torch.ops.dpmethods).",
    -1, kMethods,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  return PyModule_Create(&kModule);
}
