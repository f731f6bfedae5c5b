// `import runner._C` needs a module init function; the module itself is empty because the ops are
// registered by TORCH_LIBRARY / TORCH_LIBRARY_IMPL static initialisers when the library loads.
// (Lives here rather than in ops.cpp only because of file ownership; move it if convenient.)
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
