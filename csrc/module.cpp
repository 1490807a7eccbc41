// The Python module accumkernels._C. Importing it loads the shared library,
// whose static initializers register the ops with torch (TORCH_LIBRARY);
// it also reports what this build holds.
#include <Python.h>

#include <exception>

#include "cpu/kernels.h"

namespace accumkernels {
PyMethodDef* grad_inbox_methods();  // grad_inbox.cpp: the "hooks" intake's native gradient inbox
}  // namespace accumkernels

namespace {

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C",
                          "accumkernels native ops (registered under torch.ops.accumkernels)", -1,
                          nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
#if defined(ACCUMKERNELS_WITH_CUDA)
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  try {
    if (PyModule_AddFunctions(m, accumkernels::grad_inbox_methods()) < 0 ||
        PyModule_AddIntConstant(m, "with_cuda", with_cuda) < 0 ||
        PyModule_AddStringConstant(m, "cpu_isa", accumkernels::cpu::kernels().isa) < 0) {
      Py_DECREF(m);
      return nullptr;
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
